"""``MaskAdamW``: AdamW for mask logits in 7.5 bytes per masked weight: bf16 logits, stochastic
rounding, an 8-bit second moment per logit and no first moment.

``torch.optim.AdamW`` on fp32 logits keeps two float32 states per logit: 24 bytes of training state
per masked 2:4 weight (1.5 logits per weight, with the logits and their gradients). ``MaskAdamW``
keeps the logits in bf16, rounds every update *stochastically* (unbiased, so steps far below bf16's
resolution still add up; AdamW with round-to-nearest silently drops them), keeps by default no first
moment, and its second moment either

- per logit (``second_moment="logit"``, the default): AdamW's rule, so every candidate of a group
  moves at its own pace; stored in an 8-bit float of its own (``second_moment_bits=8``: 6 exponent
  bits for the range of squared logit gradients, 2 mantissa bits, stochastically rounded), bf16 (16)
  or float32 (32), or
- per group of m weights (``"group"``): one float32 mean over the group's C logits (Adafactor's row
  factor), 0.5 bytes less per weight, but a group's unlikely candidates, whose gradients the softmax
  scales down, then take proportionally smaller steps and the learned mask is measurably worse.

Bytes per masked 2:4 weight (logits + grads + state):

=======================================  ======  =====  =====  =====
setting                                  logits  grads  state  total
=======================================  ======  =====  =====  =====
fp32 logits, ``torch.optim.AdamW``        6       6      12     24
bf16 logits, ``MaskAdamW()`` (default)    3       3      1.5    7.5
bf16 logits, ``second_moment_bits=16``    3       3      3      9
bf16 logits, ``second_moment="group"``    3       3      1      7
=======================================  ======  =====  =====  =====

Measured quality of each setting: docs/scale.md. The update runs as one fused ``torch.compile``
kernel per parameter when a compiler is available.
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
from .errors import ConfigError
from .numerics.denormals import FLOAT32_TINY
from .numerics.sampling import hash_index

__all__ = ["MaskAdamW", "compiler_available", "local_shard"]

_MANTISSA_DROP = {torch.bfloat16: 16, torch.float16: 13}  # float32 mantissa bits the 16-bit type lacks


def _stochastic_round(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to ``dtype`` up or down with probability by distance (unbiased), from
    ``bits`` (int32 random bits shaped like ``x``; the low ones that ``dtype`` drops are used).

    The random low bits are added to the float32 bit pattern, then truncated: exact for bfloat16, and for
    float16 in its normal range (its subnormals, below 6e-5, round to nearest). Any strides.
    """
    if dtype == torch.float32:
        return x
    drop = _MANTISSA_DROP[dtype]
    out = (x.view(torch.int32) + (bits & ((1 << drop) - 1))) & ~((1 << drop) - 1)
    return out.view(torch.float32).to(dtype)


def _random_bits(seed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """32 random bits per element of ``x`` (1-D or 2-D), a hash of ``seed`` and the row-major index.

    The index is built by broadcasting, in ``x``'s memory order (row- or column-major): compiled, the
    hash then fuses into the update's loop over ``x``'s storage.
    """
    if x.dim() == 1:
        return hash_index(seed, torch.arange(x.shape[0], device=x.device, dtype=torch.int32))
    rows, cols = x.shape
    row = torch.arange(rows, device=x.device, dtype=torch.int32) * cols
    col = torch.arange(cols, device=x.device, dtype=torch.int32)
    if x.stride(0) == 1 and x.stride(1) != 1:  # column-major storage: [cols, rows], transposed back
        return hash_index(seed, row[None, :] + col[:, None]).t()
    return hash_index(seed, row[:, None] + col[None, :])


# The per-logit second moment in 8 bits: an unsigned float, 6 exponent bits and 2 mantissa bits (float8
# e5m2 with the sign bit as a sixth exponent bit), spanning 2**-58 .. 1.75 * 2**5. Squared gradients
# below 2**-58 are stored as 2**-58: their root (2e-9) is below AdamW's eps anyway; above the top (|g|
# > 5.7 for long, never after clipping at 1.0) the step grows by at most the excess's root.
V8_MIN_EXP = -58
_V8_BIAS = 127 + V8_MIN_EXP  # float32's biased exponent of code exponent 0


def _encode_v8(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``v`` (float32 >= 0) to 8-bit codes, rounded up or down with probability by distance (to within
    2**-16 of a step) from 16 random bits per element (``bits``, int32 in ``[0, 2**16)``). Any strides."""
    rounded = v.view(torch.int32) + (bits << 5)  # the 21 bits the code drops: 16 random ones on top
    exponent = (rounded >> 23) - _V8_BIAS
    code = (exponent << 2) | ((rounded >> 21) & 3)
    return torch.where(exponent < 0, 0, code).clamp(max=255).to(torch.uint8)


def _decode_v8(code: torch.Tensor) -> torch.Tensor:
    """8-bit codes to float32 (exact: every code is a float32)."""
    c = code.to(torch.int32)
    return ((((c >> 2) + _V8_BIAS) << 23) | ((c & 3) << 21)).view(torch.float32)


def _flush(x: torch.Tensor, below: float) -> torch.Tensor:
    """``x`` with entries of magnitude below ``below`` set to 0: the products formed from them next would
    fall below the float32 normal range (denormals, which x86 CPUs process many times slower)."""
    return torch.where(x.abs() < below, 0.0, x)


def _update_group(p, grad, v, m, scalars, beta1, beta2, eps, seeds):
    """One step of a ``[G, C]`` parameter with a per-group second moment ``v [G]`` (float32).

    ``scalars``: what changes from step to step, ``[lr, 1 - lr * weight_decay, FLOAT32_TINY / lr,
    1 - beta1**t, 1 - beta2**t]`` (float32, :meth:`MaskAdamW._scalars`). Returns the new ``(p, v, m)``
    shaped as the inputs (``m`` may be None).
    """
    lr, decay, tiny_step, correction1, correction2 = (scalars[i] for i in range(5))
    c = p.shape[1]
    g = [_flush(grad[:, j].float(), FLOAT32_TINY) for j in range(c)]
    g_sq = [_flush(gj, (FLOAT32_TINY * c / (1.0 - beta2)) ** 0.5).square() for gj in g]
    mean_sq = g_sq[0]
    for gj in g_sq[1:]:
        mean_sq = mean_sq + gj
    v = beta2 * _flush(v, FLOAT32_TINY / beta2) + (1.0 - beta2) * (mean_sq / c)
    denom = torch.sqrt(v / correction2) + eps
    if m is not None:
        m_new = [
            beta1 * _flush(m[:, j].float(), FLOAT32_TINY / beta1)
            + (1.0 - beta1) * _flush(g[j], FLOAT32_TINY / (1.0 - beta1))
            for j in range(c)
        ]
        direction = [mj / correction1 for mj in m_new]
    else:
        direction = g
    new = [p[:, j].float() * decay - lr * _flush(direction[j] / denom, tiny_step) for j in range(c)]
    # Candidate-major [C, G] stacking: contiguous stores vectorise; returned as [G, C] views.
    stacked = torch.stack(new, dim=0)
    new_p = _stochastic_round(stacked, p.dtype, _random_bits(seeds[0], stacked)).t()
    new_m = None
    if m is not None:
        stacked_m = torch.stack(m_new, dim=0)
        new_m = _stochastic_round(stacked_m, m.dtype, _random_bits(seeds[1], stacked_m)).t()
    return new_p, v, new_m


def _update_logit(p, grad, v, m, scalars, beta1, beta2, eps, seeds, transposed=False):
    """One step of a ``[G, C]`` parameter with a per-logit second moment ``v [G, C]`` (AdamW's rule).

    ``v`` is float32, bfloat16 or 8-bit codes (uint8). Every state is rounded stochastically to its
    own format. ``scalars`` as in :func:`_update_group`. ``transposed``: the tensors are the
    ``[C, G]`` transposes (each logit draws the same random bits either way). Returns the new
    ``(p, v, m)``.
    """
    lr, decay, tiny_step, correction1, correction2 = (scalars[i] for i in range(5))
    g = _flush(grad.float(), FLOAT32_TINY)  # a clipped gradient can be denormal
    v_old = _decode_v8(v) if v.dtype == torch.uint8 else v.float()
    g_sq = _flush(g, (FLOAT32_TINY / (1.0 - beta2)) ** 0.5).square()
    v_new = beta2 * _flush(v_old, FLOAT32_TINY / beta2) + (1.0 - beta2) * g_sq
    denom = torch.sqrt(v_new / correction2) + eps
    if m is not None:
        m_new = beta1 * _flush(m.float(), FLOAT32_TINY / beta1) + (1.0 - beta1) * _flush(
            g, FLOAT32_TINY / (1.0 - beta1)
        )
        direction = m_new / correction1
    else:
        direction = g
    new = p.float() * decay - lr * _flush(direction / denom, tiny_step)
    # One hash per logit: its low 16 bits round the logit, its high 16 bits the second moment.
    bits = _random_bits(seeds[0], p.t()).t() if transposed else _random_bits(seeds[0], p)
    new_p = _stochastic_round(new, p.dtype, bits)
    high = (bits >> 16) & 0xFFFF
    new_v = _encode_v8(v_new, high) if v.dtype == torch.uint8 else _stochastic_round(v_new, v.dtype, high)
    new_m = None
    if m is not None:
        m_bits = _random_bits(seeds[1], m.t()).t() if transposed else _random_bits(seeds[1], m)
        new_m = _stochastic_round(m_new, m.dtype, m_bits)
    return new_p, new_v, new_m


# Rounding streams: the logits' (with the per-logit second moment's), the momentum's.
_STREAMS = (0, 0x5BD1E995)
_UPDATES = {"group": _update_group, "logit": _update_logit}


def _in_place(update: Callable) -> Callable:
    """``update`` writing its results into ``p``, ``v`` and ``m``: compiled, one kernel stores them
    directly (no new tensors, no copies after it)."""

    def step(p, grad, v, m, *args) -> None:
        new_p, new_v, new_m = update(p, grad, v, m, *args)
        p.copy_(new_p)
        v.copy_(new_v)
        if m is not None:
            m.copy_(new_m)

    return step


_COMPILED: dict[str, Any] = {}


_V_DTYPES = {8: torch.uint8, 16: torch.bfloat16, 32: torch.float32}  # per-logit second moment storage


def compiler_available(device: torch.device | str | None = None) -> bool:
    """Whether ``torch.compile`` can build kernels for ``device`` (default: CUDA if present, else CPU):
    Triton for CUDA, a C++ compiler for CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return shutil.which("c++") is not None or shutil.which("g++") is not None


class MaskAdamW(torch.optim.Optimizer):
    """AdamW for ``[G, C]`` mask logits: stochastic rounding, optional first moment, second moment per
    logit or per group.

    Args:
        params: The logits (``MaskModel.parameters()`` or the Trainer's parameter groups). Any
            parameter is treated as rows of its last dimension.
        lr: Learning rate (the reference recipe: 5e-4).
        betas: ``(beta1, beta2)``; beta1 only matters with ``momentum_dtype``.
        eps: Added to the root of the second moment.
        weight_decay: Decoupled weight decay (the reference applies 0.1 to the logits).
        momentum_dtype: ``None`` (default: no first moment, 0 bytes), ``torch.bfloat16`` (2 bytes
            per logit, stochastically rounded) or ``torch.float32``.
        second_moment: ``"logit"`` (default: AdamW's, one per logit) or ``"group"`` (one float32 per
            group of m weights, shared by its C logits: 0.5 bytes less per masked 2:4 weight, worse masks).
        second_moment_bits: Storage of the per-logit second moment: 8 (default; an 8-bit float,
            1 byte per logit), 16 (bfloat16) or 32 (float32); stochastically rounded below 32.
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
        second_moment: str = "logit",
        second_moment_bits: int = 8,
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
        if second_moment not in _UPDATES:
            raise ConfigError(f"MaskAdamW: second_moment must be 'logit' or 'group', got {second_moment!r}.")
        if second_moment_bits not in _V_DTYPES:
            raise ConfigError(
                f"MaskAdamW: second_moment_bits must be 8, 16 or 32, got {second_moment_bits!r}."
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.momentum_dtype = momentum_dtype
        self.second_moment = second_moment
        self.v_dtype = _V_DTYPES[second_moment_bits] if second_moment == "logit" else torch.float32
        self.compile = compiler_available() if compile is None else bool(compile)
        self.seed = int(seed)

    def _fn(self) -> Callable:
        update = _in_place(_UPDATES[self.second_moment])
        if not self.compile:
            return update
        if self.second_moment not in _COMPILED:
            options = {"cpp.enable_tiling_heuristics": False}
            _COMPILED[self.second_moment] = torch.compile(update, options=options)
        return _COMPILED[self.second_moment]

    def _new_second_moment(self, rows: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Zeros: ``[G]`` float32 per group (sharded like ``p``), or per logit like ``p``."""
        if self.second_moment == "group":
            v = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
            return _shard_like(v, p)  # sharded like p: checkpoints gather it whole
        return torch.zeros_like(p, dtype=self.v_dtype)

    def _rounding_seeds(
        self, step: int, index: int, element_offset: int, device: torch.device
    ) -> torch.Tensor:
        """The stochastic-rounding seeds ``[2, 2]`` (logits and second moment, momentum) of one parameter at
        one step: a function of (seed, step, parameter index) only, the same on every process.

        DDP replicas must round identically or their logits drift apart (DDP never re-syncs
        parameters). The hash's element index starts at ``element_offset``, this process's first
        element of the parameter, so an FSDP shard draws exactly the bits the whole parameter would
        for the same elements (row-major order: the per-logit update; FSDP and DDP then agree bit
        for bit) and shards never share bits.
        """
        base = (self.seed * 0x9E3779B97F4A7C15) ^ (step * 0xBF58476D1CE4E5B9) ^ (index * 0x94D049BB133111EB)
        low = (base + element_offset) & 0xFFFFFFFF  # hash_bits adds the low word to the element index
        high = (base >> 32) & 0xFFFFFFFF
        words = [[low, high ^ s] for s in _STREAMS]
        return torch.tensor([[w - 2**32 if w >= 2**31 else w for w in pair] for pair in words],
                            dtype=torch.int32, device=device)  # fmt: skip

    @staticmethod
    def _scalars(
        lr: float,
        weight_decay: float,
        beta1: float,
        beta2: float,
        step: int,
        device: torch.device,
        cache: dict,
    ) -> torch.Tensor:
        """``[lr, 1 - lr * weight_decay, FLOAT32_TINY / lr, 1 - beta1**step, 1 - beta2**step]`` (float32),
        one tensor per distinct value in a step. A tensor, not Python floats: the learning rate and the
        step change every step, and compiled code would recompile for them once and run as symbolic
        scalars, which split the update into several slower loops on CPU."""
        key = (lr, weight_decay, beta1, beta2, step, device)
        if key not in cache:
            tiny_step = FLOAT32_TINY / lr if lr > 0 else float("inf")  # updates below it would be denormal
            values = [lr, 1.0 - lr * weight_decay, tiny_step, 1.0 - beta1**step, 1.0 - beta2**step]
            cache[key] = torch.tensor(values, dtype=torch.float32).to(device)
        return cache[key]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fn = self._fn()
        cache: dict[tuple, torch.Tensor] = {}
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
                rows = rows.detach()  # a plain tensor: compiled code then marks its length dynamic
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg_sq"] = self._new_second_moment(rows, p)
                    if self.momentum_dtype is not None:
                        state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype)
                state["step"] += 1
                step = int(state["step"])
                m = local_shard(state["exp_avg"]) if "exp_avg" in state else None
                v = local_shard(state["exp_avg_sq"])
                seeds = self._rounding_seeds(step, index, row_offset * rows.shape[1], rows.device)
                scalars = self._scalars(
                    group["lr"], group["weight_decay"], beta1, beta2, step, rows.device, cache
                )
                # Candidate-major logits (how masked layers store them): the per-logit update runs over the
                # [C, G] transposes, whose memory order is the storage's (one fused loop once compiled).
                transposed = self.second_moment == "logit" and rows.stride(0) == 1 and rows.stride(1) != 1
                tensors = [t.t() if transposed and t is not None else t for t in (rows, grad, v, m)]
                if self.compile:  # one kernel for every group count
                    for t in tensors:
                        if t is not None:
                            torch._dynamo.maybe_mark_dynamic(t, 1 if transposed else 0)
                fn(
                    *tensors, scalars, beta1, beta2, group["eps"], seeds, *((transposed,) if transposed else ()),
                )  # fmt: skip
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
            v = saved[i]["exp_avg_sq"]
            kind = "group" if v.dim() == 1 else "logit"
            if kind != self.second_moment:
                raise ConfigError(
                    f"This optimizer state has a per-{kind} second moment but MaskAdamW was built with "
                    f"second_moment={self.second_moment!r}: build it with second_moment={kind!r}, as the saved run."
                )
            if kind == "logit" and v.dtype != self.v_dtype:
                saved_bits = {d: b for b, d in _V_DTYPES.items()}.get(v.dtype, v.dtype)
                raise ConfigError(
                    f"This optimizer state keeps its per-logit second moment as {v.dtype} but MaskAdamW was built "
                    f"for {self.v_dtype}: build it with second_moment_bits={saved_bits}, as the saved run."
                )
            state["exp_avg_sq"] = v.to(device=device, dtype=self.v_dtype, copy=True)
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


def local_shard(t: torch.Tensor) -> torch.Tensor:
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
