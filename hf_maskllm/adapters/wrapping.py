"""Swapping layers of a transformers model: wrap targets in :class:`MaskedLinear`, or show them bare.

Masks never copy a base weight: a :class:`MaskedLinear` holds the original layer as
``base_layer``, and every view here only moves module references (``nn.Module.set_submodule``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .layer import MaskedLinear
from .schedule import MaskSchedule

__all__ = ["unwrapped", "wrap_layers"]


def wrap_layers(model: nn.Module, names: list[str], n: int, m: int, schedule: MaskSchedule) -> None:
    """Replace each layer named in ``names`` by a :class:`MaskedLinear` over it (no mask yet) reading ``schedule``."""
    for name in names:
        model.set_submodule(name, MaskedLinear(model.get_submodule(name), n, m, schedule=schedule))


@contextlib.contextmanager
def unwrapped(model: nn.Module, layers: dict[str, MaskedLinear]) -> Iterator[nn.Module]:
    """Temporarily put each masked layer's base layer back in place: ``model`` runs dense, as before wrapping."""
    try:
        for name, layer in layers.items():
            model.set_submodule(name, layer.base_layer)
        yield model
    finally:
        for name, layer in layers.items():
            model.set_submodule(name, layer)
