"""2:4 decompression on the device: compressed ``(values, meta)`` -> dense ``[N, K]`` weight.

The large-batch route: at thousands of tokens a matmul is compute-bound, and expanding every weight
tile once per token tile inside the matmul (:mod:`.nm_dot`) costs more issue slots than the tensor
cores take (``benchmarks/kernel_sass.py``). Expanding the weight once into a scratch buffer and
calling cuBLAS costs one extra pass over the weight (read 0.56x, write 1x of the dense bytes), which
a 2048-token matmul amortises. Each program expands one ``[BLOCK_N, BLOCK_K]`` tile with the same
code as the matmul kernels (:mod:`.expand`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .expand import INTERPRET, expand_24, expand_24_words

__all__ = ["EXPAND_BLOCK_K", "EXPAND_BLOCK_N", "EXPAND_WARPS", "nm24_expand_kernel"]

# One fixed tile: a pure streaming kernel, nothing worth tuning beyond wide rows.
EXPAND_BLOCK_N = 16 if INTERPRET else 32
EXPAND_BLOCK_K = 64 if INTERPRET else 256
EXPAND_WARPS = 4


@triton.jit
def nm24_expand_kernel(
    values_ptr,  # WORDS: int32 [N, K/4] (the values viewed as words); else [N, K/2]
    meta_ptr,  # [N, ceil(K/8)] uint8 positions
    out_ptr,  # [N, K] dense, in the values' dtype
    out_features,  # N
    in_features,  # K (multiple of 4)
    stride_vn,
    stride_mn,
    stride_on,
    WORDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # dense columns per program (multiple of 32)
):
    BLOCK_G: tl.constexpr = BLOCK_K // 4
    pid_n = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None]
    mask_n = (offs_n < out_features)[:, None]
    offs_g = pid_k * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_b = pid_k * (BLOCK_G // 2) + tl.arange(0, BLOCK_G // 2)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mb = tl.load(
        meta_ptr + rows * stride_mn + offs_b[None, :],
        mask=mask_n & (offs_b < (in_features + 7) // 8)[None, :],
        other=0,
    )
    if WORDS:
        groups_ok = mask_n & (offs_g < in_features // 4)[None, :]
        words = tl.load(values_ptr + rows * stride_vn + offs_g[None, :], mask=groups_ok, other=0)
        mb = mb.to(tl.int32)
        nib = tl.reshape(tl.join(mb & 0xF, (mb >> 4) & 0xF), (BLOCK_N, BLOCK_G))
        w = expand_24_words(words, nib, out_ptr.dtype.element_ty, BLOCK_N, BLOCK_K)
    else:
        offs_kc = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        v = tl.load(
            values_ptr + rows * stride_vn + offs_kc[None, :],
            mask=mask_n & (offs_kc < in_features // 2)[None, :],
            other=0.0,
        )
        w = expand_24(v, mb, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], w, mask=mask_n & (offs_k < in_features)[None, :])
