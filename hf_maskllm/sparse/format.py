"""The compressed N:M weight format (version 1): the one place where its bit layout is defined.

An N:M-sparse linear weight ``W [out, in]`` (``in`` divisible by ``m``; every group of ``m``
consecutive inputs of a row keeps at most ``n`` nonzeros) is stored as two tensors:

- ``values [out, in*n//m]`` in the model's dtype: the kept values of each group in increasing
  position order. A group with fewer than ``n`` nonzeros is padded with zeros stored at its lowest
  unused positions, so every group stores exactly ``n`` positions.
- ``meta uint8 [out, ceil(in*n//m * b / 8)]`` with ``b = meta_bits(m) = ceil(log2(m))``: the
  position (``0..m-1``) of kept value ``j`` within its group sits at bits ``[j*b, (j+1)*b)`` of the
  row's little-endian bitstream (bit ``k`` of a row is bit ``k % 8`` of byte ``k // 8``). Unused
  trailing bits are zero. For 2:4: four positions per byte, value ``j`` at bits ``2*(j%4)`` of byte
  ``j//4``.

All functions are vectorised torch (no loops over rows) and run on any device.

The names a compressed checkpoint carries are defined here too, for its writer (``checkpoint.py``) and
its loader (``quantizer.py``): :data:`QUANT_METHOD` (``quantization_config.quant_method``),
:data:`LOAD_MARKER` (``config.json``'s ``transformers_weights``: plain transformers refuses the folder
and quotes it) and :data:`CHECKSUM_KEY` (every weight file's safetensors metadata).
"""

from __future__ import annotations

import math

import torch

from ..errors import CheckpointError, ConfigError, NMViolationError
from ..patterns import check_nm_args

__all__ = [
    "CHECKSUM_KEY",
    "FORMAT_VERSION",
    "LOAD_MARKER",
    "QUANT_METHOD",
    "compress",
    "compressed_shapes",
    "decompress",
    "kept_columns",
    "meta_bits",
    "unpack_positions",
    "validate",
]

FORMAT_VERSION = 1
QUANT_METHOD = "hf_maskllm_nm"
LOAD_MARKER = (
    "hf_maskllm-nm-compressed: this checkpoint stores N:M-compressed weights. "
    "Run `pip install hf_maskllm` and `import hf_maskllm` before from_pretrained to load it"
)
CHECKSUM_KEY = "hf_maskllm_crc32"  # safetensors metadata: JSON {tensor: CRC-32 of dtype, shape and bytes}


def meta_bits(m: int) -> int:
    """Bits per stored position: ``ceil(log2(m))`` (m=2 -> 1, m=3,4 -> 2, m=5..8 -> 3)."""
    if isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= 8:
        raise ConfigError(f"`m` must be an integer in [2, 8], got m={m!r}.")
    return max(1, math.ceil(math.log2(m)))


def compressed_shapes(
    out_features: int, in_features: int, n: int, m: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of ``values`` and ``meta`` for a ``[out_features, in_features]`` weight."""
    kept = in_features * n // m
    return (out_features, kept), (out_features, math.ceil(kept * meta_bits(m) / 8))


def _sum_last(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum over a short last dimension (at most 8): unrolled adds, much faster on CPU than ``sum(-1)``."""
    total = x[..., 0].to(dtype)
    for i in range(1, x.shape[-1]):
        total += x[..., i]
    return total


def _pack_positions(pos: torch.Tensor, b: int) -> torch.Tensor:
    """Pack ``pos [out, k]`` (values < 2**b) into the little-endian ``uint8 [out, ceil(k*b/8)]`` bitstream."""
    out, k = pos.shape
    nbytes = math.ceil(k * b / 8)
    pos = pos.to(torch.uint8)
    if 8 % b == 0:
        # b divides 8: per = 8 // b positions per byte, position j at bits b * (j % per) of byte j // per.
        per = 8 // b
        pos = torch.nn.functional.pad(pos, (0, nbytes * per - k))
        shifts = torch.arange(0, 8, b, device=pos.device, dtype=torch.uint8)
        return _sum_last(pos.view(out, nbytes, per) << shifts, torch.uint8)
    # General b: spell the bitstream out (bit t of position j is bit j*b + t), then pack bytes.
    bit_idx = torch.arange(b, device=pos.device, dtype=torch.uint8)
    bits = ((pos.unsqueeze(-1) >> bit_idx) & 1).reshape(out, k * b)
    bits = torch.nn.functional.pad(bits, (0, nbytes * 8 - k * b))
    byte_shifts = torch.arange(8, device=pos.device, dtype=torch.uint8)
    return _sum_last(bits.view(out, nbytes, 8) << byte_shifts, torch.uint8)


def unpack_positions(meta: torch.Tensor, m: int, kept: int) -> torch.Tensor:
    """Positions ``uint8 [out, kept]`` of every stored value, read from ``meta``."""
    b = meta_bits(m)
    out = meta.shape[0]
    mask = (1 << b) - 1
    if 8 % b == 0:
        shifts = torch.arange(0, 8, b, device=meta.device, dtype=torch.uint8)
        pos = (meta.unsqueeze(-1) >> shifts) & mask  # [out, nbytes, 8 // b]
        return pos.reshape(out, -1)[:, :kept]
    byte_shifts = torch.arange(8, device=meta.device, dtype=torch.uint8)
    bits = ((meta.unsqueeze(-1) >> byte_shifts) & 1).reshape(out, -1)[:, : kept * b]
    bit_idx = torch.arange(b, device=meta.device, dtype=torch.uint8)
    return _sum_last(bits.view(out, kept, b) << bit_idx, torch.uint8)


def kept_columns(meta: torch.Tensor, n: int, m: int, kept: int) -> torch.Tensor:
    """``int64 [out, kept]``: the dense input column of every stored value (``group * m + position``)."""
    pos = unpack_positions(meta, m, kept).long()
    return pos + torch.arange(kept, device=pos.device) // n * m


def compress(weight: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress an N:M-sparse ``weight [out, in]`` into ``(values, meta)``.

    Raises :class:`NMViolationError` if a group holds more than ``n`` nonzeros and
    :class:`ConfigError` for a bad shape or ``n, m``.
    """
    check_nm_args(n, m)
    if weight.dim() != 2 or weight.shape[1] % m:
        raise ConfigError(
            f"weight must be 2-D [out, in] with in divisible by m={m}, got {tuple(weight.shape)}."
        )
    out, in_features = weight.shape
    groups = weight.detach().reshape(out, in_features // m, m)  # [out, G, m]
    nonzero = groups != 0
    count = _sum_last(nonzero, torch.int8).unsqueeze(-1)
    bad = int((count > n).sum())
    if bad:
        raise NMViolationError(
            f"{bad} groups of {m} inputs hold more than {n} nonzeros, so the weight is not {n}:{m} sparse; "
            "apply the mask (merge it into the weights) before compressing."
        )
    # Keep every nonzero, then pad with the lowest-position zeros until the group holds exactly n.
    zero_rank = (~nonzero).cumsum(dim=-1, dtype=torch.int8)  # 1-based rank of each zero in its group
    selected = nonzero | (~nonzero & (zero_rank <= n - count))  # exactly n per group
    # Boolean indexing walks in row-major order, so positions come out increasing within each group.
    values = groups[selected].view(out, -1)
    pos = selected.nonzero()[:, -1].view(out, -1)
    meta = _pack_positions(pos, meta_bits(m)).contiguous()  # the CPU kernels read rows of bytes
    return values, meta


def decompress(values: torch.Tensor, meta: torch.Tensor, n: int, m: int, in_features: int) -> torch.Tensor:
    """Rebuild the dense ``[out, in_features]`` weight (dtype and device of ``values``)."""
    out, kept = values.shape
    pos = unpack_positions(meta, m, kept).long().view(out, in_features // m, n)
    dense = torch.zeros(out, in_features // m, m, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, pos, values.view(out, in_features // m, n))
    return dense.view(out, in_features)


def validate(
    values: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    in_features: int,
    out_features: int,
    name: str = "weight",
) -> None:
    """Raise :class:`CheckpointError` unless ``values`` / ``meta`` are a well-formed version-1 N:M pair."""
    where = f"compressed tensors of {name!r}"
    check_nm_args(n, m)
    if in_features % m:
        raise CheckpointError(f"{where}: in_features={in_features} is not divisible by m={m}.")
    (v_shape, m_shape) = compressed_shapes(out_features, in_features, n, m)
    if tuple(values.shape) != v_shape or not values.is_floating_point():
        raise CheckpointError(
            f"{where}: `values` must be a floating tensor of shape {list(v_shape)}, got {values.dtype} "
            f"{list(values.shape)}; the checkpoint is corrupt or was written for another model."
        )
    if tuple(meta.shape) != m_shape or meta.dtype != torch.uint8:
        raise CheckpointError(
            f"{where}: `meta` must be uint8 of shape {list(m_shape)}, got {meta.dtype} {list(meta.shape)}; "
            "the checkpoint is corrupt or was written for another model."
        )
    if values.device.type == "meta" or meta.device.type == "meta":
        raise CheckpointError(
            f"{where}: tensors were never loaded (still on the meta device); the file lacks them."
        )
    kept = v_shape[1]
    pos = unpack_positions(meta, m, kept).view(out_features, in_features // m, n)
    if bool((pos >= m).any()) or (n > 1 and bool((pos[..., 1:] <= pos[..., :-1]).any())):
        raise CheckpointError(
            f"{where}: `meta` holds positions that are >= m={m} or not strictly increasing within a group; "
            "the checkpoint is corrupt. Save it again with hf_maskllm.sparse.save_compressed."
        )
