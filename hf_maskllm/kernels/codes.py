"""How int8 / int4 kept values are stored as codes, read back in torch (the C++ kernels read the same form).

``qvalues`` of a layer with ``kept`` kept values per row: int8 codes ``int8 [out, kept]``; int4 codes
``uint8 [out, kept // 2]``, kept value ``j`` in byte ``j // 2`` (low nibble for even ``j``, high nibble
for odd ``j``), nibble ``u`` meaning code ``u - 8``. Kept value ``j`` of row ``r`` is
``float(scales[r, j // group_size]) * code``, computed in float32. The compressed format
(``hf_maskllm.sparse.format``) re-exports these; the CUDA route dequantizes with them.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_values", "unpack_codes"]


def unpack_codes(qvalues: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes ``int8 [out, kept]`` stored in ``qvalues`` (``bits`` 8 or 4)."""
    if bits == 8:
        return qvalues.to(torch.int8)
    low = (qvalues & 0x0F).to(torch.int8) - 8
    high = (qvalues >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*qvalues.shape[:-1], qvalues.shape[-1] * 2)


def dequantize_values(
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The kept values ``[out, kept]``: ``float(scales[row, j // group_size]) * q`` in float32, then ``dtype``."""
    codes = unpack_codes(qvalues, bits).to(torch.float32)
    out, kept = codes.shape
    grouped = codes.view(out, kept // group_size, group_size) * scales.to(torch.float32).unsqueeze(-1)
    return grouped.view(out, kept).to(dtype)
