"""The 2:4 word expansion of the Triton kernels (byte-permute selectors) on its own, run by the interpreter:
against the PTX instruction as its manual defines it, and against the compressed format bit for bit."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from hf_maskllm.kernels.expand import expand_24_words, prmt_selectors  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="kernel tests run the Triton interpreter on CPU"
)

# the six sorted position pairs (p0 < p1) a 2:4 group can have, as nibbles p0 | p1 << 2
NIBBLES = [p0 | p1 << 2 for p0 in range(4) for p1 in range(p0 + 1, 4)]


def prmt_spec(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` default mode, from the ISA manual: byte i of the result is byte
    ``sel[4i+2:4i]`` of the 8-byte value ``b:a``, sign-replicated when bit ``4i+3`` is set."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


@triton.jit
def _selectors_kernel(nib_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, prmt_selectors(tl.load(nib_ptr + offs)))


def test_prmt_selectors_rebuild_every_group_with_the_ptx_instruction():
    # the GPU path is `prmt(word, 0, sel)` / `prmt(word, 0, sel >> 16)`: the kernels' own selectors
    # (computed by the interpreter) against the instruction as the PTX manual defines it
    nibs = torch.tensor(NIBBLES + [0] * 2, dtype=torch.int32)
    selectors = torch.zeros(8, dtype=torch.int32)
    _selectors_kernel[(1,)](nibs, selectors, BLOCK=8)
    v0, v1 = 0xBEEF, 0x8001  # sign bits set: sign replication would show
    for nib, sel in zip(NIBBLES, selectors.tolist()):
        sel &= 0xFFFFFFFF
        assert all(((sel >> (4 * i)) & 0xF) <= 4 for i in range(8)), "selector nibbles must be 0..4"
        word = v0 | v1 << 16
        dense = prmt_spec(word, 0, sel & 0xFFFF) | prmt_spec(word, 0, sel >> 16) << 32
        want = [0, 0, 0, 0]
        want[nib & 3], want[nib >> 2] = v0, v1
        assert [(dense >> (16 * p)) & 0xFFFF for p in range(4)] == want, f"nibble {nib}"


@triton.jit
def _expand_kernel(words_ptr, nib_ptr, out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_N)[:, None]
    words = tl.load(words_ptr + rows * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)[None, :])
    nib = tl.load(nib_ptr + rows * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)[None, :])
    w = expand_24_words(words, nib, out_ptr.dtype.element_ty, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_expand_24_words_against_the_format(dtype):
    """Every position pair and random bit patterns: the dense tile is the format's, bit for bit."""
    g = torch.Generator().manual_seed(0)
    n_rows, groups = 6, 16
    # every nibble in every row; random 16-bit patterns for the values (negatives, subnormals, NaNs)
    nib = torch.tensor(NIBBLES * groups, dtype=torch.int32)[: n_rows * groups].reshape(n_rows, groups)
    nib = nib[:, torch.randperm(groups, generator=g)].contiguous()
    bits = torch.randint(-(2**15), 2**15, (n_rows, groups, 2), generator=g, dtype=torch.int16)
    values = bits.view(dtype).reshape(n_rows, 2 * groups)
    pad = 8 - n_rows  # BLOCK_N must be a power of two: pad the rows
    words = torch.cat([values.view(torch.int32), torch.zeros(pad, groups, dtype=torch.int32)])
    nibs = torch.cat([nib, torch.full((pad, groups), 4, dtype=torch.int32)])
    out = torch.full((8, 4 * groups), 7.0, dtype=dtype)  # poison
    _expand_kernel[(1,)](words, nibs, out, BLOCK_N=8, BLOCK_K=4 * groups)
    want = torch.zeros(n_rows, groups, 4, dtype=torch.int16)
    idx = torch.stack([nib & 3, nib >> 2], dim=-1).long()
    want.scatter_(-1, idx, bits)
    assert torch.equal(out[:n_rows].view(torch.int16).reshape(n_rows, groups, 4), want)
