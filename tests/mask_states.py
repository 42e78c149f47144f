"""Mask models in known states, shared by the adapter tests (a plain module: ``from mask_states import ...``)."""

from __future__ import annotations

from pathlib import Path

import torch
from models import tiny_llama

from hf_maskllm import MaskConfig, MaskModel, get_mask_model


def randomise(mm: MaskModel, seed: int) -> None:
    """Give the active mask logits far from a fresh init (as after training)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))


def two_masks(**cfg) -> MaskModel:
    """A model with masks "default" and "b" (seeded differently, both far from init); "default" active."""
    mm = get_mask_model(tiny_llama(), MaskConfig(**{"logits_dtype": "float32", **cfg}))
    randomise(mm, 1)
    mm.add_mask("b", MaskConfig(**{"logits_dtype": "float32", "seed": 5, **cfg}))
    mm.set_mask("b")
    randomise(mm, 2)
    mm.set_mask("default")
    return mm


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys in the same order, and equal tensors."""
    return list(a) == list(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def saved_mask(tmp_path: Path, seed: int = 9) -> Path:
    """A single mask, far from init, saved to ``tmp_path/saved-<seed>`` (hard masks only)."""
    folder = tmp_path / f"saved-{seed}"
    mm = get_mask_model(tiny_llama(), MaskConfig(seed=seed))
    randomise(mm, seed)
    mm.save_pretrained(folder)
    return folder


def trained_like(factory=tiny_llama, seed: int = 3, **cfg) -> MaskModel:
    """A mask model whose logits are far from a fresh model's (as after training)."""
    mm = get_mask_model(factory(), MaskConfig(**{"seed": 0, **cfg}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    return mm


def assert_same_masks(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same keys in the same order, and equal tensors (naming the first layer that differs)."""
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
