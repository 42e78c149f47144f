"""Format version 2 (int8 / int4 kept values): the bit layout, round-to-nearest quantization and
dequantization against float64 references, and every refusal of a malformed layer."""

from __future__ import annotations

import pytest
import torch

from hf_maskllm.errors import CheckpointError, ConfigError
from hf_maskllm.sparse.format import (
    check_group_size,
    compress,
    decompress,
    dequantize,
    dequantize_values,
    pack_codes,
    quantized_shapes,
    suggest_group_size,
    unpack_codes,
    validate_quantized,
)
from hf_maskllm.sparse.quantize import quantize_rtn, resolve_values


def _nm_weight(out: int, in_features: int, n: int, m: int, seed: int) -> torch.Tensor:
    """A random N:M weight with fresh nonzero values (float32)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, in_features, generator=g)
    groups = w.view(out, -1, m)
    drop = torch.rand(groups.shape, generator=g).argsort(dim=-1)[..., : m - n]
    groups.scatter_(-1, drop, 0.0)
    return w


def _rtn_reference(values: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest in float64, written out row by row and group by group (no vectorised tricks)."""
    top = 2 ** (bits - 1) - 1
    out, kept = values.shape
    codes = torch.zeros(out, kept, dtype=torch.int64)
    scales = torch.zeros(out, kept // group_size, dtype=torch.float16)
    for r in range(out):
        for g in range(kept // group_size):
            chunk = values[r, g * group_size : (g + 1) * group_size].double()
            scale = torch.tensor(float(chunk.abs().max()) / top, dtype=torch.float32).half()
            scales[r, g] = scale
            if float(scale) > 0:
                # float32 division, as the contract computes it
                q = torch.round(chunk.float() / scale.float()).clamp(-top, top)
                codes[r, g * group_size : (g + 1) * group_size] = q.long()
    return codes, scales


# ------------------------------------------------------------------------------------------- layout
def test_int4_nibble_layout_is_the_contracts():
    codes = torch.tensor([[-8, 7, 0, 1, -1, 3]], dtype=torch.int8)
    packed = pack_codes(codes, 4)
    # byte j // 2, low nibble for even j, high for odd j; nibble = code + 8
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0 | 15 << 4, 8 | 9 << 4, 7 | 11 << 4]]
    assert torch.equal(unpack_codes(packed, 4), codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_round_trips_every_code(bits):
    low, high = (-127, 127) if bits == 8 else (-8, 7)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(low, high + 1, (7, 38), generator=g, dtype=torch.int8)
    packed = pack_codes(codes, bits)
    assert packed.shape == ((7, 38) if bits == 8 else (7, 19))
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_quantized_shapes():
    # 2:4 of a [5, 96] weight: 48 kept per row, 16 per scale
    assert quantized_shapes(5, 96, 2, 4, 8, 16) == ((5, 48), (5, 3), (5, 12))
    assert quantized_shapes(5, 96, 2, 4, 4, 16) == ((5, 24), (5, 3), (5, 12))


# ------------------------------------------------------------------------------------------- RTN
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rtn_matches_the_float64_reference(bits, dtype):
    values = (torch.randn(9, 48, generator=torch.Generator().manual_seed(bits)) * 0.05).to(dtype)
    values[2, 16:32] = 0  # an all-zero group: scale 0, codes 0
    codes, scales = quantize_rtn(values, bits, 16)
    ref_codes, ref_scales = _rtn_reference(values, bits, 16)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (9, 3)
    assert torch.equal(codes.long(), ref_codes) and torch.equal(scales, ref_scales)
    assert float(scales[2, 1]) == 0 and not codes[2, 16:32].any()
    assert int(codes.abs().max()) == 2 ** (bits - 1) - 1  # every absmax value lands on qmax
    # dequantized error: at most half a scale step (plus the float16 rounding of the scale)
    deq = dequantize_values(pack_codes(codes, bits), scales, bits, 16, torch.float64)
    step = scales.double().repeat_interleave(16, dim=1)
    assert bool(((deq - values.double()).abs() <= step * 0.5 + 1e-3 * values.double().abs()).all())


def test_rtn_refuses_values_float16_scales_cannot_hold():
    values = torch.full((1, 8), 1e7)
    with pytest.raises(CheckpointError, match="exceed what float16 scales hold"):
        quantize_rtn(values, 8, 8)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "m", "in_features"), [(2, 4, 96), (1, 4, 64), (4, 8, 96)])
def test_dequantize_matches_float64(bits, n, m, in_features):
    """The dense weight is float(scale) * code at the kept positions, zeros elsewhere."""
    weight = _nm_weight(13, in_features, n, m, seed=in_features + bits)
    values, meta = compress(weight, n, m)
    group = 8
    codes, scales = quantize_rtn(values, bits, group)
    qvalues = pack_codes(codes, bits)
    ref_values = codes.double() * scales.double().repeat_interleave(group, dim=1)
    ref = decompress(ref_values, meta, n, m, in_features)
    for dtype in (torch.float64, torch.float32):
        got = dequantize(qvalues, scales, meta, n, m, bits, group, in_features, dtype)
        assert got.dtype == dtype and torch.equal(got.double(), ref)
    assert torch.equal((ref != 0), (weight != 0) & (ref != 0))  # nothing outside the kept positions


# ------------------------------------------------------------------------------------------- group sizes
def test_group_size_refusals_name_the_layer_and_a_size_that_works():
    with pytest.raises(ConfigError, match=r"group_size=48 does not divide its 32 kept.*'a.q'.*group_size=32"):
        check_group_size(32, 8, 48, "a.q", [32, 64])
    with pytest.raises(ConfigError, match=r"group_size=3 is odd \(int4.*'b'.*group_size=2"):
        check_group_size(24, 4, 3, "b")
    with pytest.raises(ConfigError, match="positive int"):
        check_group_size(24, 8, 0)
    assert suggest_group_size([96, 144], 4, 32) == 24 and suggest_group_size([96, 144], 8, 64) == 48
    assert suggest_group_size(7, 4, 32) is None


def test_resolve_values():
    assert resolve_values(None, None) == (None, None) == resolve_values("float", None)
    assert resolve_values("int8", None) == (8, 32) and resolve_values("int4", 16) == (4, 16)
    with pytest.raises(ConfigError, match="applies to int8 / int4 values only"):
        resolve_values(None, 16)
    with pytest.raises(ConfigError, match=r"`values` must be one of \['int8', 'int4'\]"):
        resolve_values("int2", None)


# ------------------------------------------------------------------------------------------- validation
def _layer(bits: int, group: int = 8) -> dict:
    weight = _nm_weight(6, 64, 2, 4, seed=5)
    values, meta = compress(weight, 2, 4)
    codes, scales = quantize_rtn(values, bits, group)
    return {"qvalues": pack_codes(codes, bits), "scales": scales, "meta": meta}


def _validate(t: dict, bits: int, group: int = 8) -> None:
    validate_quantized(t["qvalues"], t["scales"], t["meta"], 2, 4, bits, group, 64, 6, "layers.0.q")


@pytest.mark.parametrize("bits", [8, 4])
def test_validate_accepts_a_well_formed_layer(bits):
    _validate(_layer(bits), bits)


@pytest.mark.parametrize(
    ("bits", "edit", "message"),
    [
        (8, lambda t: t.update(scales=t["scales"][:, :-1]), r"`scales` must be float16 of shape \[6, 4\]"),
        (8, lambda t: t.update(scales=t["scales"].float()), r"`scales` must be float16"),
        (
            4,
            lambda t: t.update(qvalues=t["qvalues"][:, :-1]),
            r"`qvalues` must be torch.uint8 of shape \[6, 16\]",
        ),
        (8, lambda t: t.update(qvalues=t["qvalues"].float()), r"`qvalues` must be torch.int8"),
        (4, lambda t: t.update(qvalues=t["qvalues"].view(torch.int8)), r"`qvalues` must be torch.uint8"),
        (8, lambda t: t["scales"].__setitem__((1, 2), float("nan")), r"`scales` holds NaN or inf"),
        (4, lambda t: t["scales"].__setitem__((0, 0), float("inf")), r"`scales` holds NaN or inf"),
        (8, lambda t: t["qvalues"].__setitem__((3, 3), -128), r"code -128"),
        (8, lambda t: t["meta"].__setitem__((0, 0), 0b00_00_01_01), r"not strictly increasing"),
        (8, lambda t: t.update(meta=t["meta"][:, 1:]), r"`meta` must be uint8"),
    ],
)
def test_validate_refuses_malformed_layers(bits, edit, message):
    t = _layer(bits)
    edit(t)
    with pytest.raises(CheckpointError, match=r"'layers.0.q'.*" + message):
        _validate(t, bits)


def test_validate_refuses_a_group_size_that_does_not_divide_kept():
    t = _layer(8)
    with pytest.raises(CheckpointError, match=r"group_size=12 does not divide its 32 kept values"):
        _validate(t, 8, 12)
