"""2:4 sparse matmul for mid-size batches (17 to ``EXPAND_MIN_TOKENS - 1`` tokens): tile-expanding ``tl.dot``.

Upstream Triton has no sparse tensor-core MMA, so each program loads the compressed weight tile,
expands it to a dense ``[BLOCK_N, BLOCK_K]`` tile in registers (:mod:`.expand`, shared with the
decode kernel) and feeds the dense tensor cores: ``acc[M, N] += x[M, K] @ w[N, K].T`` in fp32.
At best it matches dense cuBLAS (the work is dense); what it saves is the weight bytes read, and
the expansion must stay under the tile's tensor-core time (``benchmarks/kernel_sass.py``).

On Hopper the activations come through a TMA descriptor (:mod:`.tma`): that cuts the loop's
instructions, and only then can 128-256-token tiles hide the expansion under the MMAs. Without one
``x`` is read with pointers and tiles above 128 x 128 are left out (they spill).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .expand import INTERPRET, load_weight_tile
from .tma import descriptor_or_pointer_configs, load_x_tile, set_x_block

__all__ = ["candidate_configs", "nm24_dot", "nm24_dot_kernel"]


@triton.jit
def nm24_dot_kernel(
    # Pointers
    x_ptr,  # [T, K] activations
    x_desc,  # the same through a TMA descriptor (block [BLOCK_M, BLOCK_K]) when HAS_DESC; else x_ptr again
    values_ptr,  # WORDS: int32 [N, K/4] (the values viewed as words); else [N, K/2] in x's dtype
    meta_ptr,  # [N, ceil(K/8)] uint8 positions
    bias_ptr,  # [N] or a dummy pointer when HAS_BIAS is False
    out_ptr,  # [T, N]
    # Sizes
    num_tokens,  # T (the GEMM's M)
    tokens_bucket,  # next power of two >= T: the autotune key (one tuning per bucket, not per prompt length)
    out_features,  # N
    in_features,  # K (multiple of 4)
    # Strides (elements)
    stride_xt,
    stride_vn,
    stride_mn,
    stride_ot,
    # Meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_DESC: tl.constexpr,  # x_desc is a descriptor (autotune key: configs may read x through it)
    X_DESC: tl.constexpr,  # this config reads x through x_desc
    WORDS: tl.constexpr,  # 16-bit weights read as kept-value words and expanded with byte permutes
    UPCAST: tl.constexpr,  # interpreter: compute in fp32 (its bf16 arithmetic is wrong)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    EVEN_K: tl.constexpr,  # in_features % BLOCK_K == 0: no masks along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # dense input columns per step (multiple of 16)
    GROUP_M: tl.constexpr,  # programs grouped along M for L2 reuse of weight tiles
):
    # ---- grouped program order (Triton matmul tutorial): GROUP_M row blocks share weight tiles in L2
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(num_tokens, BLOCK_M)
    num_pid_n = tl.cdiv(out_features, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < num_tokens
    mask_n = offs_n < out_features
    # int64 row offsets: T * K and N * K/2 can exceed 2**31
    rows = offs_n.to(tl.int64)[:, None]
    v_rows = values_ptr + rows * stride_vn
    m_rows = meta_ptr + rows * stride_mn
    USE_DESC: tl.constexpr = X_DESC and HAS_DESC  # configs may want a descriptor that is not there

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        # ---- activations [BLOCK_M, BLOCK_K] and expanded weight tile [BLOCK_N, BLOCK_K]
        x_tile = load_x_tile(
            x_ptr,
            x_desc,
            pid_m * BLOCK_M,
            k0,
            num_tokens,
            in_features,
            stride_xt,
            USE_DESC,
            EVEN_K,
            BLOCK_M,
            BLOCK_K,
        )
        w = load_weight_tile(
            v_rows, m_rows, mask_n, k0, in_features, out_ptr.dtype.element_ty, WORDS, EVEN_K, BLOCK_N, BLOCK_K
        )
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
            w = w.to(tl.float32)
        # ---- acc += x @ w.T
        acc = tl.dot(x_tile, tl.trans(w), acc, input_precision=INPUT_PRECISION)

    # ---- epilogue: bias, cast, store
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _dot_configs() -> list[triton.Config]:
    if INTERPRET:  # one config: the interpreter fails with several
        return [
            triton.Config(
                {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8, "X_DESC": True},
                num_warps=4,
                pre_hook=set_x_block,
            )
        ]
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); none spills on sm_90a (benchmarks/kernel_sass.py).
    # The 256- and 128-token tiles are for TMA-read x (their loop is ~0.5-0.9x of their MMA cycles);
    # the small ones for 17-64 tokens.
    shapes = [
        (256, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (64, 128, 64, 8, 3),
        (64, 64, 64, 4, 4),
        (32, 64, 128, 4, 4),
        (16, 64, 128, 4, 4),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "X_DESC": True},
            num_warps=w,
            num_stages=s,
            pre_hook=set_x_block,
        )
        for bm, bn, bk, w, s in shapes
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Without a descriptor: pointer configs, none above 128 x 128 (they spill; kernel_sass.py)."""
    configs = descriptor_or_pointer_configs(configs, kwargs["HAS_DESC"])
    return [
        c for c in configs if c.kwargs["X_DESC"] or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128
    ]


nm24_dot = triton.heuristics({"EVEN_K": lambda args: args["in_features"] % args["BLOCK_K"] == 0})(
    nm24_dot_kernel
)
nm24_dot = triton.autotune(
    _dot_configs(),
    key=["tokens_bucket", "out_features", "in_features", "WORDS", "HAS_DESC"],
    prune_configs_by={"early_config_prune": _prune},
)(nm24_dot)


def candidate_configs(has_desc: bool) -> list[triton.Config]:
    """The configs the autotuner chooses from for inputs with / without a TMA descriptor."""
    return _prune(_dot_configs(), {}, HAS_DESC=has_desc)
