"""A plain transformers Trainer script that learns a 2:4 mask (what `hf-maskllm learn` does, spelled out).

Run: python examples/trainer_script.py --steps 20
Works unchanged with several processes: `torchrun --nproc-per-node 8 examples/trainer_script.py` (DDP) or
`accelerate launch --config_file examples/accelerate_fsdp.yaml examples/trainer_script.py` (FSDP2); see
examples/README.md.
"""

from __future__ import annotations

import argparse

from transformers import Trainer, default_data_collator

from hf_maskllm import (
    MaskAdamW,
    MaskAnnealCallback,
    MaskConfig,
    MaskModel,
    MaskTrainingArguments,
    check_nm,
    get_mask_model,
)
from hf_maskllm.data import causal_lm_dataset
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.perplexity import evaluate_perplexity


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="outputs/example")
    args = parser.parse_args()

    model, tokenizer = load_smollm2()
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
    mask_model.print_trainable_parameters()
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=256)
    # the recipe's lr (constant), weight decay, betas, clipping and micro-batches of two sequences
    training_args = MaskTrainingArguments(
        output_dir=args.output,
        max_steps=args.steps,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=mask_model,
        args=training_args,
        train_dataset=train,
        data_collator=default_data_collator,
        callbacks=[MaskAnnealCallback()],
        # 16-bit logits need MaskAdamW (stochastic rounding); the Trainer default AdamW would lose most updates
        optimizer_cls_and_kwargs=(MaskAdamW, {"lr": training_args.learning_rate}),
    )
    trainer.train()
    # Under FSDP each process holds a shard of the logits: every process gathers them (under DDP or in one
    # process this is just the state dict), then the main process saves and reports on an unsharded model.
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.is_world_process_zero():
        return
    mask_model.save_pretrained(f"{args.output}/mask", state_dict=state_dict)
    model, tokenizer = load_smollm2()
    mask_model = MaskModel.from_pretrained(model, f"{args.output}/mask")  # eval mode, exactly the saved masks
    ppl = evaluate_perplexity(mask_model, tokenizer, "wikipedia:heldout", seqlen=512, max_windows=8)
    print(f"held-out Wikipedia perplexity with the learned 2:4 mask: {ppl:.2f}")
    print(check_nm(mask_model.merge_and_unload()))


if __name__ == "__main__":
    main()
