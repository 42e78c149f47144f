"""The compressed N:M weight format (versions 1 and 2): the one place where its bit layout is defined.

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

Version 2 stores the kept values quantized ("value type" ``int8`` or ``int4``, one type for every
compressed layer of a checkpoint), with the same ``meta``:

- ``qvalues``: ``int8 [out, kept]`` codes ``q`` in ``[-127, 127]`` for ``int8``; for ``int4``
  ``uint8 [out, kept // 2]``, kept value ``j`` in byte ``j // 2``, the low nibble for even ``j``, the
  high nibble for odd ``j``, nibble ``u = q + 8`` for a code ``q`` in ``[-8, 7]`` (offset binary).
- ``scales``: ``float16 [out, kept // group_size]``: kept value ``j`` of a row is
  ``float(scales[row, j // group_size]) * q``, computed in float32. ``group_size`` (kept values per
  scale, along the input dimension) divides ``kept`` and is even for ``int4``.

Float-valued checkpoints stay version 1. A version-2 checkpoint may also (or only) store its output
embedding as int8 rows with one float16 scale per row (``quantization_config.embedding = "int8"``; the
tensors are defined in :mod:`hf_maskllm.sparse.int8_embedding`).

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
from ..kernels.codes import dequantize_values
from ..kernels.codes import unpack_codes as _unpack_codes
from ..patterns import check_nm_args

__all__ = [
    "CHECKSUM_KEY",
    "FORMAT_VERSION",
    "LOAD_MARKER",
    "QUANTIZED_FORMAT_VERSION",
    "QUANT_METHOD",
    "VALUE_TYPES",
    "check_group_size",
    "compress",
    "compressed_shapes",
    "decompress",
    "dequantize",
    "dequantize_values",
    "kept_columns",
    "meta_bits",
    "pack_codes",
    "qmax",
    "quantized_shapes",
    "suggest_group_size",
    "unpack_codes",
    "unpack_positions",
    "validate",
    "validate_quantized",
    "value_bits",
]

FORMAT_VERSION = 1  # float kept values
QUANTIZED_FORMAT_VERSION = 2  # int8 / int4 kept values with float16 scales
VALUE_TYPES = ("int8", "int4")
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
    _validate_meta(meta, n, m, in_features, out_features, where, values)


def _validate_meta(
    meta: torch.Tensor, n: int, m: int, in_features: int, out_features: int, where: str, *loaded: torch.Tensor
) -> None:
    """Raise :class:`CheckpointError` unless ``meta`` has its shape and holds increasing positions below ``m``
    (and neither it nor any of ``loaded`` is still on the meta device)."""
    (_, kept), m_shape = compressed_shapes(out_features, in_features, n, m)
    if tuple(meta.shape) != m_shape or meta.dtype != torch.uint8:
        raise CheckpointError(
            f"{where}: `meta` must be uint8 of shape {list(m_shape)}, got {meta.dtype} {list(meta.shape)}; "
            "the checkpoint is corrupt or was written for another model."
        )
    if any(t.device.type == "meta" for t in (*loaded, meta)):
        raise CheckpointError(
            f"{where}: tensors were never loaded (still on the meta device); the file lacks them."
        )
    pos = unpack_positions(meta, m, kept).view(out_features, in_features // m, n)
    if bool((pos >= m).any()) or (n > 1 and bool((pos[..., 1:] <= pos[..., :-1]).any())):
        raise CheckpointError(
            f"{where}: `meta` holds positions that are >= m={m} or not strictly increasing within a group; "
            "the checkpoint is corrupt. Save it again with hf_maskllm.sparse.save_compressed."
        )


# ------------------------------------------------------------------------------------------- version 2
def value_bits(values: str) -> int:
    """Bits per stored code of a value type: ``"int8"`` -> 8, ``"int4"`` -> 4."""
    if values not in VALUE_TYPES:
        raise ConfigError(f"`values` must be one of {list(VALUE_TYPES)} (or None for float), got {values!r}.")
    return 8 if values == "int8" else 4


def qmax(bits: int) -> int:
    """The largest code round-to-nearest writes: 127 for 8 bits, 7 for 4 bits (int4 also allows -8)."""
    return (1 << (bits - 1)) - 1


def _check_bits(bits: int) -> None:
    if bits not in (8, 4):
        raise ConfigError(f"`bits` must be 8 or 4, got {bits!r}.")


def suggest_group_size(kept: list[int] | int, bits: int, wanted: int) -> int | None:
    """The largest group size ``<= wanted`` (else the smallest above it) that divides every ``kept`` and is
    even for 4 bits; ``None`` if there is none."""
    kept = [kept] if isinstance(kept, int) else list(kept)
    common = math.gcd(*kept) if kept else 0
    sizes = [d for d in range(1, common + 1) if common % d == 0 and (bits == 8 or d % 2 == 0)]
    if not sizes:
        return None
    below = [d for d in sizes if d <= wanted]
    return below[-1] if below else sizes[0]


def check_group_size(
    kept: int, bits: int, group_size: int, name: str = "weight", all_kept: list[int] | None = None
) -> None:
    """Raise :class:`ConfigError` unless ``group_size`` is a positive int dividing ``kept`` (even for 4 bits).

    The message names the layer and a group size that works for it (for every layer, with ``all_kept``).
    """
    _check_bits(bits)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"`group_size` must be a positive int (kept values per scale), got {group_size!r}.")
    if kept % group_size == 0 and (bits == 8 or group_size % 2 == 0):
        return
    works = suggest_group_size(all_kept or [kept], bits, group_size)
    fix = f"use group_size={works}" if works else "leave this layer out of `modules`, or store float values"
    why = (
        "is odd (int4 packs two codes per byte)"
        if kept % group_size == 0
        else f"does not divide its {kept} kept values per row"
    )
    raise ConfigError(f"group_size={group_size} {why} in layer {name!r}; {fix}.")


def quantized_shapes(
    out_features: int, in_features: int, n: int, m: int, bits: int, group_size: int
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Shapes of ``qvalues``, ``scales`` and ``meta`` for a ``[out_features, in_features]`` weight."""
    (_, kept), meta_shape = compressed_shapes(out_features, in_features, n, m)
    _check_bits(bits)
    return (out_features, kept if bits == 8 else kept // 2), (out_features, kept // group_size), meta_shape


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored ``qvalues`` of integer ``codes [out, kept]``: ``int8`` as they are (8 bits), or two
    offset-binary nibbles per ``uint8`` (4 bits: code ``j`` low for even ``j``, high for odd ``j``)."""
    _check_bits(bits)
    if bits == 8:
        return codes.to(torch.int8).contiguous()
    if codes.shape[-1] % 2:
        raise ConfigError(f"int4 codes need an even number of kept values per row, got {codes.shape[-1]}.")
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_codes(qvalues: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes ``int8 [out, kept]`` stored in ``qvalues`` (inverse of :func:`pack_codes`)."""
    _check_bits(bits)
    return _unpack_codes(qvalues, bits)


def dequantize(
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild the dense ``[out, in_features]`` weight of a version-2 layer in ``dtype``."""
    return decompress(dequantize_values(qvalues, scales, bits, group_size, dtype), meta, n, m, in_features)


def validate_quantized(
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    meta: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    group_size: int,
    in_features: int,
    out_features: int,
    name: str = "weight",
) -> None:
    """Raise :class:`CheckpointError` unless ``qvalues`` / ``scales`` / ``meta`` are a well-formed version-2 layer.

    Checks dtypes and shapes, finite scales, int8 codes in ``[-127, 127]`` and the positions in ``meta``.
    """
    where = f"compressed tensors of {name!r}"
    value_type = f"int{bits}"
    kept = in_features * n // m
    try:
        check_group_size(kept, bits, group_size, name)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e} The checkpoint is corrupt or config.json was edited.") from None
    q_shape, s_shape, _ = quantized_shapes(out_features, in_features, n, m, bits, group_size)
    q_dtype = torch.int8 if bits == 8 else torch.uint8
    if tuple(qvalues.shape) != q_shape or qvalues.dtype != q_dtype:
        raise CheckpointError(
            f"{where}: `qvalues` must be {q_dtype} of shape {list(q_shape)} for {value_type} values "
            f"(config.json quantization_config.values), got {qvalues.dtype} {list(qvalues.shape)}; the checkpoint "
            "is corrupt, or its config.json declares another value type than its tensors hold."
        )
    if tuple(scales.shape) != s_shape or scales.dtype != torch.float16:
        raise CheckpointError(
            f"{where}: `scales` must be float16 of shape {list(s_shape)} (one per {group_size} kept values), got "
            f"{scales.dtype} {list(scales.shape)}; the checkpoint is corrupt or config.json's group_size was edited."
        )
    _validate_meta(meta, n, m, in_features, out_features, where, qvalues, scales)
    if not bool(torch.isfinite(scales).all()):
        raise CheckpointError(
            f"{where}: `scales` holds NaN or inf; the checkpoint is corrupt. Save or download it again."
        )
    if bits == 8 and bool((qvalues == -128).any()):
        raise CheckpointError(
            f"{where}: `qvalues` holds the code -128, outside int8's [-127, 127]; the checkpoint is corrupt. "
            "Save it again with hf_maskllm.sparse.save_compressed."
        )
