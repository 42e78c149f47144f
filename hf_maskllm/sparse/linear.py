"""``SparseLinear``: a linear layer that holds its weight in the compressed N:M format."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TargetError
from ..modules import dense_weight_view
from ..patterns import check_nm_args
from .format import compress, compressed_shapes, decompress

__all__ = ["SparseLinear"]


@lru_cache(maxsize=1)
def _fast_kernel() -> Any:
    """``hf_maskllm.kernels.nm_linear`` when it can be imported (Triton present), else ``None``."""
    try:
        from ..kernels import nm_linear
    except ImportError:
        return None
    return nm_linear


class SparseLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept as N:M ``values`` + ``meta`` buffers (see :mod:`.format`).

    On CUDA the Triton kernel ``hf_maskllm.kernels.nm_linear`` is used when available; otherwise
    the weight is decompressed for each call (nothing is cached, so memory stays compressed).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        n: int = 2,
        m: int = 4,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_nm_args(n, m)
        if in_features % m:
            raise TargetError(
                f"in_features={in_features} is not divisible by m={m}; this layer cannot be N:M."
            )
        self.in_features, self.out_features, self.n, self.m = in_features, out_features, n, m
        v_shape, m_shape = compressed_shapes(out_features, in_features, n, m)
        self.register_buffer("values", torch.zeros(v_shape, device=device, dtype=dtype))
        self.register_buffer("meta", torch.zeros(m_shape, device=device, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.n}:{self.m}, bias={self.bias is not None}"

    def dense_weight(self) -> torch.Tensor:
        """The decompressed ``[out, in]`` weight."""
        return decompress(self.values, self.meta, self.n, self.m, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """A fresh dense ``[out, in]`` copy (read-only in effect: writing to it does not change the layer).

        Marked ``_is_hf_initialized`` so that model ``_init_weights`` code reaching for ``.weight``
        (e.g. GPT-2's scaled ``c_proj`` init) leaves it alone.
        """
        dense = self.dense_weight()
        dense._is_hf_initialized = True
        return dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (kernel := _fast_kernel()) is not None:
            return kernel(x, self.values, self.meta, self.n, self.m, self.in_features, self.bias)
        return F.linear(
            x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )

    @classmethod
    def from_dense(cls, linear: nn.Module, n: int = 2, m: int = 4) -> SparseLinear:
        """Compress an N:M ``nn.Linear`` / ``Conv1D`` (raises ``NMViolationError`` if it is not N:M)."""
        weight = dense_weight_view(linear)
        out_features, in_features = weight.shape
        bias = getattr(linear, "bias", None)
        layer = cls(in_features, out_features, n, m, bias is not None, device="meta", dtype=weight.dtype)
        values, meta = compress(weight, n, m)
        layer.values, layer.meta = values, meta
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return layer

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` holding the decompressed weight (same dtype and device)."""
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device="meta",
            dtype=self.values.dtype,
        )
        linear.weight = nn.Parameter(self.dense_weight())
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone())
        return linear
