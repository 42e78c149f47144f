"""The training forward / backward of a masked linear, with mask sampling fused in.

``y = x @ (W * mask)^T + b`` with ``mask`` a soft Gumbel sample of the layer's logits
(``sampling.py``), and optionally ``reg = ||W * mask||^2`` (the sparse weight regulariser).

Plain autograd would keep, per masked layer and until its backward pass, the noise and the
probabilities (``[G, C]`` float32, 12 bytes per masked weight for 2:4) and the effective weight
``W * mask`` (the size of the layer). :class:`MaskedLinearFunction` keeps only what any linear
keeps (its input ``x``) plus references to the logits, ``W`` and ``b`` and an 8-byte seed. The
backward pass regenerates noise, probabilities and ``W * mask`` in one pass (the probabilities live
only until the logits' gradient is computed, one layer at a time), then runs the two matmuls and a
second pass for the logits' gradient. With ``compiled=True`` (set per model by
``MaskModel.set_compiled_sampling``, which ``MaskAnnealCallback`` calls) each pass is one
``torch.compile`` kernel (C++ loops on CPU, Triton on CUDA) vectorised over groups. Both passes
flush values below the float32 normal range to zero as they compute them (``denormals.py``), so no
matmul or elementwise op ever sees a denormal, however low the temperature.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .denormals import flushed_product
from .sampling import sample_probs, soft_mask_from_probs

__all__ = ["MaskedLinearFunction", "masked_linear"]

_COMPILED: dict[str, Any] = {}  # the compiled passes, shared by every model (compiled once per process)
_SQUARE_UNDERFLOW = 2.0**-63  # |w| below this: w * w is below the float32 normal range (2**-126)


def _total(terms: list[torch.Tensor]) -> torch.Tensor:
    """``terms[0] + terms[1] + ...`` (no ``0 +`` start: an integer constant can stop vectorisation)."""
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _sample_weight(
    weight, logits, seed, tau, kappa, n: int, m: int, hard: bool, dtype: torch.dtype, extra: str
):
    """``W * mask`` in ``dtype`` as ``[G, m]`` groups, plus ``extra``.

    ``extra``: ``"reg"`` -> ``||W * mask||^2`` (float32 scalar); ``"probs"`` -> the probabilities
    ``[C, G]`` (candidate-major: contiguous stores vectorise), for the backward pass to reuse;
    ``""`` -> None. Nothing below the float32 normal range is formed or returned (``denormals.py``):
    such probabilities, products and squares are zeros.
    """
    probs = sample_probs(logits, seed, tau, kappa)
    mask = soft_mask_from_probs(probs, n, m, hard)
    w_eff = [flushed_product(weight[:, j].float(), mask[j]) for j in range(m)]
    out = None
    if extra == "reg":
        out = _total([torch.where(w.abs() < _SQUARE_UNDERFLOW, 0.0, w).square().sum() for w in w_eff])
    elif extra == "probs":
        out = torch.stack(probs, dim=0)
    return torch.stack(w_eff, dim=-1).to(dtype), out


def _logits_grad(grad_w, weight, probs, n: int, m: int, tau, kappa, hard: bool, reg_grad):
    """``dL/dlogits`` ``[G, C]`` from ``dL/d(W * mask)`` ``[G, m]``, the sample's probabilities ``[C, G]``
    and the regulariser's scalar gradient (or None).

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
    # Stacked candidate-major (contiguous stores vectorise), returned as a [G, C] view.
    return torch.stack([flushed_product((g - dot) * scale, p) for p, g in zip(probs, grad_probs)], dim=0).t()


_GROUP_ARGS = {"sample_weight": 2, "logits_grad": 2}  # leading arguments whose dim 0 is G


def _run(name: str, compiled: bool, *args):
    """Call the eager or the compiled version; compiled code is specialised on n and m, not on G."""
    fn = {"sample_weight": _sample_weight, "logits_grad": _logits_grad}[name]
    if not compiled:
        return fn(*args)
    if name not in _COMPILED:
        # Strided [G, C] loads trip inductor's "too many non-contiguous accesses" heuristic, which would
        # fall back to a scalar loop several times slower: always vectorise over groups.
        _COMPILED[name] = torch.compile(fn, options={"cpp.enable_tiling_heuristics": False})
    for t in args[: _GROUP_ARGS[name]]:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    if name == "logits_grad":
        torch._dynamo.maybe_mark_dynamic(args[2], 1)  # probs [C, G]
    return _COMPILED[name](*args)


class MaskedLinearFunction(torch.autograd.Function):
    """``(y, reg)`` of a masked linear in training mode; see the module docstring for what it saves.

    ``x`` is 2-D ``[tokens, in]``; ``weight`` ``[out, in]`` (frozen, any strides); ``bias`` frozen or
    None; ``logits`` ``[out * in / m, C(m, n)]``; ``seed`` from :func:`sampling.draw_seed`. The matmuls
    run in ``x``'s dtype (the caller applies autocast); the per-group math in float32. ``reg`` is a
    float32 scalar, or None unless ``with_reg``. ``compiled``: run the per-group passes compiled.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, logits, seed, n, m, tau, kappa, hard, with_reg, compiled):
        # Detached [G, .] views: compiled code must not specialise on parameters or requires_grad.
        w_eff, reg = _run(
            "sample_weight", compiled, weight.detach().reshape(-1, m), logits.detach(), seed, tau, kappa,
            n, m, hard, x.dtype, "reg" if with_reg else "",
        )  # fmt: skip
        y = torch.nn.functional.linear(x, w_eff.view(weight.shape), bias)
        ctx.save_for_backward(x, weight, logits, seed)
        ctx.args = (tau, kappa, n, m, hard, compiled)
        return y, reg

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable: refuse double backward
    def backward(ctx, grad_y, grad_reg):
        x, weight, logits, seed = ctx.saved_tensors
        tau, kappa, n, m, hard, compiled = ctx.args
        w_groups = weight.detach().reshape(-1, m)
        # One sampling pass gives both W * mask (for grad_x) and the probabilities (for the logits).
        w_eff, probs = _run(
            "sample_weight", compiled, w_groups, logits.detach(), seed, tau, kappa, n, m, hard, grad_y.dtype,
            "probs",
        )  # fmt: skip
        grad_x = grad_y @ w_eff.view(weight.shape) if ctx.needs_input_grad[0] else None
        del w_eff
        if not ctx.needs_input_grad[3]:  # frozen logits
            return grad_x, *[None] * 11
        grad_w = grad_y.t() @ x  # dL/d(W * mask)
        reg_grad = grad_reg.float() if grad_reg is not None else None
        grad_logits = _run(
            "logits_grad", compiled, grad_w.view(-1, m), w_groups, probs, n, m, tau, kappa, hard, reg_grad
        )
        return grad_x, None, None, grad_logits.to(logits.dtype), *[None] * 8


def masked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logits: torch.Tensor,
    n: int,
    m: int,
    seed: torch.Tensor,
    tau: float,
    kappa: float,
    hard: bool = False,
    with_reg: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Training-mode masked linear on ``x`` of any leading dims; returns ``(y, reg or None)``.

    Under autocast the matmuls run in the autocast dtype (as ``F.linear`` would); the sampling and
    the regulariser always in float32. ``compiled``: run the per-group passes through
    ``torch.compile`` (the first call compiles).
    """
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(dtype)
    b = bias.to(dtype) if bias is not None else None
    with torch.autocast(device, enabled=False):
        y, reg = MaskedLinearFunction.apply(
            x2d, weight, b, logits, seed, int(n), int(m), float(tau), float(kappa), bool(hard), bool(with_reg),
            bool(compiled),
        )  # fmt: skip
    return y.reshape(*lead, y.shape[-1]), reg
