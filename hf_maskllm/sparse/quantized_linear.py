"""``QuantizedSparseLinear``: a linear layer holding its N:M weight with int8 / int4 kept values (format version 2).

Buffers ``qvalues`` (the codes), ``scales`` (float16, one per ``group_size`` kept values of a row) and
``meta`` (the positions, as in version 1) are laid out as :mod:`hf_maskllm.sparse.format` defines them;
the optional ``bias`` is a parameter in the model's float dtype. No float copy of the weight is held.
The weights do not train (the codes are integers); the bias and LoRA adapters of other layers can.

``.to(dtype)`` / ``.half()`` on the model change the bias and the dtype :meth:`dense_weight` returns,
never the float16 ``scales`` (the format's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TargetError
from ..kernels.route import expand_q, has_expand, has_kernel_q, sparse_linear_q
from ..patterns import check_nm_args
from .format import (
    check_group_size,
    compressed_shapes,
    dequantize,
    kept_columns,
    quantized_shapes,
    unpack_codes,
)
from .linear import dense_layer

__all__ = ["QuantizedSparseLinear", "quantized_layer_names"]


class QuantizedSparseLinear(nn.Module):
    """``y = x @ dequant(W).T + b`` with ``W`` kept as N:M ``qvalues`` + ``scales`` + ``meta`` buffers.

    Args:
        in_features, out_features: the dense shape of ``W``.
        n, m: the pattern (``n`` kept of every ``m`` consecutive inputs).
        bits: 8 (``int8`` codes) or 4 (``int4``, two codes per byte).
        group_size: kept values per scale along the input dimension (divides ``in_features * n // m``;
            even for 4 bits).
        bias: whether the layer has a bias.
        dtype: the model's float dtype: the bias's and the one :meth:`dense_weight` returns.
        conv1d: the layer replaces a transformers GPT-2 ``Conv1D``; :meth:`to_dense` then rebuilds one.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        n: int = 2,
        m: int = 4,
        bits: int = 8,
        group_size: int = 32,
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
        (_, kept), _ = compressed_shapes(out_features, in_features, n, m)
        check_group_size(kept, bits, group_size)
        self.in_features, self.out_features, self.n, self.m = in_features, out_features, n, m
        self.bits, self.group_size, self.conv1d = bits, group_size, conv1d
        self.weight_dtype = dtype or torch.get_default_dtype()
        q_shape, s_shape, m_shape = quantized_shapes(out_features, in_features, n, m, bits, group_size)
        q_dtype = torch.int8 if bits == 8 else torch.uint8
        self.register_buffer("qvalues", torch.zeros(q_shape, device=device, dtype=q_dtype))
        self.register_buffer("scales", torch.zeros(s_shape, device=device, dtype=torch.float16))
        self.register_buffer("meta", torch.zeros(m_shape, device=device, dtype=torch.uint8))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=self.weight_dtype)) if bias else None
        )

    @property
    def value_type(self) -> str:
        """``"int8"`` or ``"int4"``: the format's name of the stored codes."""
        return f"int{self.bits}"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.n}:{self.m}, "
            f"{self.value_type}, group_size={self.group_size}, bias={self.bias is not None}, PEFT LoRA needs its "
            "LoraConfig through hf_maskllm.sparse.register_lora(config)"
        )

    # ------------------------------------------------------------------ the dense weight
    @torch.no_grad()
    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight (scale times code in float32, then ``dtype``, by default the
        model's float dtype)."""
        return dequantize(
            self.qvalues,
            self.scales,
            self.meta,
            self.n,
            self.m,
            self.bits,
            self.group_size,
            self.in_features,
            dtype or self.weight_dtype,
        )

    def codes(self) -> torch.Tensor:
        """The integer codes ``int8 [out, kept]`` (int4 unpacked)."""
        return unpack_codes(self.qvalues, self.bits)

    def kept_columns(self) -> torch.Tensor:
        """``int64 [out, kept]``: the dense input column of every kept value."""
        return kept_columns(self.meta, self.n, self.m, self.in_features * self.n // self.m)

    def keep_mask(self) -> torch.Tensor:
        """The bool keep-mask ``[out, in]`` (the stored positions)."""
        mask = torch.zeros(self.out_features, self.in_features, dtype=torch.bool, device=self.meta.device)
        return mask.scatter_(1, self.kept_columns(), True)

    @property
    def weight(self) -> torch.Tensor:
        """A fresh, detached dense ``[out, in]`` copy (writing to it does not change the layer).

        Marked ``_is_hf_initialized`` so that model ``_init_weights`` code reaching for ``.weight``
        leaves it alone.
        """
        dense = self.dense_weight()
        dense._is_hf_initialized = True
        return dense

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedSparseLinear:
        # The scales stay float16 (the format's dtype): they follow device moves, never dtype casts.
        scales = self._buffers.pop("scales")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["scales"] = scales
        moved = fn(scales)
        self._buffers["scales"] = moved if moved.dtype == torch.float16 else scales.to(moved.device)
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=scales.device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return self

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        needs_bias_grad = bias is not None and bias.requires_grad
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or needs_bias_grad)
        if not wants_grad and has_kernel_q(x, self.qvalues, self.n, self.m):  # a kernel reads the codes
            return sparse_linear_q(
                x, self.qvalues, self.scales, self.meta, self.n, self.m, self.bits, self.group_size,
                self.in_features, bias,
            )  # fmt: skip
        bias = None if bias is None else bias.to(x.dtype)
        # a gradient for the input or bias (LoRA), or autocast: a freshly dequantized dense weight
        if has_expand(self.qvalues, x.dtype, self.n, self.m):
            weight = expand_q(
                self.qvalues, self.scales, self.meta, self.n, self.m, self.bits, self.group_size,
                self.in_features, x.dtype,
            )  # fmt: skip
            return F.linear(x, weight, bias)
        return F.linear(x, self.dense_weight(x.dtype), bias)  # no kernel for this device or pattern

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_tensors(
        cls,
        qvalues: torch.Tensor,
        scales: torch.Tensor,
        meta: torch.Tensor,
        in_features: int,
        n: int,
        m: int,
        bits: int,
        group_size: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        conv1d: bool = False,
    ) -> QuantizedSparseLinear:
        """A layer holding the given version-2 tensors (not copied); ``dtype``: the model's float dtype
        (default: the bias's, else float32)."""
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        layer = cls(
            in_features, qvalues.shape[0], n, m, bits, group_size, bias is not None, "meta", dtype, conv1d
        )
        layer.qvalues, layer.scales, layer.meta = qvalues, scales, meta
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone().to(dtype), requires_grad=bias.requires_grad)
        return layer

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """The dense layer (``nn.Linear``, or ``Conv1D`` if it replaced one) holding the dequantized weight."""
        return dense_layer(self.dense_weight(), self.bias, self.conv1d)


def quantized_layer_names(model: nn.Module) -> list[str]:
    """Names of the :class:`QuantizedSparseLinear` modules of ``model``, in model order."""
    return [name for name, mod in model.named_modules() if isinstance(mod, QuantizedSparseLinear)]
