"""Run by tests/test_distributed.py under torchrun: a plain Trainer learning masks with DDP (gloo, CPU).

Each rank saves its hard masks and logits to <out>/rank<k>.safetensors. With a second argument
``named``, the model holds two masks (``default`` and ``task``) and trains ``task``; the file then also
holds the inactive ``default`` mask's logits and hard masks.
"""

from __future__ import annotations

import sys

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments

from hf_maskllm import MaskAnnealCallback, MaskConfig, get_mask_model

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from models import tiny_llama  # noqa: E402


def main(out: str, named: bool = False) -> None:
    model = tiny_llama(seed=0)
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
    if named:
        mask_model.add_mask("task", MaskConfig(prior="magnitude", prior_strength=2.0))
        mask_model.set_mask("task")
    ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        out,
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=0.05,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        logging_steps=3,
        seed=0,
    )
    trainer = Trainer(model=mask_model, args=args, train_dataset=data, callbacks=[MaskAnnealCallback()])
    trainer.train()
    rank = torch.distributed.get_rank()
    tensors = {f"{k}.mask": v.to(torch.uint8) for k, v in mask_model.hard_masks().items()}
    tensors.update(
        {
            f"{k}.logits": layer.mask_logits.detach().contiguous()
            for k, layer in mask_model.masked_layers().items()
        }
    )
    tensors["world_size"] = torch.tensor(torch.distributed.get_world_size())
    if named:
        tensors["active"] = torch.tensor(list(mask_model.active_mask.encode()), dtype=torch.uint8)
        tensors.update(
            {f"default.{k}.mask": v.to(torch.uint8) for k, v in mask_model.hard_masks("default").items()}
        )
        tensors.update(
            {
                f"default.{k}.logits": layer.get_logits("default").detach().contiguous()
                for k, layer in mask_model.masked_layers().items()
            }
        )
    # the same global seed on every rank (as the Trainer sets it), yet each rank's Gumbel noise is its own
    from hf_maskllm.numerics.sampling import sample_soft_mask
    from hf_maskllm.patterns import candidate_patterns

    torch.manual_seed(0)
    noise_probe = sample_soft_mask(torch.zeros(64, 6), candidate_patterns(2, 4), 1.0, 1.0)
    save_file({"noise_probe": noise_probe}, f"{out}/probe{rank}.safetensors")
    save_file(tensors, f"{out}/rank{rank}.safetensors")


if __name__ == "__main__":
    main(sys.argv[1], named=sys.argv[2:] == ["named"])
