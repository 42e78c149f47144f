"""The layers hf_maskllm works on: ``nn.Linear`` and transformers' GPT-2 ``Conv1D``.

One place for "is this a linear layer", "its weight as ``[out, in]``" and "which module is the
output embedding", shared by the adapters, the priors and the compressed checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import TargetError

__all__ = ["dense_weight_view", "is_conv1d", "is_linear", "output_embedding_names"]


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' GPT-2 style ``Conv1D`` (weight stored ``[in, out]``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def is_linear(module: nn.Module) -> bool:
    """The supported layer types: ``nn.Linear`` and ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def dense_weight_view(module: nn.Module) -> torch.Tensor:
    """The layer's weight as ``[out, in]`` (a view, no copy; transposed for ``Conv1D``)."""
    if isinstance(module, nn.Linear):
        return module.weight
    if is_conv1d(module):
        return module.weight.t()
    raise TargetError(f"{type(module).__name__} is not an nn.Linear or transformers Conv1D.")


def output_embedding_names(model: nn.Module) -> set[str]:
    """Names under which ``model.get_output_embeddings()`` appears (empty if it has none)."""
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if out is None:
        return set()
    return {name for name, module in model.named_modules() if module is out}
