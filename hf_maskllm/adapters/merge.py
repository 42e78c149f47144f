"""Merging a mask into the base weights: ``W * hard_mask`` for good, or for the length of a save."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import NMViolationError
from ..modules import dense_weight_view, is_conv1d
from .layer import MaskedLinear

__all__ = ["check_hard_masks", "merge_layers", "merged_view"]


def check_hard_masks(layers: dict[str, MaskedLinear], n: int, m: int) -> None:
    """Raise :class:`NMViolationError` unless every hard mask keeps at most ``n`` of each ``m`` inputs."""
    for name, layer in layers.items():
        kept = layer.hard_mask().reshape(-1, m).sum(dim=1)
        if bool((kept > n).any()):
            raise NMViolationError(
                f"The hard mask of {name} keeps more than {n} of {m} weights in {int((kept > n).sum())} groups; "
                "refusing to merge a mask that is not N:M. Its logits are corrupt: reload the mask."
            )


@torch.no_grad()
def merge_layers(model: nn.Module, layers: dict[str, MaskedLinear], n: int, m: int) -> nn.Module:
    """Write ``W * hard_mask`` into every masked layer's base weight and put the plain layer back in ``model``."""
    check_hard_masks(layers, n, m)
    for name, layer in layers.items():
        model.set_submodule(name, layer.merge())
    return model


@contextlib.contextmanager
def merged_view(model: nn.Module, layers: dict[str, MaskedLinear]) -> Iterator[nn.Module]:
    """Temporarily put plain layers with ``W * hard_mask`` in place of the masked layers (weights restored after)."""
    originals = {}
    try:
        for name, layer in layers.items():
            base = layer.base_layer
            originals[name] = base.weight.data
            masked = dense_weight_view(base) * layer.hard_mask().to(base.weight.dtype)  # [out, in]
            base.weight.data = masked.t().contiguous() if is_conv1d(base) else masked
            model.set_submodule(name, base)
        yield model
    finally:
        for name, layer in layers.items():
            if name in originals:
                layer.base_layer.weight.data = originals[name]
            model.set_submodule(name, layer)
