"""``MaskAdamW``: the optimizer for mask logits, at 1 byte of state per masked weight.

AdamW keeps two float32 states per logit: with fp32 logits and grads that is 24 bytes of training
state per masked 2:4 weight (1.5 logits per weight). ``MaskAdamW`` keeps, per group of m weights,
one float32 second moment (the mean over the group's C logits: every logit of a group shares one
softmax, so their gradient scales match; Adafactor's row factor, without a column factor), and by
default no first moment. With 16-bit logits it rounds every update *stochastically* (unbiased),
so steps far below the logits' 16-bit resolution still add up; AdamW with round-to-nearest would
silently drop them. Bytes per masked 2:4 weight (logits + grads + state):

=================================  ======  =====  =====  =====
setting                            logits  grads  state  total
=================================  ======  =====  =====  =====
fp32 logits, ``torch.optim.AdamW``  6       6      12     24
bf16 logits, ``MaskAdamW`` bf16 m   3       3      3 + 1  10
bf16 logits, ``MaskAdamW`` (dflt)   3       3      1      7
=================================  ======  =====  =====  =====

Measured quality of each setting: docs/training.md ("Memory"). The update runs as one fused
``torch.compile`` kernel per parameter when a compiler is available.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .adapters.sampling import draw_seed, hash_bits
from .errors import ConfigError

__all__ = ["MaskAdamW", "compiler_available", "training_state_bytes"]

_MANTISSA_DROP = {torch.bfloat16: 16, torch.float16: 13}  # float32 mantissa bits the 16-bit type lacks


def _stochastic_round(x: torch.Tensor, dtype: torch.dtype, seed: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, 1-D) rounded to ``dtype`` up or down with probability by distance (unbiased).

    Random low bits are added to the float32 bit pattern, then truncated: exact for bfloat16, and for
    float16 in its normal range (its subnormals, below 6e-5, round to nearest).
    """
    if dtype == torch.float32:
        return x
    drop = _MANTISSA_DROP[dtype]
    noise = hash_bits(seed, x.shape[0], 1, x.device).view(-1) & ((1 << drop) - 1)
    bits = (x.view(torch.int32) + noise) & ~((1 << drop) - 1)
    return bits.view(torch.float32).to(dtype)


def _update(p, grad, v, m, lr, beta1, beta2, eps, weight_decay, step, seed):
    """One MaskAdamW step of a ``[G, C]`` parameter; returns the new ``(p, v, m)`` (m may be None)."""
    c = p.shape[1]
    g = [grad[:, j].float() for j in range(c)]
    mean_sq = g[0].square()
    for gj in g[1:]:
        mean_sq = mean_sq + gj.square()
    v = beta2 * v + (1.0 - beta2) * (mean_sq / c)
    denom = torch.sqrt(v / (1.0 - beta2**step)) + eps
    if m is not None:
        m_new = [beta1 * m[:, j].float() + (1.0 - beta1) * g[j] for j in range(c)]
        direction = [mj / (1.0 - beta1**step) for mj in m_new]
    else:
        direction = g
    decay = 1.0 - lr * weight_decay
    new = [p[:, j].float() * decay - lr * direction[j] / denom for j in range(c)]
    # Candidate-major [C, G] stacking: contiguous stores vectorise. Transposed back by the caller.
    new_p = _stochastic_round(torch.stack(new, dim=0).view(-1), p.dtype, seed)
    new_m = None
    if m is not None:
        new_m = _stochastic_round(torch.stack(m_new, dim=0).view(-1), m.dtype, seed ^ 0x5BD1E995)
    return new_p, v, new_m


_COMPILED: dict[str, Any] = {}


def compiler_available() -> bool:
    """Whether ``torch.compile`` can build kernels here (CUDA, or a C++ compiler for CPU code)."""
    return torch.cuda.is_available() or shutil.which("c++") is not None or shutil.which("g++") is not None


class MaskAdamW(torch.optim.Optimizer):
    """AdamW for ``[G, C]`` mask logits with a per-group second moment and stochastic rounding.

    Args:
        params: The logits (``MaskModel.parameters()`` or the Trainer's parameter groups). Any
            parameter is treated as rows of its last dimension.
        lr: Learning rate (the reference recipe: 5e-4).
        betas: ``(beta1, beta2)``; beta1 only matters with ``momentum_dtype``.
        eps: Added to the root of the second moment.
        weight_decay: Decoupled weight decay (the reference applies 0.1 to the logits).
        momentum_dtype: ``None`` (default: no first moment, 0 bytes), ``torch.bfloat16`` (2 bytes
            per logit, stochastically rounded) or ``torch.float32``.
        compile: Fuse each update with ``torch.compile``; default: when a C++ compiler or CUDA is there.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        momentum_dtype: torch.dtype | None = None,
        compile: bool | None = None,
    ) -> None:
        if not lr >= 0:
            raise ConfigError(f"MaskAdamW: lr must be >= 0, got {lr}.")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ConfigError(f"MaskAdamW: betas must be in [0, 1), got {betas}.")
        if momentum_dtype not in (None, torch.bfloat16, torch.float32):
            raise ConfigError(
                f"MaskAdamW: momentum_dtype must be None, torch.bfloat16 or torch.float32, got {momentum_dtype}."
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.momentum_dtype = momentum_dtype
        self.compile = compiler_available() if compile is None else bool(compile)

    def _fn(self) -> Callable:
        if not self.compile:
            return _update
        if "update" not in _COMPILED:
            _COMPILED["update"] = torch.compile(_update, options={"cpp.enable_tiling_heuristics": False})
        return _COMPILED["update"]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fn = self._fn()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError("MaskAdamW does not support sparse gradients.")
                rows = p.view(-1, p.shape[-1]) if p.dim() else p.view(1, 1)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros(rows.shape[0], dtype=torch.float32, device=p.device)
                    if self.momentum_dtype is not None:
                        state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype)
                state["step"] += 1
                m = state.get("exp_avg")
                m_rows = m.view(rows.shape) if m is not None else None
                v = state["exp_avg_sq"]
                grad = p.grad.reshape(rows.shape)
                if self.compile:  # one kernel for every group count
                    for t in (rows, grad, v) + ((m_rows,) if m_rows is not None else ()):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                new_p, new_v, new_m = fn(
                    rows, grad, v, m_rows, group["lr"], beta1, beta2, group["eps"],
                    group["weight_decay"], float(state["step"]), draw_seed(p.device),
                )  # fmt: skip
                rows.copy_(new_p.view(rows.shape[1], rows.shape[0]).t())
                v.copy_(new_v)
                if m is not None:
                    m_rows.copy_(new_m.view(rows.shape[1], rows.shape[0]).t())
        return loss


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the trainable parameters, their gradients (as allocated, or as they will be: one per
    trainable parameter in its dtype) and every tensor in the optimizer state."""
    params = [p for p in model.parameters() if p.requires_grad]
    state = 0
    for per_param in optimizer.state.values():
        state += sum(t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor))
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.numel() * p.element_size() for p in params),
        "optimizer": state,
    }
