"""A plain transformers Trainer script that learns a 2:4 mask (what `hf-maskllm learn` does, spelled out).

Run: python examples/trainer_script.py --steps 20
Works unchanged under `accelerate launch` / `torchrun` (DDP).
"""

from __future__ import annotations

import argparse

from transformers import Trainer, TrainingArguments, default_data_collator

from hf_maskllm import MaskAnnealCallback, MaskConfig, check_nm, get_mask_model
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
    training_args = TrainingArguments(
        output_dir=args.output,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=5e-4,
        adam_beta2=0.95,
        weight_decay=0.1,
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
    )
    trainer.train()
    if not trainer.is_world_process_zero():  # under DDP every rank holds the same masks: one reports
        return
    mask_model.eval()
    ppl = evaluate_perplexity(mask_model, tokenizer, "wikipedia:heldout", seqlen=512, max_windows=8)
    print(f"held-out Wikipedia perplexity with the learned 2:4 mask: {ppl:.2f}")
    mask_model.save_pretrained(f"{args.output}/mask")
    print(check_nm(mask_model.merge_and_unload()))


if __name__ == "__main__":
    main()
