"""The compressed N:M format: exact round trips, bit layout, sizes, validation, SparseLinear."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_maskllm.errors import CheckpointError, NMViolationError
from hf_maskllm.sparse import SparseLinear, compress, decompress, meta_bits, validate
from hf_maskllm.sparse.format import _pack_positions, unpack_positions

ALL_NM = [(n, m) for m in range(2, 9) for n in range(1, m)]


def random_nm(out: int, in_features: int, n: int, m: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """A weight where each group keeps a random number (0..n) of nonzeros at random positions."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.randn(out, in_features // m, m, generator=g)
    ranks = torch.rand(out, in_features // m, m, generator=g).argsort(dim=-1).argsort(dim=-1)
    keep = ranks < torch.randint(0, n + 1, (out, in_features // m, 1), generator=g)
    return (groups * keep).reshape(out, in_features).to(dtype)


def test_meta_bits():
    assert [meta_bits(m) for m in range(2, 9)] == [1, 2, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("n,m", ALL_NM)
@pytest.mark.parametrize("shape", [(3, 24), (5, 56), (1, 8)])
def test_round_trip_exact(n, m, shape):
    out, in_features = shape
    in_features = in_features // m * m or m
    w = random_nm(out, in_features, n, m, seed=n * 10 + m)
    values, meta = compress(w, n, m)
    kept = in_features * n // m
    assert values.shape == (out, kept) and values.dtype == w.dtype
    assert meta.shape == (out, -(-kept * meta_bits(m) // 8)) and meta.dtype == torch.uint8
    assert torch.equal(decompress(values, meta, n, m, in_features), w)
    validate(values, meta, n, m, in_features, out)


def test_padding_uses_lowest_unused_positions_and_bit_order():
    # 2:4 rows: group 0 keeps positions 1, 3; group 1 keeps only position 2 (padded with position 0);
    # group 2 is all zeros (padded with 0, 1).
    w = torch.tensor([[0.0, 5.0, 0.0, 7.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    values, meta = compress(w, 2, 4)
    assert values.tolist() == [[5.0, 7.0, 0.0, 9.0, 0.0, 0.0]]
    # positions 1,3,0,2,0,1 -> byte 0 = 1 | 3<<2 | 0<<4 | 2<<6, byte 1 = 0 | 1<<2
    assert meta.tolist() == [[1 | 3 << 2 | 0 << 4 | 2 << 6, 1 << 2]]
    # 3-bit positions for 2:8 cross byte boundaries: little-endian bitstream.
    w8 = torch.zeros(1, 16)
    w8[0, [5, 7, 8 + 2, 8 + 6]] = 1.0
    _, meta8 = compress(w8, 2, 8)
    stream = sum(p << (3 * j) for j, p in enumerate([5, 7, 2, 6]))
    assert meta8.tolist() == [[stream & 0xFF, (stream >> 8) & 0xFF]]
    assert unpack_positions(meta8, 8, 4).tolist() == [[5, 7, 2, 6]]


def test_violation_raises():
    w = torch.ones(2, 8)
    with pytest.raises(NMViolationError, match="more than 2 nonzeros"):
        compress(w, 2, 4)


def test_bf16_2_4_size_is_56_25_percent():
    w = random_nm(64, 128, 2, 4, dtype=torch.bfloat16)
    values, meta = compress(w, 2, 4)
    stored = values.numel() * values.element_size() + meta.numel() * meta.element_size()
    assert stored / (w.numel() * w.element_size()) == pytest.approx(0.5625)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 3), (3, 8)])
def test_validate_catches_corrupt_meta(n, m):
    w = random_nm(4, 8 * m, n, m)
    values, meta = compress(w, n, m)
    validate(values, meta, n, m, 8 * m, 4)
    pos = unpack_positions(meta, m, values.shape[1]).clone()
    if n > 1:  # reverse the first group's positions: no longer strictly increasing
        pos[0, :n] = torch.arange(n - 1, -1, -1, dtype=torch.uint8)
    else:  # m=3 stores 2-bit indices, so index 3 points past the group
        pos[0, 0] = m
    bad = _pack_positions(pos, meta_bits(m))
    with pytest.raises(CheckpointError, match="strictly increasing"):
        validate(values, bad, n, m, 8 * m, 4)
    with pytest.raises(CheckpointError, match="`meta` must be uint8"):
        validate(values, meta[:, :-1], n, m, 8 * m, 4)
    with pytest.raises(CheckpointError, match="`meta` must be uint8"):
        validate(values, meta.to(torch.int16), n, m, 8 * m, 4)
    with pytest.raises(CheckpointError, match="`values` must be"):
        validate(values[:1], meta, n, m, 8 * m, 4)


@pytest.mark.parametrize("n,m", [(2, 4), (3, 8)])
def test_sparse_linear_matches_dense(n, m):
    torch.manual_seed(0)
    linear = torch.nn.Linear(8 * m, 5)
    with torch.no_grad():
        linear.weight.copy_(random_nm(5, 8 * m, n, m, seed=1))
    sparse = SparseLinear.from_dense(linear, n, m)
    x = torch.randn(2, 3, 8 * m)
    torch.testing.assert_close(sparse(x), linear(x), rtol=0, atol=0)
    back = sparse.to_dense()
    assert torch.equal(back.weight, linear.weight) and torch.equal(back.bias, linear.bias)
    names = {k for k, _ in sparse.state_dict().items()}
    assert names == {"values", "meta", "bias"}


def test_all_candidates_2_4_round_trip():
    rows = [[float(i in keep) for i in range(4)] for keep in itertools.combinations(range(4), 2)]
    w = torch.tensor(rows).reshape(1, -1)
    values, meta = compress(w, 2, 4)
    assert torch.equal(decompress(values, meta, 2, 4, 24), w)
