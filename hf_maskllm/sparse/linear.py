"""``SparseLinear``: a linear layer that holds its weight in the compressed N:M format.

The kept weights ``values`` are the layer's trainable parameter (N:M by construction: the positions
in ``meta`` never change); ``meta`` is a buffer. Forward routes, in this order:

1. A gradient is needed for ``values`` (training the sparse weights): decompress (a differentiable
   scatter) and ``F.linear``; the gradient of ``values`` is the dense gradient at the kept positions.
2. ``cache_dense=True`` (opt-in): ``F.linear`` with a decompressed weight kept between calls (dense
   speed, one dense weight of memory per layer).
3. No gradient needed, and a kernel reads the compressed weight on this device
   (:mod:`hf_maskllm.kernels.route`, the one routing place): on CPU the C++ kernels for float32,
   bfloat16 and float16 outside autocast (direct for up to 8 tokens, expansion into a reused scratch
   buffer + dense GEMM beyond), on CUDA the Triton kernels for 2:4. No dense copy of the layer is held.
4. A gradient is needed for the input or the bias only (LoRA adapters, training something else), or
   autocast, or an input dtype other than the values': ``F.linear`` with a freshly expanded weight
   (the C++ expansion on CPU, the Triton one on CUDA), kept by autograd until the backward pass.
5. No kernel for this device and pattern (no Triton, or an N:M other than 2:4, on CUDA; the CPU
   kernels could not be built, which warns once; float64): the decompressed-weight cache as in 2,
   unless ``cache_dense=False``.

Under ``torch.compile`` routes 3 and 4 are registered torch ops (one opaque node each, no graph
break, no recompilation) and no cache is kept: ``cache_dense=True`` takes route 3 where a kernel
exists, and route 5 decompresses inside the compiled graph.

The cache is keyed on the storage and version counter of ``values`` and ``meta`` (in-place updates
by optimizers, ``load_state_dict`` or ``copy_`` invalidate it) and dropped on ``train()`` /
``eval()`` / ``.to()``. Writes through ``.data`` bypass version counters: call :meth:`clear_cache`
after them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TargetError
from ..kernels.route import expand, has_expand, has_kernel, sparse_linear
from ..modules import dense_weight_view, is_conv1d
from ..patterns import check_nm_args
from .format import compress, compressed_shapes, decompress, kept_columns

__all__ = ["SparseLinear", "dense_layer", "set_dense_cache", "sparse_layer_names", "to_dense_layers"]


def _cast(bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if bias is None else bias.to(x.dtype)


class SparseLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept as N:M ``values`` (a parameter) + ``meta`` (a buffer).

    Args:
        in_features, out_features: the dense shape of ``W``.
        n, m: the pattern (``n`` kept of every ``m`` consecutive inputs).
        bias: whether the layer has a bias.
        conv1d: the layer replaces a transformers GPT-2 ``Conv1D`` (weight stored ``[in, out]``);
            :meth:`to_dense` then rebuilds a ``Conv1D``.

    Attributes:
        cache_dense: ``None`` (default): keep a decompressed weight between calls only where no kernel
            reads the compressed weight on the layer's device; ``True``: always keep it when no
            gradient is needed for ``values`` (dense speed, one dense weight of memory per layer);
            ``False``: never (decompress per call where no kernel exists).
    """

    cache_dense: bool | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        n: int = 2,
        m: int = 4,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        conv1d: bool = False,
    ) -> None:
        super().__init__()
        check_nm_args(n, m)
        if in_features % m:
            raise TargetError(
                f"in_features={in_features} is not divisible by m={m}; this layer cannot be N:M."
            )
        self.in_features, self.out_features, self.n, self.m = in_features, out_features, n, m
        self.conv1d = conv1d
        v_shape, m_shape = compressed_shapes(out_features, in_features, n, m)
        self.values = nn.Parameter(torch.zeros(v_shape, device=device, dtype=dtype))
        self.register_buffer("meta", torch.zeros(m_shape, device=device, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self._cache: torch.Tensor | None = None
        self._cache_key: tuple | None = None

    def extra_repr(self) -> str:
        # the last part is what PEFT's "Target module ... is not supported" shows of this layer: the fix
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.n}:{self.m}, "
            f"bias={self.bias is not None}, PEFT LoRA needs its LoraConfig through "
            "hf_maskllm.sparse.register_lora(config)"
        )

    # ------------------------------------------------------------------ the dense weight
    def dense_weight(self) -> torch.Tensor:
        """The decompressed ``[out, in]`` weight (differentiable with respect to ``values``)."""
        return decompress(self.values, self.meta, self.n, self.m, self.in_features)

    def kept_columns(self) -> torch.Tensor:
        """``int64 [out, kept]``: the dense input column of every entry of ``values``."""
        return kept_columns(self.meta, self.n, self.m, self.values.shape[1])

    def keep_mask(self) -> torch.Tensor:
        """The bool keep-mask ``[out, in]`` (the stored positions)."""
        mask = torch.zeros(self.out_features, self.in_features, dtype=torch.bool, device=self.meta.device)
        return mask.scatter_(1, self.kept_columns(), True)

    def _key(self) -> tuple:
        v, meta = self.values, self.meta
        return (v.data_ptr(), v._version, v.dtype, v.device, meta.data_ptr(), meta._version)

    def cached_dense_weight(self) -> torch.Tensor:
        """The decompressed weight, detached, kept until ``values`` or ``meta`` change."""
        key = self._key()
        if self._cache is None or self._cache_key != key:
            self._cache = None  # free the stale copy before building the new one
            with torch.no_grad():
                self._cache = self.dense_weight()
            self._cache_key = key
        return self._cache

    def clear_cache(self) -> None:
        """Drop the cached dense weight (needed only after writing ``values`` through ``.data``)."""
        self._cache, self._cache_key = None, None

    def train(self, mode: bool = True) -> SparseLinear:
        self.clear_cache()
        return super().train(mode)

    def _apply(self, fn: Any, recurse: bool = True) -> SparseLinear:
        self.clear_cache()
        return super()._apply(fn, recurse)

    @property
    def weight(self) -> torch.Tensor:
        """A fresh, detached dense ``[out, in]`` copy (writing to it does not change the layer).

        To change the weights, update ``values`` (kept positions only). Marked
        ``_is_hf_initialized`` so that model ``_init_weights`` code reaching for ``.weight`` (e.g.
        GPT-2's scaled ``c_proj`` init) leaves it alone.
        """
        with torch.no_grad():
            dense = self.dense_weight()
        dense._is_hf_initialized = True
        return dense

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, bias = self.values, self.bias
        grad = torch.is_grad_enabled()
        if grad and values.requires_grad:  # 1. training the sparse weights themselves
            return F.linear(x, self.dense_weight().to(x.dtype), _cast(bias, x))
        cache = self.cache_dense
        compiling = torch.compiler.is_compiling()  # compiled code holds no cache: it reads the kernels
        if cache and not compiling:  # 2. the opt-in dense cache
            return F.linear(x, self.cached_dense_weight().to(x.dtype), _cast(bias, x))
        wants_grad = grad and (x.requires_grad or (bias is not None and bias.requires_grad))
        # 3. a kernel reads the compressed weight
        if not wants_grad and has_kernel(x, values, self.n, self.m):
            return sparse_linear(x, values, self.meta, self.n, self.m, self.in_features, bias)
        # 4. a gradient for the input or bias only (LoRA), or autocast: a freshly expanded weight
        if has_expand(values, values.dtype, self.n, self.m):
            weight = expand(values, self.meta, self.n, self.m, self.in_features, keep=wants_grad)
            return F.linear(x, weight.to(x.dtype), _cast(bias, x))
        # 5. no kernel for this device, pattern or dtype
        weight = self.dense_weight() if cache is False or compiling else self.cached_dense_weight()
        return F.linear(x, weight.to(x.dtype), _cast(bias, x))

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_dense(cls, linear: nn.Module, n: int = 2, m: int = 4) -> SparseLinear:
        """Compress an N:M ``nn.Linear`` / ``Conv1D`` (raises ``NMViolationError`` if it is not N:M).

        ``values`` keeps the ``requires_grad`` of the dense weight.
        """
        weight = dense_weight_view(linear)
        out_features, in_features = weight.shape
        bias = getattr(linear, "bias", None)
        layer = cls(
            in_features, out_features, n, m, bias is not None, "meta", weight.dtype, conv1d=is_conv1d(linear)
        )
        values, meta = compress(weight, n, m)
        layer.values = nn.Parameter(values, requires_grad=weight.requires_grad)
        layer.meta = meta
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return layer

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """The dense layer (``nn.Linear``, or ``Conv1D`` if it replaced one) holding the decompressed weight."""
        return dense_layer(self.dense_weight(), self.bias, self.conv1d)


@torch.no_grad()
def dense_layer(weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool = False) -> nn.Module:
    """An ``nn.Linear`` (or a transformers ``Conv1D``) holding ``weight [out, in]`` and a copy of ``bias``."""
    out_features, in_features = weight.shape
    if conv1d:
        from transformers.pytorch_utils import Conv1D

        layer = Conv1D(out_features, in_features)
        layer.weight = nn.Parameter(weight.t().contiguous())
        layer.bias = nn.Parameter(
            bias.detach().clone()
            if bias is not None
            else torch.zeros(out_features, dtype=weight.dtype, device=weight.device)
        )
        return layer
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear


def set_dense_cache(model: nn.Module, enabled: bool | None) -> int:
    """Set ``cache_dense`` of every :class:`SparseLinear` in ``model`` (see the class).

    ``True`` keeps a decompressed weight per layer (dense speed and memory), ``False`` never does,
    ``None`` (the default) keeps one only where no kernel reads the compressed weight on the device.
    Returns the number of layers changed.
    """
    layers = [mod for mod in model.modules() if isinstance(mod, SparseLinear)]
    for layer in layers:
        layer.cache_dense = None if enabled is None else bool(enabled)
        layer.clear_cache()
    return len(layers)


def sparse_layer_names(model: nn.Module) -> list[str]:
    """Names of the :class:`SparseLinear` modules of ``model``, in model order."""
    return [name for name, mod in model.named_modules() if isinstance(mod, SparseLinear)]


def to_dense_layers(model: nn.Module) -> nn.Module:
    """Replace every :class:`SparseLinear` by its dense layer (zeros kept), in place; returns ``model``.

    A transformers model loaded compressed (or made so by ``to_sparse_layers``) becomes a plain
    transformers model with ``model.dequantize()``, which calls this and also drops the quantization
    config.
    """
    for name in sparse_layer_names(model):
        model.set_submodule(name, model.get_submodule(name).to_dense())
    return model
