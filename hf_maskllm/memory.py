"""``training_state_bytes``: what a mask-learning run holds in memory from one optimizer step to the next.

Counted: the trainable parameters (the mask logits), their gradients, every optimizer state tensor,
the state callbacks keep between steps (``MaskAnnealCallback`` keeps each group's previous hard
choice for the flip rate) and masks cached by masked layers. Not counted: the frozen model weights
and the activations of one step, which a dense forward + backward also pays.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .adapters.layer import MaskedLinear
from .optim import local_shard

__all__ = ["training_state_bytes"]


def _nbytes(t: torch.Tensor) -> int:
    local = local_shard(t)
    return local.numel() * local.element_size()


def training_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, callbacks: Iterable[Any] = ()
) -> dict[str, int]:
    """Bytes held across training steps by this process, by kind.

    Gradients are counted as allocated when present, else at the size autograd allocates (one per
    trainable parameter, in its dtype), so the figure holds after ``zero_grad(set_to_none=True)``.
    Sharded (FSDP2) tensors count their local shard. ``callbacks``: e.g. ``trainer.callback_handler.callbacks``;
    those with a ``held_bytes()`` method are counted.

    Returns:
        ``{"params", "grads", "optimizer", "callbacks", "caches", "total"}``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    state = 0
    for per_param in optimizer.state.values():
        state += sum(_nbytes(t) for t in per_param.values() if isinstance(t, torch.Tensor))
    caches = sum(module.cached_bytes() for module in model.modules() if isinstance(module, MaskedLinear))
    sizes = {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) if p.grad is not None else _nbytes(p) for p in params),
        "optimizer": state,
        "callbacks": sum(
            int(cb.held_bytes()) for cb in callbacks if callable(getattr(cb, "held_bytes", None))
        ),
        "caches": caches,
    }
    sizes["total"] = sum(sizes.values())
    return sizes
