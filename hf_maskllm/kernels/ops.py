"""Host side of the N:M kernels: argument checks, kernel choice, launchers and the custom op.

``nm_linear`` is what modules call. It flattens leading dims and runs the opaque custom op
``hf_maskllm::nm_linear`` (so ``torch.compile(fullgraph=True)`` and CUDA graphs see one node), which
picks a backend in constant time:

- 2:4 on CUDA (or on CPU under ``TRITON_INTERPRET=1``) with Triton importable:
  ``tokens <= DECODE_MAX_TOKENS`` -> :mod:`.nm_decode` (decode, small batches);
  ``tokens < EXPAND_MIN_TOKENS`` -> :mod:`.nm_dot` (tile-expanding ``tl.dot``);
  else :mod:`.nm_expand` + ``F.linear`` (expand the weight once, dense cuBLAS: prefill);
- anything else (other N:M, plain CPU, no Triton) has no kernel here and is refused: ``SparseLinear``
  routes those cases itself (the CPU kernels, or a decompressed weight and ``F.linear``).
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError, MaskLLMError
from ..patterns import check_nm_args

if TYPE_CHECKING:
    import triton

__all__ = [
    "DECODE_MAX_TOKENS",
    "EXPAND_MIN_TOKENS",
    "nm_decompress_24",
    "nm_linear",
    "nm_linear_decode",
    "nm_linear_dot",
    "nm_linear_expand",
    "triton_linear",
]

# The routes by token count (constant-time choice). Up to DECODE_MAX_TOKENS: the decode kernel (one
# 16-token MMA tile); from EXPAND_MIN_TOKENS: expand once + cuBLAS; between: the tl.dot kernel.
# EXPAND_MIN_TOKENS is an estimate from instruction counts (docs/kernels.md) until a GPU measures the
# crossover (benchmarks/gpu_kernels.py prints every route).
DECODE_MAX_TOKENS = 16
EXPAND_MIN_TOKENS = 1024
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def meta_bytes_per_row(n: int, m: int, in_features: int) -> int:
    """Bytes of position metadata per row: ``ceil((in * n / m) * ceil(log2 m) / 8)``."""
    bits = math.ceil(math.log2(m))
    return math.ceil(in_features * n // m * bits / 8)


def _check_args(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> None:
    check_nm_args(n, m)
    if not isinstance(in_features, int) or in_features <= 0 or in_features % m:
        raise ConfigError(f"`in_features` must be a positive multiple of m={m}, got {in_features!r}.")
    if x.shape[-1] != in_features:
        raise MaskLLMError(
            f"nm_linear: input has {x.shape[-1]} features in its last dim but the weight expects "
            f"in_features={in_features}; pass x of shape [..., {in_features}]."
        )
    if x.dtype not in _SUPPORTED_DTYPES:
        raise MaskLLMError(
            f"nm_linear: input dtype {x.dtype} is not supported; use float16, bfloat16 or float32."
        )
    if values.dtype != x.dtype:
        raise MaskLLMError(
            f"nm_linear: input dtype {x.dtype} differs from weight dtype {values.dtype}; cast x with "
            f"x.to({values.dtype})."
        )
    kc = in_features * n // m
    if values.dim() != 2 or values.shape[1] != kc:
        raise CheckpointError(
            f"nm_linear: `values` must have shape [out, in*n/m] = [out, {kc}], got {tuple(values.shape)}; "
            "build it with hf_maskllm.sparse.format.compress(weight, n, m)."
        )
    out_features = values.shape[0]
    mb = meta_bytes_per_row(n, m, in_features)
    if meta.dtype != torch.uint8 or tuple(meta.shape) != (out_features, mb):
        raise CheckpointError(
            f"nm_linear: `meta` must be uint8 of shape [{out_features}, {mb}], got {meta.dtype} "
            f"{tuple(meta.shape)}; build it with hf_maskllm.sparse.format.compress(weight, n, m)."
        )
    tensors = {"values": values, "meta": meta}
    if bias is not None:
        if tuple(bias.shape) != (out_features,):
            raise MaskLLMError(
                f"nm_linear: `bias` must have shape [{out_features}], got {tuple(bias.shape)}."
            )
        if bias.dtype != x.dtype:
            raise MaskLLMError(
                f"nm_linear: bias dtype {bias.dtype} differs from input dtype {x.dtype}; cast it with "
                f"bias.to({x.dtype})."
            )
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != x.device:
            raise MaskLLMError(
                f"nm_linear: `{name}` is on {t.device} but x is on {x.device}; move both to one device."
            )


# ------------------------------------------------------------------------------------------------
# Launchers (2:4 only). They take a 2-D x and may write into a preallocated `out` (tests poison it).
# ------------------------------------------------------------------------------------------------


def _kernel_values(values: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The values as the kernels read them, and whether they are words (``WORDS``).

    16-bit values 4-byte aligned are passed as int32 words (one per group of 4: both kept values),
    which the kernels expand with byte permutes; others (fp32, unaligned) as they are.
    """
    values = values.contiguous()
    words = values.element_size() == 2 and values.data_ptr() % 4 == 0
    return (values.view(torch.int32) if words else values), words


def _prepare(
    x2d: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
):
    """Contiguous inputs (the kernels assume unit strides), the output buffer, the values as the
    kernels read them, and the pointer to pass for an absent bias."""
    if out is None:
        out = torch.empty(x2d.shape[0], values.shape[0], dtype=x2d.dtype, device=x2d.device)
    values, words = _kernel_values(values)
    bias = bias.contiguous() if bias is not None else values  # a dummy pointer when HAS_BIAS is False
    return x2d.contiguous(), values, meta.contiguous(), bias, out, words


def _launch(tuned, grid, args: tuple, constexprs: dict, config: triton.Config | None, x_desc) -> None:
    """Launch an autotuned kernel, or, with ``config``, that one config of it (tests, benchmarks)."""
    if config is None:
        tuned[grid](*args, **constexprs)
        return
    full = {**constexprs, **config.kwargs, "x_desc": x_desc}
    if config.pre_hook is not None:
        config.pre_hook(full)
    tuned.fn[grid](
        *args, **constexprs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
    )


def nm_linear_decode(
    x2d: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """2:4 decode kernel for ``1 <= x2d.shape[0] <= 16`` tokens; ``x2d [T, K]`` -> ``[T, N]``.

    ``config``: run this ``triton.Config`` (one of ``nm_decode.candidate_configs``) instead of the
    autotuned choice.
    """
    import triton

    from .nm_decode import nm24_decode
    from .tma import x_descriptor

    num_tokens, in_features = x2d.shape
    if not 1 <= num_tokens <= DECODE_MAX_TOKENS:
        raise MaskLLMError(
            f"nm_linear_decode takes 1..{DECODE_MAX_TOKENS} tokens, got {num_tokens}; use nm_linear."
        )
    has_bias = bias is not None
    x2d, values, meta, bias, out, words = _prepare(x2d, values, meta, bias, out)
    out_features = values.shape[0]
    x_desc = x_descriptor(x2d)

    def grid(meta_args):
        return (triton.cdiv(out_features, meta_args["BLOCK_N"]), 1)

    args = (
        x2d, x2d if x_desc is None else x_desc, values, meta, bias, out,
        num_tokens, out_features, in_features,
        x2d.stride(0), values.stride(0), meta.stride(0), out.stride(0),
    )  # fmt: skip
    constexprs = dict(
        HAS_BIAS=has_bias, HAS_DESC=x_desc is not None, WORDS=words, UPCAST=_interpret(),
        INPUT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32", BLOCK_T=DECODE_MAX_TOKENS,
    )  # fmt: skip
    _launch(nm24_decode, grid, args, constexprs, config, x_desc)
    return out


def nm_linear_dot(
    x2d: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """2:4 tile-expanding ``tl.dot`` kernel for any token count; ``x2d [T, K]`` -> ``[T, N]``.

    ``config``: run this ``triton.Config`` (one of ``nm_dot.candidate_configs``) instead of the
    autotuned choice.
    """
    import triton

    from .nm_dot import nm24_dot
    from .tma import x_descriptor

    num_tokens, in_features = x2d.shape
    has_bias = bias is not None
    x2d, values, meta, bias, out, words = _prepare(x2d, values, meta, bias, out)
    x_desc = x_descriptor(x2d)
    out_features = values.shape[0]

    def grid(meta_args):
        return (
            triton.cdiv(num_tokens, meta_args["BLOCK_M"]) * triton.cdiv(out_features, meta_args["BLOCK_N"]),
        )

    args = (
        x2d, x2d if x_desc is None else x_desc, values, meta, bias, out,
        num_tokens, triton.next_power_of_2(num_tokens), out_features, in_features,
        x2d.stride(0), values.stride(0), meta.stride(0), out.stride(0),
    )  # fmt: skip
    constexprs = dict(
        HAS_BIAS=has_bias, HAS_DESC=x_desc is not None, WORDS=words, UPCAST=_interpret(),
        INPUT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    _launch(nm24_dot, grid, args, constexprs, config, x_desc)
    return out


def nm_decompress_24(values: torch.Tensor, meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """Dense ``[out, in_features]`` weight from 2:4 ``(values, meta)`` with the Triton expansion kernel."""
    import triton

    from .nm_expand import EXPAND_BLOCK_K, EXPAND_BLOCK_N, EXPAND_WARPS, nm24_expand_kernel

    out_features, meta = values.shape[0], meta.contiguous()
    out = torch.empty(out_features, in_features, dtype=values.dtype, device=values.device)
    kernel_values, words = _kernel_values(values)
    grid = (triton.cdiv(out_features, EXPAND_BLOCK_N), triton.cdiv(in_features, EXPAND_BLOCK_K))
    nm24_expand_kernel[grid](
        kernel_values, meta, out, out_features, in_features,
        kernel_values.stride(0), meta.stride(0), out.stride(0),
        WORDS=words, BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=EXPAND_BLOCK_K, num_warps=EXPAND_WARPS,
    )  # fmt: skip
    return out


def nm_linear_expand(
    x2d: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Large-batch route: expand the 2:4 weight once on the device, then dense ``F.linear`` (cuBLAS)."""
    return F.linear(x2d, nm_decompress_24(values, meta, x2d.shape[1]), bias)


def _use_triton(x: torch.Tensor, n: int, m: int) -> bool:
    return (n, m) == (2, 4) and _HAS_TRITON and (x.is_cuda or (_interpret() and x.device.type == "cpu"))


def _check_kernel_exists(x: torch.Tensor, n: int, m: int) -> None:
    if not _use_triton(x, n, m):
        raise MaskLLMError(
            f"nm_linear runs the Triton 2:4 kernels (CUDA, or CPU under TRITON_INTERPRET=1); got {n}:{m} on "
            f"{x.device.type}{'' if _HAS_TRITON else ' without Triton installed'}. Use SparseLinear, which "
            "routes every N:M on every device, or decompress the weight (hf_maskllm.sparse.decompress) and "
            "call F.linear."
        )


# ------------------------------------------------------------------------------------------------
# The custom op: one opaque node for torch.compile / CUDA graphs.
# ------------------------------------------------------------------------------------------------


def triton_linear(
    x2d: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The 2:4 Triton route by token count for a 2-D ``x2d [T, K]`` (no checks, no autograd)."""
    if x2d.shape[0] == 0:
        return x2d.new_empty(0, values.shape[0])
    if x2d.shape[0] <= DECODE_MAX_TOKENS:
        return nm_linear_decode(x2d, values, meta, bias)
    if x2d.shape[0] < EXPAND_MIN_TOKENS:
        return nm_linear_dot(x2d, values, meta, bias)
    return nm_linear_expand(x2d, values, meta, bias)


@torch.library.custom_op("hf_maskllm::nm_linear", mutates_args=())
def _nm_linear_op(
    x2d: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    _check_kernel_exists(x2d, n, m)
    return triton_linear(x2d, values, meta, bias)


@_nm_linear_op.register_fake
def _(x2d, values, meta, n, m, in_features, bias):
    return x2d.new_empty(x2d.shape[0], values.shape[0])


def nm_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W [out, in]`` given compressed as N:M ``(values, meta)``.

    Args:
        x: ``[..., in_features]`` activations (float16, bfloat16 or float32; same dtype as ``values``).
        values: ``[out, in * n / m]`` kept weights, from ``hf_maskllm.sparse.format.compress``.
        meta: ``uint8 [out, ceil(in * n / m * ceil(log2 m) / 8)]`` positions of the kept weights.
        n, m: the pattern: 2:4, on CUDA (or on CPU under ``TRITON_INTERPRET=1``) with Triton installed;
            anything else raises ``MaskLLMError`` (``SparseLinear`` routes every N:M on every device).
        in_features: dense input size (a multiple of ``m``).
        bias: optional ``[out]``.

    Returns:
        ``[..., out]`` in ``x``'s dtype, accumulated in fp32.
    """
    _check_args(x, values, meta, n, m, in_features, bias)
    lead = x.shape[:-1]
    y = torch.ops.hf_maskllm.nm_linear(x.reshape(-1, in_features), values, meta, n, m, in_features, bias)
    return y.reshape(*lead, values.shape[0])
