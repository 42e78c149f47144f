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

from .expand import INTERPRET, load_weight_tile

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
    pid_n = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    rows = offs_n.to(tl.int64)[:, None]
    k0 = pid_k * BLOCK_K
    w = load_weight_tile(
        values_ptr + rows * stride_vn, meta_ptr + rows * stride_mn, mask_n, k0, in_features,
        out_ptr.dtype.element_ty, WORDS, False, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows * stride_on + offs_k[None, :],
        w,
        mask=mask_n[:, None] & (offs_k < in_features)[None, :],
    )
