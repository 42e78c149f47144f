"""Where a compressed 2:4 tile becomes dense, in registers (shared by the three kernels).

Format (see ``hf_maskllm.sparse.format``): ``values [out, in/2]`` holds the 2 kept weights of every
group of 4 inputs in increasing position order; ``meta uint8 [out, in/8]`` holds their positions,
2 bits each: byte ``b`` of a row covers groups ``2b`` (low nibble) and ``2b + 1`` (high nibble); in a
nibble, bits 0-1 are the position ``p0`` of the first kept value, bits 2-3 the position ``p1 > p0``
of the second.

Two expansions:

- :func:`expand_24` works on any dtype with compares and selects (fp32 weights; the reference).
- :func:`expand_24_words` is the fast one for 16-bit weights. A group's two kept values are one
  32-bit word ``v0 | v1 << 16``; its dense form is two words, ``w0 | w1 << 16`` and ``w2 | w3 << 16``,
  and each is one byte permute of the kept word with zeros (PTX ``prmt``) under a selector computed
  from the nibble with a few integer ops. In the decode loop this about halved the sm_90a
  instructions per group against the compare-and-select form (counted while developing it with the
  code of ``benchmarks/kernel_sass.py``), which matters because batch-1 decode has only ~35
  instruction slots per compressed group before it stops being memory-bound.
  The interpreter (CPU) has no inline PTX: there ``prmt`` is emulated with shifts and masks, so the
  selector arithmetic is what the CPU tests check.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["INTERPRET", "expand_24", "expand_24_words", "load_weight_tile", "prmt_selectors"]

# The interpreter (CPU) cannot autotune over several configs, run inline PTX, or do bf16 arithmetic.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_EMULATE_PRMT = tl.constexpr(INTERPRET)  # a global that @jit code may read


@triton.jit
def expand_24(v, meta, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expand a compressed 2:4 tile to dense, with compares and selects (any dtype).

    v: ``[BLOCK_N, BLOCK_K // 2]`` kept values; meta: ``[BLOCK_N, BLOCK_K // 8]`` meta bytes.
    Returns the dense ``[BLOCK_N, BLOCK_K]`` tile in ``v``'s dtype (zeros where pruned).
    """
    BLOCK_G: tl.constexpr = BLOCK_K // 4
    # ---- kept values of each group: v0 = first kept, v1 = second kept, [BLOCK_N, BLOCK_G] each
    v0, v1 = tl.split(tl.reshape(v, (BLOCK_N, BLOCK_G, 2)))
    # ---- one nibble per group: group 2b is the low nibble of byte b, group 2b+1 the high one
    meta = meta.to(tl.int32)
    nib = tl.reshape(tl.join(meta & 0xF, (meta >> 4) & 0xF), (BLOCK_N, BLOCK_G))
    p0 = nib & 3  # position (0..2) of v0 inside its group
    p1 = nib >> 2  # position (1..3) of v1 inside its group (p1 > p0)
    # ---- dense column p of each group: w_p = v0 if p0 == p else (v1 if p1 == p else 0)
    zero = tl.zeros_like(v0)
    w0 = tl.where(p0 == 0, v0, zero)
    w1 = tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, zero))
    w2 = tl.where(p0 == 2, v0, tl.where(p1 == 2, v1, zero))
    w3 = tl.where(p1 == 3, v1, zero)
    # ---- interleave: join(join(w0, w2), join(w1, w3))[g, q, r] = w_{2q + r}  -> [BLOCK_N, BLOCK_K]
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_K))


@triton.jit
def prmt_selectors(nib):
    """``prmt`` selector of a group's dense word pair from its nibble (int32 in, int32 out).

    Byte ``2p`` / ``2p + 1`` of the dense group (low / high byte of ``w_p``) take byte 0 / 1 of the
    kept word when ``p == p0``, byte 2 / 3 when ``p == p1``, and byte 4 (of the zero word) otherwise:
    selector byte ``p`` is ``0x10``, ``0x32`` or ``0x44``, i.e. ``0x44444444 - (0x34 << 8 p0) -
    (0x12 << 8 p1)`` with no borrow. The low 16 bits select the low dense word, the high 16 the high.
    """
    return 0x44444444 - (0x34 << ((nib & 3) << 3)) - (0x12 << ((nib >> 2) << 3))


@triton.jit
def _prmt_emulated(word, sel):
    """PTX ``prmt.b32 d, word, 0, sel`` (default mode) for selectors whose nibbles are 0..4."""
    out = tl.zeros_like(word)
    for i in tl.static_range(4):
        idx = (sel >> (4 * i)) & 7
        byte = tl.where(idx < 4, (word >> (idx * 8)) & 0xFF, 0)
        out = out | (byte << (8 * i))
    return out


@triton.jit
def expand_24_words(words, nib, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expand 16-bit 2:4 groups given as kept-value words (see the module docstring).

    words: int32 ``[BLOCK_N, BLOCK_K // 4]``, ``v0 | v1 << 16`` per group (the values row viewed as
    int32); nib: int32 ``[BLOCK_N, BLOCK_K // 4]``, ``p0 | p1 << 2`` per group. Returns the dense
    ``[BLOCK_N, BLOCK_K]`` tile in ``dtype`` (float16 or bfloat16).
    """
    sel = prmt_selectors(nib)
    if _EMULATE_PRMT:
        lo = _prmt_emulated(words, sel)
        hi = _prmt_emulated(words, sel >> 16)
        w0 = lo.to(tl.int16)  # int32 -> int16 keeps the low 16 bits
        w1 = (lo >> 16).to(tl.int16)
        w2 = hi.to(tl.int16)
        w3 = (hi >> 16).to(tl.int16)
    else:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, s;
            prmt.b32 lo, $4, 0, $5;
            shr.u32 s, $5, 16;
            prmt.b32 hi, $4, 0, s;
            mov.b32 {$0, $1}, lo;
            mov.b32 {$2, $3}, hi;
            }""",
            constraints="=h,=h,=h,=h,r,r",
            args=[words, sel],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16),
            is_pure=True,
            pack=1,
        )
    w0 = w0.to(dtype, bitcast=True)
    w1 = w1.to(dtype, bitcast=True)
    w2 = w2.to(dtype, bitcast=True)
    w3 = w3.to(dtype, bitcast=True)
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_N, BLOCK_K))


@triton.jit
def load_weight_tile(
    v_rows,
    m_rows,
    mask_n,
    k0,
    in_features,
    dtype: tl.constexpr,
    WORDS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Load the compressed weight tile of dense columns ``[k0, k0 + BLOCK_K)`` and expand it.

    v_rows / m_rows: ``[BLOCK_N, 1]`` pointers to the first value (word when ``WORDS``) and the first
    meta byte of each row; mask_n: ``[BLOCK_N]`` rows in range. ``EVEN_K``: the tile is inside K, no
    column masks. Returns the dense ``[BLOCK_N, BLOCK_K]`` tile in ``dtype`` (zeros outside).
    """
    BLOCK_G: tl.constexpr = BLOCK_K // 4
    offs_b = k0 // 8 + tl.arange(0, BLOCK_G // 2)  # meta bytes: 2 groups each
    if EVEN_K:
        mb = tl.load(m_rows + offs_b[None, :], mask=mask_n[:, None], other=0)
    else:
        mb = tl.load(
            m_rows + offs_b[None, :],
            mask=mask_n[:, None] & (offs_b < (in_features + 7) // 8)[None, :],
            other=0,
        )
    if WORDS:
        offs_g = k0 // 4 + tl.arange(0, BLOCK_G)  # one word per group
        if EVEN_K:
            words = tl.load(v_rows + offs_g[None, :], mask=mask_n[:, None], other=0)
        else:
            words = tl.load(
                v_rows + offs_g[None, :], mask=mask_n[:, None] & (offs_g < in_features // 4)[None, :], other=0
            )
        mb = mb.to(tl.int32)
        nib = tl.reshape(tl.join(mb & 0xF, (mb >> 4) & 0xF), (BLOCK_N, BLOCK_G))
        return expand_24_words(words, nib, dtype, BLOCK_N, BLOCK_K)
    else:
        offs_kc = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # two kept values per group
        if EVEN_K:
            v = tl.load(v_rows + offs_kc[None, :], mask=mask_n[:, None], other=0.0)
        else:
            v = tl.load(
                v_rows + offs_kc[None, :],
                mask=mask_n[:, None] & (offs_kc < in_features // 2)[None, :],
                other=0.0,
            )
        return expand_24(v, mb, BLOCK_N, BLOCK_K)
