"""Merging a mask into the base weights: ``W * hard_mask`` for good, or in a view of the model for a save."""

from __future__ import annotations

import contextlib
import copy
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


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing every parameter, buffer and child of ``module`` (its own dict of children,
    so that replacing one in the copy leaves ``module`` as it is)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


@contextlib.contextmanager
def merged_view(model: nn.Module, layers: dict[str, MaskedLinear]) -> Iterator[nn.Module]:
    """A view of ``model`` with plain layers holding ``W * hard_mask`` where the masked layers are.

    The view is a new tree of module objects along the paths to the masked layers; every other module,
    parameter and buffer is ``model``'s own. The merged weights are new tensors: ``model`` is not changed
    at any point, so it can keep training or serving (another thread, hooks, a compiled forward) while the
    view is saved."""
    view = _shallow_copy(model)
    copies: dict[str, nn.Module] = {"": view}
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        parts = parent_name.split(".") if parent_name else []
        for depth in range(len(parts)):
            prefix = ".".join(parts[: depth + 1])
            if prefix not in copies:
                above = copies[".".join(parts[:depth])]
                copies[prefix] = above._modules[parts[depth]] = _shallow_copy(above._modules[parts[depth]])
        base = layer.base_layer
        with torch.no_grad():
            masked = dense_weight_view(base) * layer.hard_mask().to(base.weight.dtype)  # [out, in]
        plain = copy.copy(base)
        plain._parameters = dict(base._parameters)
        plain._parameters["weight"] = nn.Parameter(
            masked.t().contiguous() if is_conv1d(base) else masked, requires_grad=False
        )
        copies[parent_name]._modules[child] = plain
    yield view
