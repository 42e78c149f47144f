"""Base-C packing of hard-mask candidate indices: round trips, size, and corrupt input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_maskllm.adapters.packing import (
    bits_per_weight,
    chunk_plan,
    pack_indices,
    packed_nbytes,
    unpack_indices,
)
from hf_maskllm.errors import MaskFileError

NM_PAIRS = [(n, m) for m in range(2, 9) for n in range(1, m)]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_pack_unpack_round_trip(data):
    n, m = data.draw(st.sampled_from(NM_PAIRS), label="n, m")
    c = math.comb(m, n)
    groups = data.draw(st.integers(min_value=0, max_value=200), label="groups")
    values = data.draw(st.lists(st.integers(0, c - 1), min_size=groups, max_size=groups), label="indices")
    idx = torch.tensor(values, dtype=torch.int64)
    packed = pack_indices(idx, c)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == packed_nbytes(groups, c)
    assert torch.equal(unpack_indices(packed, groups, c), idx)


@pytest.mark.parametrize(("n", "m"), NM_PAIRS)
def test_round_trip_of_extreme_indices_every_nm(n, m):
    c = math.comb(m, n)
    k, _ = chunk_plan(c)
    groups = 3 * k + 1  # several full chunks and a partial one
    for idx in (
        torch.full((groups,), c - 1),  # largest chunk values
        torch.zeros(groups, dtype=torch.int64),
        torch.arange(groups) % c,
    ):
        assert torch.equal(unpack_indices(pack_indices(idx, c), groups, c), idx)
    # uint8 input (what hard_indices returns) packs the same as int64
    idx = torch.arange(groups) % c
    assert torch.equal(pack_indices(idx.to(torch.uint8), c), pack_indices(idx, c))


def test_2_4_costs_under_0_65_bits_per_weight():
    assert chunk_plan(6) == (17, 44)
    assert bits_per_weight(2, 4) == pytest.approx(44 / 17 / 4, rel=1e-4)
    assert math.log2(6) / 4 <= bits_per_weight(2, 4) < 0.648
    # exact size for a 4096 x 4096 layer: 4,194,304 groups -> ceil(/17) chunks of 44 bits
    groups = 4096 * 4096 // 4
    assert packed_nbytes(groups, 6) == math.ceil(math.ceil(groups / 17) * 44 / 8)


@pytest.mark.parametrize(("n", "m"), NM_PAIRS)
def test_every_nm_is_within_half_a_percent_of_the_entropy_bound(n, m):
    bound = math.log2(math.comb(m, n)) / m
    assert bound <= bits_per_weight(n, m) <= bound * 1.005 + 1e-9


def test_large_input_crosses_slices():
    from hf_maskllm.adapters import packing

    c = 6
    k, _ = chunk_plan(c)
    groups = (packing._SLICE + 3) * k + 5  # more chunks than one slice
    idx = torch.randint(0, c, (groups,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_indices(pack_indices(idx, c), groups, c), idx)


# ---------------------------------------------------------------------------------------------- corrupt data
def test_out_of_range_indices_refused():
    with pytest.raises(MaskFileError, match=r"\[0, 6\)"):
        pack_indices(torch.tensor([0, 6]), 6)
    with pytest.raises(MaskFileError):
        pack_indices(torch.tensor([-1, 0]), 6)
    with pytest.raises(MaskFileError):
        chunk_plan(1)


def test_wrong_length_or_dtype_refused():
    idx = torch.arange(40) % 6
    packed = pack_indices(idx, 6)
    with pytest.raises(MaskFileError, match="expected"):
        unpack_indices(packed[:-1], 40, 6)
    with pytest.raises(MaskFileError, match="expected"):
        unpack_indices(torch.cat([packed, packed[:1]]), 40, 6)
    with pytest.raises(MaskFileError, match="uint8"):
        unpack_indices(packed.to(torch.int16), 40, 6)
    with pytest.raises(MaskFileError):
        unpack_indices(packed, 41 + 17, 6)  # another layer size


def test_out_of_range_chunk_detected():
    # 17 groups of 2:4 use 44 bits; all ones is 2**44 - 1 >= 6**17: no valid mask has it
    packed = torch.full((packed_nbytes(17, 6),), 0xFF, dtype=torch.uint8)
    with pytest.raises(MaskFileError, match="out-of-range"):
        unpack_indices(packed, 17, 6)


def test_nonzero_padding_detected():
    c, (k, _) = 6, chunk_plan(6)
    groups = k + 3  # the last chunk holds 3 real groups and k - 3 padding digits
    packed = pack_indices(torch.zeros(groups, dtype=torch.int64), c)
    assert torch.equal(unpack_indices(packed, groups, c), torch.zeros(groups, dtype=torch.int64))
    # digit 3 of chunk 2 (a padding group) = 1: add 6**3 to the second chunk's value
    tampered = pack_indices(torch.cat([torch.zeros(k + 3, dtype=torch.int64), torch.tensor([1])]), c)
    with pytest.raises(MaskFileError, match="padding"):
        unpack_indices(tampered, groups, c)
