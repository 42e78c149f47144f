"""The training forward / backward of a masked linear, with mask sampling fused in.

``y = x @ (W * mask)^T + b`` with ``mask`` a soft Gumbel sample of the layer's logits
(``sampling.py``), and optionally ``reg = ||W * mask||^2`` (the sparse weight regulariser).

Plain autograd would keep, per masked layer and until its backward pass, the noise and the
probabilities (``[G, C]`` float32, 12 bytes per masked weight for 2:4) and the effective weight
``W * mask`` (the size of the layer). :class:`MaskedLinearFunction` keeps what any linear keeps
(its input ``x``), references to the logits, ``W`` and ``b``, an 8-byte seed and, unless told to
recompute, the sample's probabilities (``[C, G]`` float32: 6 bytes per masked weight for 2:4).

Backward: the weight-gradient matmul ``grad_y^T x``, then one pass over the groups that forms both
``W * mask`` (for the input's gradient, the second matmul) and the logits' gradient, from the kept
probabilities or, recomputing, from noise and probabilities regenerated from the seed. Keeping is
the default on CPU, where drawing the noise (a hash and two logarithms per candidate) is a large
part of the step; recomputing is the default on GPUs, where memory is scarcer
(``MaskModel.set_recompute_sampling``). Both give identical gradients. The weight-gradient matmul
runs in bfloat16 (float32 accumulation) when the logits are bfloat16 and the hardware multiplies
bfloat16 natively (CUDA; CPUs with AVX512-BF16 or AMX): the logits' gradient is rounded to bfloat16
in any case, and on such a CPU that matmul is several times faster than in float32
(:func:`weight_grad`).

With ``compiled=True`` (set per model by ``MaskModel.set_compiled_sampling``, which
``MaskAnnealCallback`` calls) each pass is one ``torch.compile`` kernel (C++ loops on CPU, Triton on
CUDA) vectorised over groups. Both passes flush values below the float32 normal range to zero as
they compute them (``denormals.py``), so no matmul or elementwise op ever sees a denormal, however
low the temperature.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .denormals import MASKED_WEIGHT_FLOOR, flushed_product
from .sampling import sample_probs, schedule_number, soft_mask_from_probs

__all__ = [
    "MaskedLinearFunction",
    "candidate_major",
    "masked_linear",
    "native_bf16_matmul",
    "scalar_tensor",
    "weight_grad",
]

_COMPILED: dict[str, Any] = {}  # the compiled passes, shared by every model (compiled once per process)
_SQUARE_UNDERFLOW = 2.0**-63  # |w| below this: w * w is below the float32 normal range (2**-126)


def candidate_major(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[G, C]`` with the same values, stored candidate-major (strides ``(1, G)``).

    How masked layers store their logits for training (``MaskModel.set_candidate_major_logits``): every
    per-group pass reads, and the backward pass writes, one candidate's column at a time, and in this
    layout each column is contiguous (vector loads and stores instead of strided ones). Any layout
    gives the same results.
    """
    if logits.dim() != 2 or logits.stride(0) == 1 or logits.shape[0] <= 1:
        return logits
    return logits.t().contiguous().t()


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (faster than float32)."""
    return _native_bf16_matmul(device.type)


@functools.cache
def _native_bf16_matmul(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return False


def weight_grad(grad_y: torch.Tensor, x: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
    """``dL/d(W * mask) = grad_y^T x`` ``[out, in]``, the product the logits' gradient is made from.

    In bfloat16 (float32 accumulation, as bfloat16 autocast computes a weight gradient) when the
    logits are bfloat16, the matmul would otherwise run in float32 and the device multiplies
    bfloat16 natively: the logits' gradient is rounded to bfloat16 anyway, and this product's
    rounding error is of the same order (about 0.3% of its norm; ``tests/numerics/test_fused_linear.py`` bounds
    the logits' gradient against float64). Otherwise in the matmuls' dtype.
    """
    if logits_dtype == torch.bfloat16 and grad_y.dtype == torch.float32 and native_bf16_matmul(grad_y.device):
        return grad_y.t().to(torch.bfloat16) @ x.to(torch.bfloat16)
    return grad_y.t() @ x


def _total(terms: list[torch.Tensor]) -> torch.Tensor:
    """``terms[0] + terms[1] + ...`` (no ``0 +`` start: an integer constant can stop vectorisation)."""
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _sample_weight(
    weight, logits, seed, tau, kappa, n: int, m: int, hard: bool, dtype: torch.dtype, extra: str
):
    """``(W * mask, reg, probs)``: ``W * mask`` in ``dtype`` as ``[G, m]`` groups, and what ``extra`` asks for.

    ``extra`` names any of ``"reg"`` (``||W * mask||^2``, a float32 scalar) and ``"probs"`` (the
    probabilities ``[C, G]``, candidate-major: contiguous stores vectorise), e.g. ``"reg+probs"``;
    what it does not name is None. Nothing below the float32 normal range is formed or returned
    (``denormals.py``): such probabilities, products and squares are zeros, and so are the entries of
    ``W * mask`` below ``MASKED_WEIGHT_FLOOR``.
    """
    probs = sample_probs(logits, seed, tau, kappa)
    w_eff = _masked_columns(weight, probs, n, m, hard)
    reg = None
    if "reg" in extra:
        reg = _total([torch.where(w.abs() < _SQUARE_UNDERFLOW, 0.0, w).square().sum() for w in w_eff])
    kept = torch.stack(probs, dim=0) if "probs" in extra else None
    return torch.stack(w_eff, dim=-1).to(dtype), reg, kept


def _masked_columns(weight, probs, n: int, m: int, hard: bool) -> list[torch.Tensor]:
    """The m float32 columns of ``W * mask`` from the sample's probabilities, entries below
    ``MASKED_WEIGHT_FLOOR`` set to 0 (no product with them in a matmul is denormal)."""
    mask = soft_mask_from_probs(list(probs), n, m, hard)
    return [flushed_product(weight[:, j].float(), mask[j], MASKED_WEIGHT_FLOOR) for j in range(m)]


def _logits_grad(
    grad_w, weight, probs, n: int, m: int, tau, kappa, hard: bool, reg_grad, dtype: torch.dtype, like: torch.Tensor
):  # fmt: skip
    """``dL/dlogits`` ``[G, C]`` in ``dtype`` and laid out like ``like`` (the logits) from
    ``dL/d(W * mask)`` ``[G, m]``, the sample's probabilities (C columns ``[G]``) and the regulariser's
    scalar gradient (or None).

    Every product with a probability or a mask value is a :func:`flushed_product`: nothing below the
    float32 normal range is formed or returned. A probability that underflowed to 0 in the sampling
    pass has a zero gradient (the plain formula's, ``p * (g - dot) * kappa / tau``, is at most
    ``2**-126 * |g - dot| * kappa / tau``).
    """
    probs = list(probs)
    grad_mask = [grad_w[:, j].float() * weight[:, j].float() for j in range(m)]
    if reg_grad is not None:  # d ||W * mask||^2 / d mask = 2 W^2 mask
        mask = soft_mask_from_probs(probs, n, m, hard)
        grad_mask = [
            g + flushed_product((2.0 * reg_grad) * weight[:, j].float().square(), mask[j])
            for j, g in enumerate(grad_mask)
        ]
    # dL/dp_c = sum of dL/dmask_j over the positions j candidate c keeps; then the softmax backward
    grad_probs = [_total([grad_mask[j] for j in combo]) for combo in itertools.combinations(range(m), n)]
    dot = _total([flushed_product(g, p) for p, g in zip(probs, grad_probs)])
    scale = kappa / tau  # d scores / d logits
    # Computed candidate-major (contiguous stores vectorise) and returned in the logits' layout and dtype:
    # autograd then keeps it as the gradient without another copy.
    grad = torch.stack([flushed_product((g - dot) * scale, p) for p, g in zip(probs, grad_probs)], dim=0)
    grad = grad.to(dtype).t()
    return grad if like.stride(0) == 1 else grad.contiguous()


def _backward_pass(
    grad_w, weight, probs, logits, seed, tau, kappa, n: int, m: int, hard: bool, reg_grad,
    w_dtype: torch.dtype, grad_dtype: torch.dtype,
):  # fmt: skip
    """``(W * mask, dL/dlogits)`` in one pass over the groups: ``W * mask`` ``[G, m]`` in ``w_dtype``
    (for the input's gradient) and the logits' gradient ``[G, C]`` in ``grad_dtype``.

    ``probs``: the forward pass's probabilities ``[C, G]``, or None to regenerate them from ``logits``
    and ``seed`` (the same noise, hence the same values). Either way ``W`` and the probabilities are
    read once, and no probability is written.
    """
    probs = sample_probs(logits, seed, tau, kappa) if probs is None else list(probs)
    w_eff = torch.stack(_masked_columns(weight, probs, n, m, hard), dim=-1).to(w_dtype)
    return w_eff, _logits_grad(grad_w, weight, probs, n, m, tau, kappa, hard, reg_grad, grad_dtype, logits)


_PASSES = {"sample_weight": _sample_weight, "backward": _backward_pass}
# Per pass: (arguments whose dim 0 is G, arguments whose dim 1 is G), so G is never specialised on.
_GROUP_DIMS = {"sample_weight": ((0, 1), ()), "backward": ((0, 1, 3), (2,))}
_SCHEDULE_ARGS = {"sample_weight": (3, 4), "backward": (5, 6)}  # tau, kappa
_SCALARS: dict[tuple[float, torch.device], torch.Tensor] = {}


def scalar_tensor(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d float32 tensor on ``device``, cached: how compiled code takes a value that
    changes during a run (tau, kappa). A Python float would compile once as a
    constant and again as a symbolic scalar when it first changes (seconds of compilation in the
    middle of a run), and symbolic scalars split some CPU kernels into slower loops."""
    key = (float(value), torch.device(device))
    tensor = _SCALARS.get(key)
    if tensor is None:
        if len(_SCALARS) > 256:  # a schedule visits each value once
            _SCALARS.clear()
        tensor = _SCALARS[key] = torch.full((), float(value), dtype=torch.float32, device=device)
    return tensor


def _run(name: str, compiled: bool, *args):
    """Call the eager or the compiled version; compiled code is specialised on n and m, not on G, and
    takes tau and kappa as tensors (:func:`scalar_tensor`; within code that an enclosing
    ``torch.compile`` traces, the tensors given)."""
    fn = _PASSES[name]
    if not compiled:
        return fn(*args)
    args = list(args)
    device = args[1].device
    tracing = torch.compiler.is_compiling()
    for i in _SCHEDULE_ARGS[name]:
        if not (tracing and isinstance(args[i], torch.Tensor)):
            args[i] = scalar_tensor(float(args[i]), device)
    if name not in _COMPILED:
        # Strided [G, C] loads trip inductor's "too many non-contiguous accesses" heuristic, which would
        # fall back to a scalar loop several times slower: always vectorise over groups.
        _COMPILED[name] = torch.compile(fn, options={"cpp.enable_tiling_heuristics": False})
    rows, columns = _GROUP_DIMS[name]
    for i in rows:
        if args[i] is not None:
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
    for i in columns:
        if args[i] is not None:
            torch._dynamo.maybe_mark_dynamic(args[i], 1)
    return _COMPILED[name](*args)


class MaskedLinearFunction(torch.autograd.Function):
    """``(y, reg)`` of a masked linear in training mode; see the module docstring for what it saves.

    ``x`` is 2-D ``[tokens, in]``; ``weight`` ``[out, in]`` (frozen, any strides); ``bias`` frozen or
    None; ``logits`` ``[out * in / m, C(m, n)]``; ``seed`` from :func:`sampling.draw_seed`; ``tau``,
    ``kappa``: floats or 0-d tensors, read again by the backward pass. The matmuls
    run in ``x``'s dtype (the caller applies autocast); the per-group math in float32. ``reg`` is a
    float32 scalar, or None unless ``with_reg``. ``compiled``: run the per-group passes compiled.
    ``recompute``: keep nothing per group for the backward pass (regenerate the sample there).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, logits, seed, n, m, tau, kappa, hard, with_reg, compiled, recompute):
        keep = not recompute and ctx.needs_input_grad[3]  # frozen logits need no probabilities
        extra = "+".join(["reg"] * with_reg + ["probs"] * keep)
        # Detached [G, .] views: compiled code must not specialise on parameters or requires_grad.
        w_eff, reg, probs = _run(
            "sample_weight", compiled, weight.detach().reshape(-1, m), logits.detach(), seed, tau, kappa,
            n, m, hard, x.dtype, extra,
        )  # fmt: skip
        y = torch.nn.functional.linear(x, w_eff.view(weight.shape), bias)
        if keep:
            ctx.save_for_backward(x, weight, logits, seed, probs)
        else:
            ctx.save_for_backward(x, weight, logits, seed)
        ctx.args = (tau, kappa, n, m, hard, compiled)
        return y, reg

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable: refuse double backward
    def backward(ctx, grad_y, grad_reg):
        x, weight, logits, seed, *kept = ctx.saved_tensors
        tau, kappa, n, m, hard, compiled = ctx.args
        w_groups = weight.detach().reshape(-1, m)
        if not ctx.needs_input_grad[3]:  # frozen logits: only the input's gradient, from W * mask
            w_eff, _, _ = _run(
                "sample_weight", compiled, w_groups, logits.detach(), seed, tau, kappa, n, m, hard,
                grad_y.dtype, "",
            )  # fmt: skip
            grad_x = grad_y @ w_eff.view(weight.shape) if ctx.needs_input_grad[0] else None
            return grad_x, *[None] * 12
        grad_w = weight_grad(grad_y, x, logits.dtype)  # dL/d(W * mask)
        reg_grad = grad_reg.float() if grad_reg is not None else None
        # One pass: W * mask (for grad_x) and the logits' gradient, from the kept or regenerated sample.
        w_eff, grad_logits = _run(
            "backward", compiled, grad_w.view(-1, m), w_groups, kept[0] if kept else None, logits.detach(),
            seed, tau, kappa, n, m, hard, reg_grad, grad_y.dtype, logits.dtype,
        )  # fmt: skip
        del grad_w
        grad_x = grad_y @ w_eff.view(weight.shape) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, grad_logits, *[None] * 9


def masked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logits: torch.Tensor,
    n: int,
    m: int,
    seed: torch.Tensor,
    tau: float | torch.Tensor,
    kappa: float | torch.Tensor,
    hard: bool = False,
    with_reg: bool = False,
    compiled: bool = False,
    recompute: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Training-mode masked linear on ``x`` of any leading dims; returns ``(y, reg or None)``.

    ``tau``, ``kappa``: numbers or 0-d tensors (``MaskSchedule.tensor``: compiled code then reads their
    values at run time instead of compiling them in; a 0-d CPU tensor gives what its value as a number
    does). A tensor is read again by the backward pass: change it between steps, not between a forward
    and its backward.

    Under autocast the matmuls run in the autocast dtype (as ``F.linear`` would); the sampling and
    the regulariser always in float32. ``compiled``: run the per-group passes through
    ``torch.compile`` (the first call compiles). ``recompute``: regenerate the sample in the backward
    pass instead of keeping its probabilities (6 bytes per masked weight for 2:4, until the backward
    pass); None: recompute on GPUs, keep on CPU.
    """
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(dtype)
    b = bias.to(dtype) if bias is not None else None
    with torch.autocast(device, enabled=False):
        y, reg = MaskedLinearFunction.apply(
            x2d, weight, b, logits, seed, int(n), int(m), schedule_number(tau), schedule_number(kappa), bool(hard), bool(with_reg),
            bool(compiled), bool(x.device.type != "cpu" if recompute is None else recompute),
        )  # fmt: skip
    return y.reshape(*lead, y.shape[-1]), reg
