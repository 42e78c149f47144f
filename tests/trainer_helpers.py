"""Token datasets and TrainingArguments shared by the tests that train with the transformers Trainer
(a plain module: ``from trainer_helpers import ...``)."""

from __future__ import annotations

import torch
from transformers import TrainingArguments

SEQ = 16


class TokenDataset(torch.utils.data.Dataset):
    """Rows of token ids as causal-LM examples (the labels are the inputs)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def cyclic_language(num: int, seed: int) -> torch.Tensor:
    """Sequences ``start, start + k, start + 2k, ...`` (mod 32) with k in {1, 2, 3}: learnable in context."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 32, (num, 1), generator=generator)
    step = torch.randint(1, 4, (num, 1), generator=generator)
    return (start + step * torch.arange(SEQ)) % 32 + 3


def random_tokens(num: int, seed: int) -> torch.Tensor:
    """Uniform random token ids ``[num, SEQ]``: nothing to learn, so masks move only by noise."""
    return torch.randint(3, 128, (num, SEQ), generator=torch.Generator().manual_seed(seed))


def training_args(tmp_path, **overrides) -> TrainingArguments:
    """TrainingArguments for a few seeded CPU steps of a tiny model (not the recipe); ``overrides`` win."""
    kwargs = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 6,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)
