"""Packing of hard masks as candidate indices in base ``C``: near the entropy bound.

A group's hard mask is one of ``C = C(m, n)`` candidates, so it carries ``log2(C)`` bits
(2.585 for 2:4, i.e. 0.646 bits per weight). ``k`` consecutive indices form one base-``C``
number ``sum_i idx_i * C**i`` (exact in int64), written with ``bits = bitlength(C**k - 1)`` bits
into a little-endian bitstream (bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``).
``k`` is chosen per ``C`` to minimise ``bits / k``: for 2:4, 17 groups in 44 bits = 0.647 bits
per weight.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from ..errors import MaskFileError

__all__ = ["bits_per_weight", "chunk_plan", "pack_indices", "packed_nbytes", "unpack_indices"]

_SLICE = 1 << 18  # chunks per slice: bounds temporary memory to a few tens of MB


@cache
def chunk_plan(num_candidates: int) -> tuple[int, int]:
    """``(k, bits)``: groups per chunk and bits per chunk, minimising ``bits / k`` with ``C**k < 2**62``."""
    if num_candidates < 2:
        raise MaskFileError(f"Cannot pack indices with {num_candidates} candidates; need at least 2.")
    best = None
    k = 1
    while num_candidates**k < 2**62:
        bits = (num_candidates**k - 1).bit_length()
        if best is None or bits * best[0] < best[1] * k:
            best = (k, bits)
        k += 1
    assert best is not None
    return best


def packed_nbytes(num_groups: int, num_candidates: int) -> int:
    """Bytes :func:`pack_indices` produces for ``num_groups`` indices."""
    k, bits = chunk_plan(num_candidates)
    return math.ceil(math.ceil(num_groups / k) * bits / 8)


def bits_per_weight(n: int, m: int, num_groups: int = 10**6) -> float:
    """Storage cost of a packed N:M mask in bits per masked weight."""
    return packed_nbytes(num_groups, math.comb(m, n)) * 8 / (num_groups * m)


def pack_indices(indices: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """Pack candidate indices ``[G]`` (values in ``[0, C)``) into a uint8 tensor."""
    k, bits = chunk_plan(num_candidates)
    idx = indices.detach().reshape(-1).to("cpu", torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_candidates):
        raise MaskFileError(f"Candidate indices must lie in [0, {num_candidates}).")
    chunks = -(-idx.numel() // k)
    idx = torch.cat([idx, idx.new_zeros(chunks * k - idx.numel())]).reshape(chunks, k)
    powers = torch.tensor([num_candidates**i for i in range(k)], dtype=torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64)
    bit_parts = []
    for start in range(0, chunks, _SLICE):
        values = (idx[start : start + _SLICE] * powers).sum(dim=1)  # [q] < C**k < 2**62
        bit_parts.append(((values[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1))
    stream = torch.cat(bit_parts) if bit_parts else torch.zeros(0, dtype=torch.uint8)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)]).reshape(-1, 8)
    return (stream << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def unpack_indices(packed: torch.Tensor, num_groups: int, num_candidates: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: int64 ``[num_groups]``; raises MaskFileError on corrupt data."""
    k, bits = chunk_plan(num_candidates)
    expected = packed_nbytes(num_groups, num_candidates)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
        raise MaskFileError(
            f"Packed mask is a {packed.dtype} tensor of shape {list(packed.shape)}, expected uint8 [{expected}] for "
            f"{num_groups} groups; the file is corrupt or belongs to another model. Save the mask again, or load "
            "it into the model it was learned on."
        )
    chunks = -(-num_groups // k)
    shifts = torch.arange(bits, dtype=torch.int64)
    byte_shifts = torch.arange(8, dtype=torch.uint8)
    limit = num_candidates**k
    out = []
    for start in range(0, chunks, _SLICE):
        stop = min(start + _SLICE, chunks)
        # bytes holding bits [start*bits, stop*bits) of the stream; expanded one slice at a time
        first_bit, last_bit = start * bits, stop * bits
        raw = packed[first_bit // 8 : -(-last_bit // 8)]
        stream = ((raw.reshape(-1, 1) >> byte_shifts) & 1).reshape(-1)
        offset = first_bit - (first_bit // 8) * 8
        stream = stream[offset : offset + last_bit - first_bit].reshape(stop - start, bits).to(torch.int64)
        values = (stream << shifts).sum(dim=1)
        if bool((values >= limit).any()):
            raise MaskFileError(
                f"Packed mask holds an out-of-range chunk (>= {num_candidates}**{k}): some group has no valid N:M "
                "candidate; the file is corrupt, save it again."
            )
        digits = torch.empty(values.shape[0], k, dtype=torch.int64)
        for i in range(k):
            digits[:, i] = values % num_candidates
            values = values // num_candidates
        out.append(digits.reshape(-1))
    result = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)
    if bool(result[num_groups:].any()):
        raise MaskFileError("Packed mask has nonzero padding; the file is corrupt, save it again.")
    return result[:num_groups]
