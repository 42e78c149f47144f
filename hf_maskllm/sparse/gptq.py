"""Error-compensating quantization of the kept values of N:M layers (GPTQ over a fixed mask).

GPTQ (Frantar et al., 2023) quantizes a layer's weight one input column at a time and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's calibration inputs, so that the layer's output on those inputs moves as little as possible.
Here the N:M mask stays fixed: the kept positions of each row (those :func:`~.format.compress`
stores, under-full groups padded as it pads them) are quantized, the pruned positions are
"quantized" to exactly zero (their error is spread too, and they stay zero). The codes and float16
scales are those of the compressed format, version 2: one symmetric scale per ``group_size`` kept
values of a row, fixed when the row reaches the group's first kept column, from the weights as
updated so far: ``absmax / qmax * f`` rounded to float16 (``qmax`` 127 or 7), with ``f`` the one of
:data:`CLIP_FRACTIONS` whose rounding error over the group, each value weighted by its input's
``H_jj``, is least (clipping the largest value can round the others finer); int4 codes may use -8.

With ``U`` the upper Cholesky factor of the dampened ``H^-1`` (as in SparseGPT), column ``c``'s
error ``(w_c - q_c) / U_cc`` updates every column ``c' > c`` by ``-err * U_cc'``: at once inside a
block of columns, lazily (one matrix product) for later blocks. Blocks are aligned so that no scale
group straddles two, so every scale sees fully updated weights. The solve runs in float64.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..errors import ConfigError, DataError, NMViolationError
from ..patterns import check_nm_args
from ..priors.calibration import solve_layers_sequentially
from ..priors.sparsegpt import _upper_cholesky_of_inverse
from .format import check_group_size, compress, kept_columns, qmax

__all__ = ["CLIP_FRACTIONS", "gptq_quantize_layer", "gptq_quantize_model"]

logger = logging.getLogger(__name__)

# A group's scale is absmax / qmax times the one of these fractions that rounds its values best.
CLIP_FRACTIONS = (1.0, 0.9375, 0.875, 0.8125, 0.75)


def _check_weight(weight: torch.Tensor, hessian: torch.Tensor, m: int) -> None:
    if weight.dim() != 2 or weight.shape[1] % m:
        raise ConfigError(
            f"weight must be 2-D [out, in] with in divisible by m={m}, got {tuple(weight.shape)}."
        )
    cols = weight.shape[1]
    if tuple(hessian.shape) != (cols, cols):
        raise DataError(
            f"hessian must be [in, in] = [{cols}, {cols}] (X^T X of the layer's inputs), got {tuple(hessian.shape)}."
        )
    if not bool(torch.isfinite(weight).all()) or not bool(torch.isfinite(hessian).all()):
        raise DataError("weight or hessian holds NaN or inf; they cannot be quantized.")


@torch.no_grad()
def gptq_quantize_layer(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the kept values of an N:M-sparse layer with GPTQ's error compensation.

    Args:
        weight: ``[out, in]``, zero outside the N:M mask (not modified).
        hessian: ``[in, in]`` layer Hessian ``2/T * X^T X`` of its ``T`` calibration inputs ``X`` (as
            :class:`~hf_maskllm.priors.HessianStats` gives it; handled in float64). Inputs that never
            fire get ``H_jj = 1``, as in SparseGPT, and keep their weights up to rounding.
        n, m: the N:M pattern.
        bits: 8 (codes in ``[-127, 127]``) or 4 (codes in ``[-8, 7]``).
        group_size: kept values per scale; divides ``in * n // m`` (and is even for 4 bits).
        blocksize: columns per lazy-update block (rounded to whole scale groups).
        percdamp: dampening, as a fraction of the Hessian's mean diagonal.

    Returns:
        ``(codes int8 [out, kept], scales float16 [out, kept // group_size])`` in the order of
        :func:`~.format.compress`: kept value ``j`` of a row is ``float(scales[row, j // group_size]) * codes[row, j]``.
    """
    check_nm_args(n, m)
    _check_weight(weight, hessian, m)
    check_group_size(weight.shape[1] * n // m, bits, group_size)
    hinv = _inverse_factor(hessian, percdamp, weight.device)
    return _gptq(weight, hinv, hessian.diagonal(), n, m, bits, group_size, blocksize)


def _inverse_factor(hessian: torch.Tensor, percdamp: float, device: torch.device) -> torch.Tensor:
    """``U``, the upper Cholesky factor of the dampened ``H^-1`` (float64), dead inputs set to ``H_jj = 1``."""
    h = hessian.detach().to(device=device, dtype=torch.float64, copy=True)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    return _upper_cholesky_of_inverse(h, percdamp)


def _clipped_scale(vals: torch.Tensor, weights: torch.Tensor, top: int, low: int) -> torch.Tensor:
    """Per row of ``vals [r, gs]``: the float16 scale among ``absmax / top * f`` (``f`` in :data:`CLIP_FRACTIONS`)
    with the least squared rounding error, each value's error weighted by its input's ``H_jj``
    (``weights [r, gs]``); the first of equal ones. Returned as float64 ``[r]``."""
    absmax = vals.abs().amax(dim=1, keepdim=True)  # [r, 1]
    best = best_err = None
    for f in CLIP_FRACTIONS:
        s = (absmax / top * f).to(torch.float16).to(torch.float64)
        if not bool(torch.isfinite(s).all()):
            raise DataError(
                f"kept values up to {float(absmax.max()):.3g} exceed what float16 scales hold; "
                "store float values instead."
            )
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.where(s > 0, torch.round(vals / safe).clamp_(low, top), torch.zeros_like(vals))
        err = ((vals - q * s) ** 2 * weights).sum(dim=1)
        if best is None:
            best, best_err = s.squeeze(1), err
        else:
            better = err < best_err
            best = torch.where(better, s.squeeze(1), best)
            best_err = torch.where(better, err, best_err)
    return best


def _gptq(
    weight: torch.Tensor,
    hinv: torch.Tensor,
    hdiag: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    blocksize: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The solve of :func:`gptq_quantize_layer`, given ``U`` (``hinv``) and ``diag(H)``; arguments checked."""
    hdiag = hdiag.to(device=weight.device, dtype=torch.float64)
    rows, cols = weight.shape
    kept = cols * n // m
    top, low = qmax(bits), (-8 if bits == 4 else -qmax(bits))
    device = weight.device
    _, meta = compress(weight, n, m)  # raises unless weight is N:M
    kcols = kept_columns(meta, n, m, kept)  # [rows, kept] dense column of each kept value
    keep = torch.zeros(cols, rows, dtype=torch.bool, device=device)  # [in, rows], like W^T
    keep.scatter_(0, kcols.t(), True)
    kidx = torch.full((cols, rows), -1, dtype=torch.long, device=device)  # kept index, -1 if pruned
    kidx.scatter_(0, kcols.t(), torch.arange(kept, device=device).unsqueeze(1).expand(kept, rows))

    # A block boundary must fall where a scale group and an m-group both end: every lcm(group_size, n)
    # kept values, i.e. every lcm * m // n dense columns.
    unit = math.lcm(group_size, n) * m // n
    bs = max(unit, blocksize // unit * unit)
    wt = weight.detach().to(torch.float64).t().contiguous()  # [in, rows]: column c of W is row c here
    codes_t = torch.zeros(cols, rows, dtype=torch.float64, device=device)
    scales = torch.zeros(rows, kept // group_size, dtype=torch.float64, device=device)
    scale = torch.zeros(rows, dtype=torch.float64, device=device)  # each row's current group scale
    offsets = torch.arange(group_size, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        w1 = wt[i1:i2].clone()  # [count, rows]
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            kc, ki = keep[c], kidx[c]
            starts = (kc & (ki % group_size == 0)).nonzero().squeeze(1)
            if starts.numel():
                # New scale groups start here: absmax of the group's kept values, as updated so far.
                g = ki[starts] // group_size
                gcols = kcols[starts.unsqueeze(1), g.unsqueeze(1) * group_size + offsets] - i1  # [r, gs]
                vals = w1[gcols, starts.unsqueeze(1)]  # [r, gs]
                s = _clipped_scale(vals, hdiag[gcols + i1], top, low)
                scales[starts, g] = s
                scale[starts] = s
            col = w1[i]
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.where(kc & (scale > 0), torch.round(col / safe).clamp_(low, top), torch.zeros_like(col))
            codes_t[c] = q
            err = (col - q * scale) / hinv1[i, i]
            loss += (err * err).sum() / 2
            # (addmm_ with k=1 rather than addr_: addr_ is ~100x slower on CPU.)
            w1[i:].addmm_(hinv1[i, i:].unsqueeze(1), err.unsqueeze(0), alpha=-1.0)
            err1[i] = err
        wt[i2:].addmm_(hinv[i1:i2, i2:].t(), err1, alpha=-1.0)
    codes = codes_t.t().gather(1, kcols).to(torch.int8)
    logger.debug("gptq: %d x %d layer, int%d, group %d: loss %.4g", rows, cols, bits, group_size, loss.item())
    return codes, scales.to(torch.float16)


def _dequantized_weight(
    codes: torch.Tensor, scales: torch.Tensor, kcols: torch.Tensor, in_features: int, group_size: int
) -> torch.Tensor:
    """The dense ``[out, in]`` float32 weight the codes stand for (zero outside the kept columns)."""
    rows, kept = codes.shape
    values = codes.to(torch.float32).view(rows, -1, group_size) * scales.to(torch.float32).unsqueeze(-1)
    dense = torch.zeros(rows, in_features, dtype=torch.float32, device=codes.device)
    return dense.scatter_(1, kcols, values.view(rows, kept))


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module,
    modules: list[str],
    bits: int,
    group_size: int,
    calibration: torch.LongTensor,
    n: int = 2,
    m: int = 4,
    batch_size: int = 1,
    progress: bool = True,
    blocksize: int = 128,
    percdamp: float = 0.01,
    compute_dtype: torch.dtype | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ codes and scales for the kept values of ``modules``, leaving the model's weights bit-identical.

    Layers are quantized block by block on ``calibration`` (SparseGPT's protocol,
    :func:`hf_maskllm.priors.calibration.solve_layers_sequentially`): each layer's Hessian is measured
    with every earlier layer already replaced by its quantized weights, as GPTQ does.

    Args:
        model: a model whose ``modules`` (``nn.Linear`` or ``Conv1D``) hold N:M-sparse weights, e.g.
            ``mask_model.merge_and_unload()``.
        modules: names from ``model.named_modules()``.
        bits, group_size: as in :func:`gptq_quantize_layer`.
        calibration: ``[num_samples, seqlen]`` token ids.
        n, m: the layers' N:M pattern.
        batch_size: sequences per forward; ``progress``: a bar over blocks.
        blocksize, percdamp: as in :func:`gptq_quantize_layer`.
        compute_dtype: dtype the blocks run in (``None``: float64 on a CPU, float32 on an accelerator).

    Returns:
        ``{name: (codes int8 [out, kept], scales float16 [out, kept // group_size])}`` on the CPU.
    """
    if calibration is None:
        raise DataError(
            "error-compensating quantization needs calibration token ids [num_samples, seqlen]; pass them, "
            "or quantize by round-to-nearest (no calibration data)."
        )
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    last: list[torch.Tensor] = []  # (hessian, U) of the previous layer

    def solve(name: str, weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
        check_nm_args(n, m)
        _check_weight(weight, hessian, m)
        check_group_size(weight.shape[1] * n // m, bits, group_size, name)
        # Layers fed the same inputs (q/k/v, gate/up) come one after another with equal Hessians: factor once.
        if not (last and last[0].shape == hessian.shape and torch.equal(last[0], hessian)):
            last[:] = [hessian, _inverse_factor(hessian, percdamp, weight.device)]
        try:
            codes, scales = _gptq(weight, last[1], hessian.diagonal(), n, m, bits, group_size, blocksize)
        except NMViolationError as e:
            raise NMViolationError(f"layer {name!r}: {e}") from None
        kcols = kept_columns(compress(weight, n, m)[1], n, m, codes.shape[1])
        dequant = _dequantized_weight(codes, scales, kcols, weight.shape[1], group_size)
        rel = (dequant.to(weight.dtype) - weight).norm() / weight.norm().clamp_min(1e-30)
        logger.info("gptq int%d g%d %s: relative weight change %.4f", bits, group_size, name, rel.item())
        results[name] = (codes.cpu(), scales.cpu())
        return dequant

    solve_layers_sequentially(
        model,
        modules,
        calibration,
        solve,
        n,
        m,
        batch_size,
        progress,
        compute_dtype,
        f"gptq int{bits} g{group_size}",
    )
    return {name: results[name] for name in modules}
