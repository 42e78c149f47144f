"""The one place that routes a compressed linear to its kernel, through registered torch ops.

Compressed layers (``SparseLinear``, ``QuantizedSparseLinear``) ask :func:`has_kernel` /
:func:`has_kernel_q` whether a kernel reads their weight for this call, then call
:func:`sparse_linear` / :func:`sparse_linear_q` (``F.linear`` with the compressed weight, no
autograd), or :func:`expand` / :func:`expand_q` for the dense weight where autograd or autocast needs
one. The backends, by device:

- CPU: the C++ kernels of :mod:`.cpu_extension`, routed by token count in :mod:`.cpu_ops` (direct
  kernel for decode, expansion into a reused buffer plus a dense GEMM for prefill); every N:M;
  float32 / bfloat16 / float16 values, int8 / int4 codes with float16 scales.
- CUDA: the 2:4 Triton kernels of :mod:`.ops`, routed by token count there; int8 / int4 codes are
  dequantized to the input's dtype first and take the same kernels.

:func:`int8_linear` serves a dense (not N:M) layer stored as int8 codes with one float16 scale per
row, such as a quantized output embedding (the C++ kernel on CPU; a dequantized weight on CUDA).

Each entry point is a torch op in the ``hf_maskllm`` namespace (``sparse_linear``,
``sparse_linear_q``, ``sparse_expand``, ``sparse_expand_q``, ``int8_linear``) with a fake
implementation, so ``torch.compile(model, fullgraph=True)`` sees one opaque node per call: no graph
break, and no guard on a layer's data pointers or version counters, so nothing recompiles once warm. Eagerly the same
implementation is called directly: a call through the dispatcher costs several microseconds of Python
per layer, and a decoding model makes hundreds of these calls per token. For the same reason a compiled
CPU decode step (a fixed count of at most ``cpu_ops.CPU_DECODE_MAX_TOKENS`` tokens) reaches int8 / int4
layers through ``sparse_decode_q``, whose kernel is the C++ decode kernel itself (registered by the
extension when it loads), not a Python function.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import cpu_ops
from .codes import dequantize_values
from .cpu_extension import cpu_kernels
from .ops import nm_decompress_24, triton_linear

__all__ = [
    "KERNEL_DTYPES",
    "expand",
    "expand_q",
    "has_expand",
    "has_kernel",
    "has_kernel_int8",
    "has_kernel_q",
    "int8_linear",
    "sparse_linear",
    "sparse_linear_q",
]

# the activation dtypes (and float value dtypes) the kernels take
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def _cpu_ready() -> bool:
    """Whether the C++ kernels are built (a constant for ``torch.compile``: never traced into)."""
    return cpu_kernels() is not None


def _cpu_decode(x: torch.Tensor, in_features: int) -> bool:
    """Under ``torch.compile``: whether ``x`` is a CPU decode call that the C++ op ``sparse_decode_q`` serves
    directly: a token count known to be at most ``cpu_ops.CPU_DECODE_MAX_TOKENS`` without a guard (a graph
    with a dynamic length takes the general op and stays valid for every length). The kernels are built:
    callers checked :func:`has_kernel_q`."""
    return x.device.type == "cpu" and statically_known_true(
        x.numel() <= cpu_ops.CPU_DECODE_MAX_TOKENS * in_features
    )


def _triton_ready(n: int, m: int) -> bool:
    return _HAS_TRITON and (n, m) == (2, 4)


# ------------------------------------------------------------------------------------------------
# Which route: the modules ask before calling.
# ------------------------------------------------------------------------------------------------


def has_kernel(x: torch.Tensor, values: torch.Tensor, n: int, m: int) -> bool:
    """Whether :func:`sparse_linear` serves ``x`` with float ``values`` (same dtype and device; not under
    CPU autocast, which chooses its own dtype)."""
    if x.dtype != values.dtype or x.dtype not in KERNEL_DTYPES or x.device != values.device:
        return False
    if x.device.type == "cpu":
        return not torch.is_autocast_enabled("cpu") and _cpu_ready()
    return x.is_cuda and _triton_ready(n, m)


def has_kernel_q(x: torch.Tensor, qvalues: torch.Tensor, n: int, m: int) -> bool:
    """Whether :func:`sparse_linear_q` serves ``x`` with integer codes ``qvalues`` (on ``x``'s device)."""
    if x.dtype not in KERNEL_DTYPES or x.device != qvalues.device:
        return False
    if x.device.type == "cpu":
        return not torch.is_autocast_enabled("cpu") and _cpu_ready()
    return x.is_cuda and _triton_ready(n, m)


def has_kernel_int8(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether :func:`int8_linear` serves ``x`` with a dense int8 weight ``qweight`` (on ``x``'s device)."""
    if x.dtype not in KERNEL_DTYPES or x.device != qweight.device:
        return False
    if x.device.type == "cpu":
        return not torch.is_autocast_enabled("cpu") and _cpu_ready()
    return x.is_cuda


def has_expand(tensor: torch.Tensor, dtype: torch.dtype, n: int, m: int) -> bool:
    """Whether :func:`expand` / :func:`expand_q` build the dense weight in ``dtype`` for a layer whose
    tensors are on ``tensor``'s device."""
    if dtype not in KERNEL_DTYPES:
        return False
    if tensor.device.type == "cpu":
        return _cpu_ready()
    return tensor.is_cuda and _triton_ready(n, m)


# ------------------------------------------------------------------------------------------------
# The implementations (eager calls run these directly; the registered ops call them too).
# ------------------------------------------------------------------------------------------------


def _bias_like(bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)


def _linear_impl(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    bias = _bias_like(bias, x)
    if x.device.type == "cpu":
        return cpu_ops.nm_linear_cpu(cpu_kernels(), x, values, meta, n, m, in_features, bias)
    y = triton_linear(x.reshape(-1, in_features), values, meta, bias)
    return y.view(*x.shape[:-1], values.shape[0])


def _linear_q_impl(
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
    bias = _bias_like(bias, x)
    if x.device.type == "cpu":
        return cpu_ops.nm_linear_q_cpu(
            cpu_kernels(), x, qvalues, scales, meta, n, m, bits, group_size, in_features, bias
        )
    values = dequantize_values(qvalues, scales, bits, group_size, x.dtype)  # CUDA: the float Triton route
    return _linear_impl(x, values, meta, n, m, in_features, bias)


def _int8_linear_impl(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    bias = _bias_like(bias, x)
    if x.device.type == "cpu":
        return cpu_ops.int8_linear_cpu(cpu_kernels(), x, qweight, scales, bias)
    weight = (qweight.to(torch.float32) * scales.to(torch.float32)[:, None]).to(x.dtype)
    return F.linear(x, weight, bias)


def _expand_impl(
    values: torch.Tensor, meta: torch.Tensor, n: int, m: int, in_features: int, keep: bool = True
) -> torch.Tensor:
    if values.device.type == "cpu":
        return cpu_ops.expand_cpu(cpu_kernels(), values, meta, n, m, in_features, keep=keep)
    return nm_decompress_24(values, meta, in_features)


def _expand_q_impl(
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    if qvalues.device.type == "cpu":
        return cpu_ops.expand_q_cpu(
            cpu_kernels(), qvalues, scales, meta, n, m, bits, group_size, in_features, dtype, keep=True
        )
    values = dequantize_values(qvalues, scales, bits, group_size, dtype)
    return nm_decompress_24(values, meta, in_features)


# ------------------------------------------------------------------------------------------------
# The registered ops: schema, CPU and CUDA kernels, fake implementations.
# ------------------------------------------------------------------------------------------------

_LIB = torch.library.Library("hf_maskllm", "FRAGMENT")  # held: the registrations live as long as it does
_LIB.define(
    "sparse_linear(Tensor x, Tensor values, Tensor meta, int n, int m, int in_features, Tensor? bias) -> Tensor"
)
_LIB.define(
    "sparse_linear_q(Tensor x, Tensor qvalues, Tensor scales, Tensor meta, int n, int m, int bits, "
    "int group_size, int in_features, Tensor? bias) -> Tensor"
)
_LIB.define("sparse_expand(Tensor values, Tensor meta, int n, int m, int in_features) -> Tensor")
_LIB.define(
    "sparse_expand_q(Tensor qvalues, Tensor scales, Tensor meta, int n, int m, int bits, int group_size, "
    "int in_features, ScalarType dtype) -> Tensor"
)
_LIB.define("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor")
# CPU decode of int8 / int4 layers (up to cpu_ops.CPU_DECODE_MAX_TOKENS tokens): its kernel is the C++
# nm_linear_q itself, registered by the extension when it loads, so a compiled step calls it without the
# few microseconds of Python a call of a Python kernel costs. Compiled graphs use it where the token count
# is fixed; eager calls reach the same kernel through cpu_ops.
_LIB.define(
    "sparse_decode_q(Tensor x, Tensor qvalues, Tensor scales, Tensor meta, int n, int m, int bits, "
    "int group_size, Tensor? bias) -> Tensor"
)
for _device in ("CPU", "CUDA"):
    _LIB.impl("sparse_linear", _linear_impl, _device)
    _LIB.impl("sparse_linear_q", _linear_q_impl, _device)
    _LIB.impl("sparse_expand", _expand_impl, _device)
    _LIB.impl("sparse_expand_q", _expand_q_impl, _device)
    _LIB.impl("int8_linear", _int8_linear_impl, _device)


@torch.library.register_fake("hf_maskllm::sparse_linear", lib=_LIB)
def _(x, values, meta, n, m, in_features, bias):
    return x.new_empty((*x.shape[:-1], values.shape[0]))


@torch.library.register_fake("hf_maskllm::sparse_linear_q", lib=_LIB)
def _(x, qvalues, scales, meta, n, m, bits, group_size, in_features, bias):
    return x.new_empty((*x.shape[:-1], qvalues.shape[0]))


@torch.library.register_fake("hf_maskllm::sparse_decode_q", lib=_LIB)
def _(x, qvalues, scales, meta, n, m, bits, group_size, bias):
    return x.new_empty((*x.shape[:-1], qvalues.shape[0]))


@torch.library.register_fake("hf_maskllm::sparse_expand", lib=_LIB)
def _(values, meta, n, m, in_features):
    return values.new_empty((values.shape[0], in_features))


@torch.library.register_fake("hf_maskllm::sparse_expand_q", lib=_LIB)
def _(qvalues, scales, meta, n, m, bits, group_size, in_features, dtype):
    return qvalues.new_empty((qvalues.shape[0], in_features), dtype=dtype)


@torch.library.register_fake("hf_maskllm::int8_linear", lib=_LIB)
def _(x, qweight, scales, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# ------------------------------------------------------------------------------------------------
# What the modules call: the implementation eagerly, the registered op under torch.compile.
# ------------------------------------------------------------------------------------------------


def sparse_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``W`` compressed as N:M float ``(values, meta)``; no autograd.

    ``x [..., in_features]`` in the values' dtype; ``bias`` is cast to it. Check :func:`has_kernel` first.
    """
    if torch.compiler.is_compiling():
        return torch.ops.hf_maskllm.sparse_linear(x, values, meta, n, m, in_features, bias)
    return _linear_impl(x, values, meta, n, m, in_features, bias)


def sparse_linear_q(
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
    """``F.linear(x, dequant(W), bias)`` for int8 / int4 codes ``qvalues`` with float16 ``scales``; no autograd.

    The output is in ``x``'s dtype (accumulated in float32). Check :func:`has_kernel_q` first.
    """
    if torch.compiler.is_compiling():
        if _cpu_decode(x, in_features):
            return torch.ops.hf_maskllm.sparse_decode_q(
                x, qvalues, scales, meta, n, m, bits, group_size, _bias_like(bias, x)
            )
        return torch.ops.hf_maskllm.sparse_linear_q(
            x, qvalues, scales, meta, n, m, bits, group_size, in_features, bias
        )
    return _linear_q_impl(x, qvalues, scales, meta, n, m, bits, group_size, in_features, bias)


def expand(
    values: torch.Tensor, meta: torch.Tensor, n: int, m: int, in_features: int, keep: bool = True
) -> torch.Tensor:
    """The dense ``[out, in_features]`` weight in the values' dtype (check :func:`has_expand` first).

    ``keep=False`` (eager CPU only) writes it into the thread's reused buffer, valid until the next
    expansion: for a weight used at once and not saved for a backward pass.
    """
    if torch.compiler.is_compiling():
        return torch.ops.hf_maskllm.sparse_expand(values, meta, n, m, in_features)
    return _expand_impl(values, meta, n, m, in_features, keep)


def expand_q(
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dequantized dense ``[out, in_features]`` weight in ``dtype``, a fresh tensor (check :func:`has_expand`)."""
    if torch.compiler.is_compiling():
        return torch.ops.hf_maskllm.sparse_expand_q(
            qvalues, scales, meta, n, m, bits, group_size, in_features, dtype
        )
    return _expand_q_impl(qvalues, scales, meta, n, m, bits, group_size, in_features, dtype)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, scales[:, None] * qweight, bias)`` for a dense layer of int8 codes ``qweight [out, in]``
    and float16 ``scales [out]``; no autograd. The output is in ``x``'s dtype (float32, bfloat16 or
    float16; accumulated in float32). Check :func:`has_kernel_int8` first."""
    if torch.compiler.is_compiling():
        return torch.ops.hf_maskllm.int8_linear(x, qweight, scales, bias)
    return _int8_linear_impl(x, qweight, scales, bias)
