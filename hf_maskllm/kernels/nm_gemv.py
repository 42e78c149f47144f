"""2:4 sparse GEMV for decoding (1 to 16 tokens): ``out[t, :] = x[t, :] @ W.T`` with W compressed.

Format (see ``hf_maskllm.sparse.format``): ``values [out, in/2]`` holds the 2 kept weights of every
group of 4 inputs in increasing position order; ``meta uint8 [out, in/8]`` holds their positions,
2 bits each, little-endian: byte ``b`` of a row covers groups ``2b`` (low nibble) and ``2b + 1``
(high nibble); in a nibble, bits 0-1 are the position of the first kept value, bits 2-3 of the second.

Each program owns ``BLOCK_N`` output rows and walks the input dimension ``BLOCK_K`` dense columns at a
time: it loads the compressed tile (``BLOCK_N x BLOCK_K/2`` values, ``BLOCK_N x BLOCK_K/8`` meta
bytes), expands it to a dense ``BLOCK_N x BLOCK_K`` tile in registers (:func:`expand_24`), and
multiplies it with every token's contiguous slice of ``x`` with fp32 FMAs. The weight is read once
for all tokens; decode is memory-bound, so the compressed bytes (56.25% of dense) set the speed.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["INTERPRET", "expand_24", "nm24_gemv_kernel"]

# The interpreter (CPU) cannot autotune over several configs and does bf16 arithmetic wrong.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def expand_24(v, meta, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expand a compressed 2:4 tile to dense.

    v: ``[BLOCK_N, BLOCK_K // 2]`` kept values; meta: ``[BLOCK_N, BLOCK_K // 8]`` meta bytes.
    Returns the dense ``[BLOCK_N, BLOCK_K]`` tile in ``v``'s dtype (zeros where pruned).
    """
    BLOCK_G: tl.constexpr = BLOCK_K // 4
    # ---- kept values of each group: v0 = first kept, v1 = second kept, [BLOCK_N, BLOCK_G] each
    v0, v1 = tl.split(tl.reshape(v, (BLOCK_N, BLOCK_G, 2)))
    # ---- one nibble per group: group 2b is the low nibble of byte b, group 2b+1 the high one
    meta = meta.to(tl.int32)
    nib = tl.reshape(tl.join(meta & 0xF, (meta >> 4) & 0xF), (BLOCK_N, BLOCK_G))
    p0 = nib & 3  # position (0..3) of v0 inside its group
    p1 = nib >> 2  # position (0..3) of v1 inside its group
    # ---- dense column p of each group: w_p = v0 if p0 == p else (v1 if p1 == p else 0)
    zero = tl.zeros_like(v0)
    w0 = tl.where(p0 == 0, v0, tl.where(p1 == 0, v1, zero))
    w1 = tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, zero))
    w2 = tl.where(p0 == 2, v0, tl.where(p1 == 2, v1, zero))
    w3 = tl.where(p0 == 3, v0, tl.where(p1 == 3, v1, zero))
    # ---- interleave: join(join(w0, w2), join(w1, w3))[g, q, r] = w_{2q + r}  -> [BLOCK_N, BLOCK_K]
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_K))


@triton.jit
def nm24_gemv_kernel(
    # Pointers
    x_ptr,  # [T, K] activations
    values_ptr,  # [N, K/2] kept weights
    meta_ptr,  # [N, ceil(K/8)] uint8 positions
    bias_ptr,  # [N] or a dummy pointer when HAS_BIAS is False
    out_ptr,  # [T, N]
    # Sizes
    num_tokens,  # T
    out_features,  # N
    in_features,  # K (multiple of 4)
    # Strides (elements)
    stride_xt,
    stride_vn,
    stride_mn,
    stride_ot,
    # Meta-parameters
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two >= T (T <= 16)
    BLOCK_N: tl.constexpr,  # output rows per program
    BLOCK_K: tl.constexpr,  # dense input columns per step (multiple of 8)
):
    pid_n = tl.program_id(axis=0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kc = tl.arange(0, BLOCK_K // 2)  # compressed columns of one step
    offs_kb = tl.arange(0, BLOCK_K // 8)  # meta bytes of one step
    offs_k = tl.arange(0, BLOCK_K)  # dense columns of one step
    mask_t = offs_t < num_tokens
    mask_n = offs_n < out_features
    # int64 row offsets: N * K/2 can exceed 2**31 for large layers
    rows_n = offs_n.to(tl.int64)
    v_ptrs = values_ptr + rows_n[:, None] * stride_vn + offs_kc[None, :]
    m_ptrs = meta_ptr + rows_n[:, None] * stride_mn + offs_kb[None, :]
    x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    kc_total = in_features // 2
    kb_total = (in_features + 7) // 8

    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        # ---- load the compressed tile and this step's slice of every token
        v = tl.load(v_ptrs, mask=mask_n[:, None] & (offs_kc[None, :] + k0 // 2 < kc_total), other=0.0)
        meta = tl.load(m_ptrs, mask=mask_n[:, None] & (offs_kb[None, :] + k0 // 8 < kb_total), other=0)
        x = tl.load(x_ptrs, mask=mask_t[:, None] & (offs_k[None, :] + k0 < in_features), other=0.0)
        # ---- expand to dense [BLOCK_N, BLOCK_K] (fp32: FMA path; also right under the interpreter)
        w = expand_24(v.to(tl.float32), meta, BLOCK_N, BLOCK_K)
        # ---- acc[t, n] += sum_k x[t, k] * w[n, k]
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        v_ptrs += BLOCK_K // 2
        m_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K

    # ---- epilogue: bias, cast, store
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])


def _gemv_configs(wide: bool) -> list[triton.Config]:
    """Small autotune lists; ``wide`` for 5..16 tokens (keeps the [T, N, K] product in registers)."""
    if INTERPRET:  # one config: the interpreter fails with several; big blocks keep it fast
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 128}, num_warps=4)]
    # (BLOCK_N, BLOCK_K, num_warps); all compile for sm_90a without spills (ptxas -v, triton 3.7)
    if wide:
        shapes = [(4, 64, 4), (4, 64, 8), (8, 64, 8), (8, 128, 8), (16, 32, 4), (16, 32, 8)]
    else:
        shapes = [
            (4, 256, 4),
            (8, 128, 4),
            (8, 256, 4),
            (8, 256, 8),
            (16, 128, 4),
            (16, 256, 8),
            (32, 128, 8),
        ]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in shapes]


# Two tuners over one kernel: 1..4 tokens and 5..16 tokens get different block shapes.
nm24_gemv_narrow = triton.autotune(
    _gemv_configs(wide=False), key=["BLOCK_T", "out_features", "in_features"]
)(nm24_gemv_kernel)
nm24_gemv_wide = triton.autotune(_gemv_configs(wide=True), key=["BLOCK_T", "out_features", "in_features"])(
    nm24_gemv_kernel
)
