"""Swapping layers of a transformers model: wrap targets in :class:`MaskedLinear`, or show them bare.

Masks never copy a base weight: a :class:`MaskedLinear` holds the original layer as
``base_layer``, and every view here only moves module references.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .layer import MaskedLinear

__all__ = ["replace_module", "unwrapped", "wrap_layers"]


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` of ``model``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def wrap_layers(model: nn.Module, logits: dict[str, torch.Tensor], n: int, m: int) -> None:
    """Replace each layer named in ``logits`` by a :class:`MaskedLinear` over it with those logits."""
    for name, layer_logits in logits.items():
        replace_module(model, name, MaskedLinear(model.get_submodule(name), n, m, layer_logits))


@contextlib.contextmanager
def unwrapped(model: nn.Module, layers: dict[str, MaskedLinear]) -> Iterator[nn.Module]:
    """Temporarily put each masked layer's base layer back in place: ``model`` runs dense, as before wrapping."""
    try:
        for name, layer in layers.items():
            replace_module(model, name, layer.base_layer)
        yield model
    finally:
        for name, layer in layers.items():
            replace_module(model, name, layer)
