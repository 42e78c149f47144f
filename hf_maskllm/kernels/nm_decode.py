"""2:4 sparse linear for decoding and small batches (1 to 16 tokens), on tensor cores.

``out[t, n] = sum_k x[t, k] * W[n, k]`` with ``W`` compressed (format: :mod:`.expand`).

Each program owns ``BLOCK_N`` output rows and walks the input dimension ``BLOCK_K`` dense columns
at a time: it loads the compressed tile (one 32-bit word of kept values and one nibble of positions
per group of 4), expands it to a dense ``[BLOCK_N, BLOCK_K]`` tile in registers
(:func:`.expand.expand_24_words`) and multiplies it with the tokens' transposed slice
``x^T [BLOCK_K, BLOCK_T]`` on the tensor cores (``BLOCK_T = 16``, padded with zero rows). The weight
is the dot's *first* operand, so the expanded tile goes from registers straight into the MMA
(Hopper ``wgmma`` takes its A operand from registers; ``mma.sync`` always does) and only the small
``x^T`` goes through shared memory (copied there by TMA for the configs that gain from it:
:mod:`.tma`). The weight is read once for all tokens; decode is memory-bound,
so the compressed bytes (56.25% of dense) set the speed as long as the expansion fits in the
instruction budget, which is why it is done with byte permutes rather than FMAs per token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .expand import INTERPRET, load_weight_tile
from .tma import descriptor_or_pointer_configs, load_x_tile, set_x_block

__all__ = ["candidate_configs", "nm24_decode", "nm24_decode_kernel"]


@triton.jit
def nm24_decode_kernel(
    # Pointers
    x_ptr,  # [T, K] activations
    x_desc,  # the same through a TMA descriptor (block [BLOCK_T, BLOCK_K]) when HAS_DESC; else x_ptr again
    values_ptr,  # WORDS: int32 [N, K/4] (the values viewed as words); else [N, K/2] in x's dtype
    meta_ptr,  # [N, ceil(K/8)] uint8 positions
    bias_ptr,  # [N] or a dummy pointer when HAS_BIAS is False
    out_ptr,  # [T, N]
    # Sizes
    num_tokens,  # T
    out_features,  # N
    in_features,  # K (multiple of 4)
    # Strides (elements of each tensor's own dtype)
    stride_xt,
    stride_vn,
    stride_mn,
    stride_ot,
    # Meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_DESC: tl.constexpr,  # x_desc is a descriptor (autotune key: configs may read x through it)
    X_DESC: tl.constexpr,  # this config reads x through x_desc
    WORDS: tl.constexpr,  # 16-bit weights read as kept-value words and expanded with byte permutes
    UPCAST: tl.constexpr,  # interpreter: multiply in fp32 (its bf16 arithmetic is wrong)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    EVEN_K: tl.constexpr,  # in_features % BLOCK_K == 0: no masks along K
    BLOCK_T: tl.constexpr,  # tokens per program (>= 16: the MMA's smallest N)
    BLOCK_N: tl.constexpr,  # output rows per program
    BLOCK_K: tl.constexpr,  # dense input columns per step (multiple of 32)
):
    pid_n = tl.program_id(axis=0)
    pid_t = tl.program_id(axis=1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_n = offs_n < out_features
    mask_t = offs_t < num_tokens
    # int64 row offsets: N * K/2 and T * K can exceed 2**31
    rows = offs_n.to(tl.int64)[:, None]
    v_rows = values_ptr + rows * stride_vn
    m_rows = meta_ptr + rows * stride_mn
    USE_DESC: tl.constexpr = X_DESC and HAS_DESC  # configs may want a descriptor that is not there

    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        # ---- this step's tokens [BLOCK_T, BLOCK_K] and expanded weight tile [BLOCK_N, BLOCK_K]
        x_tile = load_x_tile(
            x_ptr,
            x_desc,
            pid_t * BLOCK_T,
            k0,
            num_tokens,
            in_features,
            stride_xt,
            USE_DESC,
            EVEN_K,
            BLOCK_T,
            BLOCK_K,
        )
        w = load_weight_tile(
            v_rows, m_rows, mask_n, k0, in_features, out_ptr.dtype.element_ty, WORDS, EVEN_K, BLOCK_N, BLOCK_K
        )
        if UPCAST:
            w = w.to(tl.float32)
            x_tile = x_tile.to(tl.float32)
        # ---- acc[n, t] += sum_k w[n, k] * x[t, k]
        acc = tl.dot(w, tl.trans(x_tile), acc, input_precision=INPUT_PRECISION)

    # ---- epilogue: bias, cast, store out[t, n] = acc[n, t]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_t.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_t[None, :])


def _decode_configs() -> list[triton.Config]:
    if INTERPRET:  # one config: the interpreter fails with several; big blocks keep it fast
        return [
            triton.Config({"BLOCK_N": 32, "BLOCK_K": 64, "X_DESC": True}, num_warps=4, pre_hook=set_x_block)
        ]
    # (BLOCK_N, BLOCK_K, num_warps, num_stages). Small BLOCK_N keeps >= 132 programs on the
    # 4096-row layers (mma.sync, x through TMA); 64/128 rows use wgmma (x through pointers: TMA
    # gains nothing there). None that the pruning keeps spills on sm_90a (benchmarks/kernel_sass.py).
    shapes = [
        (16, 256, 2, 3),
        (32, 128, 2, 3),
        (32, 128, 1, 4),
        (32, 256, 2, 3),
        (64, 128, 4, 3),
        (128, 128, 4, 3),
    ]
    return [
        triton.Config(
            {"BLOCK_N": bn, "BLOCK_K": bk, "X_DESC": bn < 64}, num_warps=w, num_stages=s, pre_hook=set_x_block
        )
        for bn, bk, w, s in shapes
    ]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Without a descriptor: pointer configs, none with one warp (it spills with a bias; kernel_sass.py)."""
    configs = descriptor_or_pointer_configs(configs, kwargs["HAS_DESC"])
    return [c for c in configs if c.kwargs["X_DESC"] or c.num_warps > 1]


nm24_decode = triton.heuristics({"EVEN_K": lambda args: args["in_features"] % args["BLOCK_K"] == 0})(
    nm24_decode_kernel
)
nm24_decode = triton.autotune(
    _decode_configs(),
    key=["out_features", "in_features", "WORDS", "HAS_DESC"],
    prune_configs_by={"early_config_prune": _prune},
)(nm24_decode)


def candidate_configs(has_desc: bool) -> list[triton.Config]:
    """The configs the autotuner chooses from for inputs with / without a TMA descriptor."""
    return _prune(_decode_configs(), {}, HAS_DESC=has_desc)
