"""Keeping denormal floats out of mask sampling: values below the float32 normal range become zeros.

At a low Gumbel temperature most probabilities of a group underflow. Those that land in the
denormal range (``|x| < 2**-126 = 1.1754944e-38``) make the soft mask, ``W * mask`` and the logits'
gradient partly denormal, and x86 CPUs without flush-to-zero run every matmul and elementwise op
that touches them 10-250x slower. The sampling passes (``sampling.py``, ``fused_linear.py``)
therefore flush explicitly, inside the same fused pass and without ever forming a denormal in
between: a value below the normal range becomes 0, every other value is bitwise what the plain
formula gives. ``W * mask`` goes further: an entry below ``MASKED_WEIGHT_FLOOR`` (2**-64) becomes 0,
because the matmuls multiply every entry by activations or gradients, and from an entry just above
the normal range those products are denormal. Midway through the schedule, where many
probabilities lie between 1e-38 and 1e-20, they made a CPU training step about 25% slower.
``torch.set_flush_denormal`` is not used: it is per thread (intra-op worker threads keep their own
setting) and global for the user's process.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FLOAT32_TINY",
    "LN_FLOAT32_TINY",
    "MASKED_WEIGHT_FLOOR",
    "flush_gradient",
    "flushed_product",
    "is_denormal",
    "masked_weight_product",
]

FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: the smallest normal float32 (bfloat16 shares it)
# The smallest float32 whose exponential is normal: float32(log(2**-126)) itself lies just below the true
# logarithm, and its exponential is a denormal (which an exp clamped there would compute on every lane).
LN_FLOAT32_TINY = torch.nextafter(
    torch.tensor(math.log(FLOAT32_TINY), dtype=torch.float32), torch.tensor(0.0)
).item()
# Entries of ``W * mask`` below this are 0: their products with the activations or gradients they meet in
# a matmul would otherwise reach the denormal range. An entry of 2**-64 (5e-20) adds less than float32
# rounding to any sum it enters beside the layer's weights (~1e-2 each); 2**-126 / 2**-64 leaves activations
# and gradients down to 2**-62 a normal product.
MASKED_WEIGHT_FLOOR = 2.0**-64
_LIFT = 2.0**32  # products are formed this much larger (a power of two: exact), then scaled back


def flushed_product(a: torch.Tensor, b: torch.Tensor, floor: float = FLOAT32_TINY) -> torch.Tensor:
    """``a * b`` with results below ``floor`` (by default the float32 normal range; at least it) set to 0,
    and no denormal formed on the way.

    ``b`` lies in ``[0, 1]`` (a probability or a mask value) and is normal or zero; the product is
    formed ``2**32`` larger, tested against the normal range there, and scaled back, so a kept value
    is bitwise ``a * b`` (power-of-two scaling is exact) and a flushed one never existed as a
    denormal. Correct for ``|a| < 2**96``. float32 or bfloat16 (same exponent range).
    """
    lifted = a * (b * _LIFT)
    return torch.where(lifted.abs() < floor * _LIFT, 0.0, lifted) * (1.0 / _LIFT)


def is_denormal(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` is nonzero but below the float32 normal range (a bool tensor of ``t``'s shape)."""
    a = t.float().abs()
    return (a > 0) & (a < FLOAT32_TINY)


class _FlushGradient(torch.autograd.Function):
    """Identity forward; the gradient with values below the float32 normal range set to 0."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(grad.abs() < FLOAT32_TINY, 0.0, grad)


def flush_gradient(t: torch.Tensor) -> torch.Tensor:
    """``t`` unchanged, but the gradient that reaches it through autograd is flushed (see module docstring)."""
    return _FlushGradient.apply(t)


class _MaskedWeightProduct(torch.autograd.Function):
    """``W * mask`` flushed, with the plain product's gradients (each flushed the same way)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, mask)
        return flushed_product(weight, mask, MASKED_WEIGHT_FLOOR)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        weight, mask = ctx.saved_tensors
        grad_w = flushed_product(grad, mask) if ctx.needs_input_grad[0] else None
        grad_m = grad * weight if ctx.needs_input_grad[1] else None  # d(W * mask)/dmask = W: not small
        return grad_w, grad_m


def masked_weight_product(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``weight * mask`` for autograd (the eager masked weight), entries below ``MASKED_WEIGHT_FLOOR`` 0.

    The mask's gradient is the plain product's (``grad * W``: a value that underflows does not stop
    the logits from learning). float16 weights multiply plainly: their own normal range ends far
    above float32's, and CPUs compute float16 in float32.
    """
    if weight.dtype == torch.float16 or mask.dtype == torch.float16:
        return weight * mask
    return _MaskedWeightProduct.apply(weight, mask)
