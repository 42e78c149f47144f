"""The CPU N:M linear: the route by token count over the C++ kernels of :mod:`.cpu_extension`.

- Up to :data:`CPU_DECODE_MAX_TOKENS` (8) tokens (decode, small batches): ``nm_linear`` reads
  ``values`` and ``meta`` once for all tokens and never builds the dense weight (memory-bound: the
  compressed format reads 0.56x the bytes of a dense bf16 or fp16 weight, 0.53x of fp32).
- More tokens (prefill): ``nm_expand`` writes the layer's dense weight into a scratch buffer, then a
  dense GEMM (``F.linear``; for bfloat16 on CPUs without AVX512-BF16, in float32). The buffer is one
  per thread and dtype, sized for the largest layer seen and reused by every layer, so the model
  holds no dense copy per layer. With ``keep=True`` (autograd will save the weight for the backward
  pass) a fresh buffer is used instead.
"""

from __future__ import annotations

import threading
from types import ModuleType

import torch
import torch.nn.functional as F

from .cpu_extension import CPU_ISA_LEVELS

__all__ = [
    "CPU_DECODE_MAX_TOKENS",
    "expand_cpu",
    "expand_linear",
    "expand_q_cpu",
    "int8_linear_cpu",
    "nm_linear_cpu",
    "nm_linear_q_cpu",
    "scratch_bytes",
]

# Tokens up to which the direct kernel runs: it reads the weight once for all tokens, but its cost per
# token (a permute and an FMA per block of kept values) grows faster than a dense GEMM's; the measured
# crossover on SmolLM2's layer shapes lies between 8 and 16 tokens (benchmarks/results/cpu_kernels.md).
CPU_DECODE_MAX_TOKENS = 8

_AVX512_BF16 = CPU_ISA_LEVELS.index("avx512_bf16")  # the dispatch level with native bfloat16 dot products
_local = threading.local()


def _scratch(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, cols]`` view of this thread's reusable buffer for ``dtype`` (grown, never shrunk)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < rows * cols:
        buffers[dtype] = None  # free the smaller one first
        buffer = buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
    return buffer[: rows * cols].view(rows, cols)


def scratch_bytes() -> int:
    """Bytes held by this thread's expansion buffers (counted with a model's memory)."""
    buffers = getattr(_local, "buffers", None) or {}
    return sum(b.numel() * b.element_size() for b in buffers.values() if b is not None)


def expand_cpu(
    ext: ModuleType, values: torch.Tensor, meta: torch.Tensor, n: int, m: int, in_features: int, keep: bool
) -> torch.Tensor:
    """The dense ``[out, in_features]`` weight (values' dtype): a fresh tensor if ``keep``, else the scratch buffer."""
    out = values.shape[0]
    dense = (
        torch.empty(out, in_features, dtype=values.dtype)
        if keep
        else _scratch(out, in_features, values.dtype)
    )
    return ext.nm_expand(values.contiguous(), meta.contiguous(), n, m, in_features, dense)


def nm_linear_cpu(
    ext: ModuleType,
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a compressed ``W`` on CPU, without autograd (``x`` in the values' dtype)."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if x.numel() <= CPU_DECODE_MAX_TOKENS * in_features:
        return ext.nm_linear(x, values, meta, n, m, bias)
    return expand_linear(ext, x, values, meta, n, m, in_features, bias)


def expand_linear(
    ext: ModuleType,
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The prefill route: expand into the scratch buffer, then a dense GEMM (no autograd)."""
    weight = expand_cpu(ext, values, meta, n, m, in_features, keep=False)
    if x.dtype == torch.bfloat16 and ext.isa() < _AVX512_BF16:
        # Without AVX512-BF16 torch's CPU bfloat16 GEMM is several times slower than its float32 GEMM
        # (benchmarks/results/generate_cpu.md, avx2 rows): multiply in float32, round once at the end.
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def expand_q_cpu(
    ext: ModuleType,
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
    keep: bool,
) -> torch.Tensor:
    """The dequantized dense ``[out, in_features]`` weight in ``dtype`` (int8 / int4 kept values): a fresh
    tensor if ``keep``, else this thread's scratch buffer."""
    out = qvalues.shape[0]
    dense = torch.empty(out, in_features, dtype=dtype) if keep else _scratch(out, in_features, dtype)
    return ext.nm_expand_q(
        qvalues.contiguous(),
        scales.contiguous(),
        meta.contiguous(),
        n,
        m,
        bits,
        group_size,
        in_features,
        dense,
    )


def nm_linear_q_cpu(
    ext: ModuleType,
    x: torch.Tensor,
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, dequant(W), bias)`` for int8 / int4 kept values on CPU, without autograd; the output
    is in ``x``'s dtype (float32, bfloat16 or float16).

    Up to :data:`CPU_DECODE_MAX_TOKENS` tokens: ``nm_linear_q`` reads the codes, scales and meta once for
    all tokens (2:4 on AVX-512 VNNI and on AVX2 rounds ``x`` to 8 bits per 32 inputs; see docs/kernels.md). More:
    ``nm_expand_q`` dequantizes into the scratch buffer (in ``x``'s dtype), then a dense GEMM.
    """
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if x.numel() <= CPU_DECODE_MAX_TOKENS * in_features:
        return ext.nm_linear_q(x, qvalues, scales, meta, n, m, bits, group_size, bias)
    weight = expand_q_cpu(
        ext, qvalues, scales, meta, n, m, bits, group_size, in_features, x.dtype, keep=False
    )
    if x.dtype == torch.bfloat16 and ext.isa() < _AVX512_BF16:
        # as in expand_linear: torch's float32 GEMM is several times faster here
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def int8_linear_cpu(
    ext: ModuleType, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, scales[:, None] * qweight, bias)`` for a dense layer stored as int8 codes ``[out, in]`` with
    one float16 scale per row, on CPU without autograd; the output is in ``x``'s dtype.

    Up to :data:`CPU_DECODE_MAX_TOKENS` tokens: ``int8_linear`` reads the codes once for all tokens (on AVX-512
    VNNI and on AVX2 it rounds ``x`` to 8 bits per 32 inputs; see docs/kernels.md). More: the weight is dequantized into the
    scratch buffer (in ``x``'s dtype), then a dense GEMM.
    """
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if x.numel() <= CPU_DECODE_MAX_TOKENS * qweight.shape[1]:
        return ext.int8_linear(x, qweight, scales, bias)
    weight = _scratch(qweight.shape[0], qweight.shape[1], x.dtype)
    torch.mul(qweight, scales.float()[:, None], out=weight)  # exact in float32, rounded once to x's dtype
    if x.dtype == torch.bfloat16 and ext.isa() < _AVX512_BF16:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)
