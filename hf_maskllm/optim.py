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

import importlib.util
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch

try:  # FSDP2 shards parameters as DTensors; builds without torch.distributed have none
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    DTensor = Shard = type("_Absent", (), {})
from .adapters.sampling import hash_bits, seed_tensor
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


def compiler_available(device: torch.device | str | None = None) -> bool:
    """Whether ``torch.compile`` can build kernels for ``device`` (default: CUDA if present, else CPU):
    Triton for CUDA, a C++ compiler for CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return shutil.which("c++") is not None or shutil.which("g++") is not None


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
        seed: int = 0,
    ) -> None:
        if not lr >= 0:
            raise ConfigError(f"MaskAdamW: lr must be >= 0, got {lr}.")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ConfigError(f"MaskAdamW: betas must be in [0, 1), got {betas}.")
        if not eps > 0 or not weight_decay >= 0:
            raise ConfigError(f"MaskAdamW: eps must be > 0 and weight_decay >= 0, got {eps}, {weight_decay}.")
        if momentum_dtype not in (None, torch.bfloat16, torch.float32):
            raise ConfigError(
                f"MaskAdamW: momentum_dtype must be None, torch.bfloat16 or torch.float32, got {momentum_dtype}."
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.momentum_dtype = momentum_dtype
        self.compile = compiler_available() if compile is None else bool(compile)
        self.seed = int(seed)

    def _fn(self) -> Callable:
        if not self.compile:
            return _update
        if "update" not in _COMPILED:
            _COMPILED["update"] = torch.compile(_update, options={"cpp.enable_tiling_heuristics": False})
        return _COMPILED["update"]

    def _rounding_seed(self, step: int, index: int, row_offset: int, device: torch.device) -> torch.Tensor:
        """The stochastic-rounding seed of one parameter at one step: the same on every process.

        DDP replicas must round identically or their logits drift apart (DDP never re-syncs
        parameters); a function of (seed, step, parameter index, first row) guarantees it, and
        FSDP shards (other rows of a parameter) still get their own noise.
        """
        mixed = (self.seed * 0x9E3779B97F4A7C15) ^ (step * 0xBF58476D1CE4E5B9) ^ (index * 0x94D049BB133111EB)
        return seed_tensor((mixed ^ (row_offset * 0xD6E8FEB86659FD93)) % 2**64, device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fn = self._fn()
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError("MaskAdamW does not support sparse gradients.")
                rows, grad, row_offset = _local_rows(p)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    v = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
                    state["exp_avg_sq"] = _shard_like(v, p)  # sharded like p: checkpoints gather it whole
                    if self.momentum_dtype is not None:
                        state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype)
                state["step"] += 1
                step = int(state["step"])
                m = _local(state["exp_avg"]) if "exp_avg" in state else None
                v = _local(state["exp_avg_sq"])
                if self.compile:  # one kernel for every group count
                    for t in (rows, grad, v) + ((m,) if m is not None else ()):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                new_p, new_v, new_m = fn(
                    rows, grad, v, m, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                    float(step), self._rounding_seed(step, index, row_offset, rows.device),
                )  # fmt: skip
                rows.copy_(new_p.view(rows.shape[1], rows.shape[0]).t())
                v.copy_(new_v)
                if m is not None:
                    m.copy_(new_m.view(rows.shape[1], rows.shape[0]).t())
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but keeps the states' own dtypes (torch casts them to the parameter's, e.g. bf16,
        which would round the float32 second moment)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            state = self.state.get(p)
            if not state:
                continue
            device = state["exp_avg_sq"].device
            state["exp_avg_sq"] = saved[i]["exp_avg_sq"].to(device=device, dtype=torch.float32, copy=True)
            if "exp_avg" in state:
                if self.momentum_dtype is None:
                    raise ConfigError(
                        "This optimizer state has a first moment but MaskAdamW was built without one: build it "
                        "with the momentum_dtype of the saved run (e.g. MaskAdamW(..., momentum_dtype=torch.bfloat16))."
                    )
                state["exp_avg"] = saved[i]["exp_avg"].to(device=device, dtype=self.momentum_dtype, copy=True)
            elif self.momentum_dtype is not None:
                raise ConfigError(
                    "This optimizer state has no first moment but MaskAdamW was built with momentum_dtype="
                    f"{self.momentum_dtype}: build it with momentum_dtype=None, as the saved run."
                )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a ``DTensor`` (FSDP2), else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-group state ``[local groups]`` as a ``DTensor`` ``[G]`` placed like ``p`` (rows), else as is."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size([p.shape[0]]), stride=(1,)
    )


def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(rows, grad, first row)`` of this process: the local shard of an FSDP2 ``DTensor`` (sharded by
    rows), else the parameter itself; the parameter must be 2-D ``[groups, candidates]``."""
    row_offset = 0
    local, grad = p, p.grad
    if isinstance(p, DTensor):
        local, grad = p.to_local(), p.grad.to_local()
        if any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
            raise ConfigError(
                f"MaskAdamW needs logits sharded by rows (FSDP2 shards dim 0); got {p.placements}."
            )
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        row_offset = int(offset[0])
    if local.dim() != 2:
        raise ConfigError(
            f"MaskAdamW updates [groups, candidates] mask logits, got a parameter of shape {tuple(local.shape)}. "
            "FSDP1 flattens parameters: use FSDP2 (fsdp_config fsdp_version=2), or another optimizer for "
            "parameters that are not mask logits."
        )
    return local, grad, row_offset


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this process's trainable parameters, their gradients and every optimizer state tensor.

    Gradients are counted as allocated when present, else at the size autograd allocates (one per
    trainable parameter, in its dtype), so the figure holds after ``zero_grad(set_to_none=True)``.
    Sharded (FSDP2) tensors count their local shard.
    """

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = [p for p in model.parameters() if p.requires_grad]
    state = 0
    for per_param in optimizer.state.values():
        state += sum(nbytes(t) for t in per_param.values() if isinstance(t, torch.Tensor))
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) if p.grad is not None else nbytes(p) for p in params),
        "optimizer": state,
    }
