"""The CPU N:M kernels for int8 / int4 kept values (``nm_linear_q``, ``nm_expand_q``, ``cpu_ops``) against a
float64 reference written from the format's contract (``kernel_reference``).

Every instruction-set level the CPU has (capped with ``set_cpu_isa``), random codes over the whole range
(int4's -8 included) with random float16 scales (some 0), odd ``out_features``, rows whose kept values end
in a partial block, group sizes 8 / 16 / 32 / 64 and others, 1 to 8 tokens, float32 / bfloat16 / float16
inputs, with and without bias. The AVX-512 VNNI route rounds the inputs to 8 bits per 32 inputs and token;
its tolerance adds that rounding's bound (and only there).
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_reference import assert_close, ref_dequant, ref_input_rounding, ref_positions, ref_quant_case
from models import single_thread  # noqa: F401  (autouse fixture)

from hf_maskllm.kernels.cpu_extension import CPU_ISA_LEVELS, cpu_isa, cpu_kernels, set_cpu_isa
from hf_maskllm.kernels.cpu_ops import CPU_DECODE_MAX_TOKENS, expand_q_cpu, nm_linear_q_cpu

EXT = cpu_kernels()
# `make test` sets HF_MASKLLM_REQUIRE_CPU_KERNELS=1: there a build failure fails instead of skipping
REQUIRED = os.environ.get("HF_MASKLLM_REQUIRE_CPU_KERNELS") == "1"
pytestmark = pytest.mark.skipif(
    EXT is None and not REQUIRED, reason="the CPU kernels could not be built here"
)

BEST = cpu_isa() if EXT is not None else "scalar"
# the AVX-512 route needs VNNI and VBMI beside AVX-512 (Linux's names for the CPU flags)
_FLAGS = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
EXT_HAS_VNNI = "avx512_vnni" in _FLAGS and "avx512vbmi" in _FLAGS
LEVELS = CPU_ISA_LEVELS[: CPU_ISA_LEVELS.index(BEST) + 1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=LEVELS)
def isa(request):
    """Run the test at one instruction-set level, then restore the best one."""
    assert set_cpu_isa(request.param) == request.param
    yield request.param
    set_cpu_isa(None)


def case(tokens, out_f, in_f, n, m, bits, gs, dtype, bias, seed):
    """Random x (never zero) and quantized N:M weight; the float64 reference and its error scales."""
    qvalues, scales, meta, dense = ref_quant_case(out_f, in_f, n, m, bits, gs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    ref = x.double() @ dense.T + (b.double() if bias else 0.0)
    scale = x.double().abs() @ dense.abs().T
    return x, qvalues, scales, meta, b, dense, ref, scale


def check(y, x, dense, ref, scale, dtype, route):
    """``y`` against the reference; the VNNI route may also be off by its input rounding."""
    extra = ref_input_rounding(x) @ dense.abs().T if route in ("vnni", "avx2_q8") else None
    assert_close(y, ref, scale, dtype, extra)


def expected_route(isa_level: str, n: int, m: int, gs: int) -> str:
    if (n, m) != (2, 4) or gs % 8 or isa_level == "scalar":
        return "scalar"
    vnni_gs = gs in (8, 16, 32) or gs % 64 == 0
    if isa_level.startswith("avx512") and EXT_HAS_VNNI and vnni_gs:
        return "vnni"
    return "avx2_q8" if gs in (8, 16) or gs % 32 == 0 else "avx2"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", [8, 16, 32, 64])
@pytest.mark.parametrize("bits", [8, 4])
def test_decode_2of4_every_route(isa, bits, gs, dtype):
    route = EXT.nm_linear_q_route(2, 4, gs)
    assert route == expected_route(isa, 2, 4, gs)
    # kept values per row: gs, 3 gs and 17 gs (partial 64-blocks, and for gs 8 a partial 16-block)
    for i, (out_f, in_f) in enumerate([(37, 2 * gs), (3, 6 * gs), (1, 34 * gs), (16, 16 * gs)]):
        for tokens in range(1, CPU_DECODE_MAX_TOKENS + 1):
            bias = (tokens + i) % 2 == 0
            x, q, s, meta, b, dense, ref, scale = case(
                tokens, out_f, in_f, 2, 4, bits, gs, dtype, bias, seed=1000 * i + 10 * tokens + gs + bits
            )
            y = EXT.nm_linear_q(x, q, s, meta, 2, 4, bits, gs, b)
            assert y.dtype == dtype and y.shape == (tokens, out_f)
            check(y, x, dense, ref, scale, dtype, route)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "n,m,gs",
    [(2, 4, 2), (2, 4, 6), (2, 4, 24), (2, 4, 96), (2, 4, 128), (1, 4, 4), (4, 8, 8), (3, 8, 6), (1, 2, 2)],
)
def test_decode_other_patterns_and_group_sizes(isa, bits, n, m, gs):
    route = EXT.nm_linear_q_route(n, m, gs)
    assert route == expected_route(isa, n, m, gs)
    for dtype in DTYPES:
        for tokens, out_f, groups in [(1, 9, 1), (5, 3, 2), (8, 17, 5)]:
            kept = gs * groups
            in_f = kept // n * m
            x, q, s, meta, b, dense, ref, scale = case(
                tokens, out_f, in_f, n, m, bits, gs, dtype, True, seed=n * 100 + m * 10 + gs + tokens
            )
            check(EXT.nm_linear_q(x, q, s, meta, n, m, bits, gs, b), x, dense, ref, scale, dtype, route)


def test_int4_minus_eight_and_zero_blocks(isa):
    """Code -8 (allowed in int4), zero scales and inputs whose whole 32-block is zero."""
    x, q, s, meta, b, dense, ref, scale = case(4, 21, 512, 2, 4, 4, 32, torch.float32, True, seed=5)
    q = torch.full_like(q, 0x00)  # every code -8
    s[:, 1] = 0.0
    cols = (torch.arange(256) // 2 * 4)[None, :] + ref_positions(meta, 256, 4)
    dense = torch.zeros(21, 512, dtype=torch.float64).scatter(1, cols, ref_dequant(q, s, 4, 32))
    x[:, 64:128] = 0.0
    ref = x.double() @ dense.T + b.double()
    y = EXT.nm_linear_q(x, q, s, meta, 2, 4, 4, 32, b)
    check(y, x, dense, ref, x.double().abs() @ dense.abs().T, torch.float32, EXT.nm_linear_q_route(2, 4, 32))


@pytest.mark.parametrize("bits", [8, 4])
def test_nan_and_inf_inputs_reach_their_token_only(isa, bits):
    """A NaN or an inf among a token's inputs makes that token's outputs NaN / non-finite, on every route
    (the VNNI route's input rounding never turns them into finite codes); the other tokens are unchanged."""
    x, q, s, meta, b, dense, ref, scale = case(3, 9, 256, 2, 4, bits, 32, torch.float32, True, seed=17)
    clean = EXT.nm_linear_q(x, q, s, meta, 2, 4, bits, 32, b)
    x[1, 32:64] = float("nan")  # a whole block of 32: every row reads some of it, whatever its mask
    x[2, 96:128] = float("inf")
    y = EXT.nm_linear_q(x, q, s, meta, 2, 4, bits, 32, b)
    assert torch.equal(y[0], clean[0])
    assert torch.isnan(y[1]).all()
    assert not torch.isfinite(y[2]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "n,m,gs", [(2, 4, 8), (2, 4, 16), (2, 4, 32), (2, 4, 64), (2, 4, 6), (4, 8, 8), (1, 4, 2)]
)
def test_expand_is_exact(isa, bits, n, m, gs, dtype):
    """The dequantized weight, rounded once to the output dtype, into a NaN-filled buffer (every entry written)."""
    for out_f, groups in [(1, 1), (7, 3), (5, 17)]:
        in_f = gs * groups // n * m
        q, s, meta, dense = ref_quant_case(out_f, in_f, n, m, bits, gs, seed=out_f + in_f + bits)
        buffer = torch.full((out_f, in_f), float("nan"), dtype=dtype)
        got = EXT.nm_expand_q(q, s, meta, n, m, bits, gs, in_f, buffer)
        assert got.data_ptr() == buffer.data_ptr()
        assert torch.equal(got, dense.to(dtype)), (got - dense.to(dtype)).abs().max()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (2, 4), (3, 3), (2, 8), (64,)])
def test_route_by_token_count(bits, dtype, lead):
    """``nm_linear_q_cpu``: direct up to CPU_DECODE_MAX_TOKENS tokens, dequantize + GEMM beyond."""
    tokens = 1
    for d in lead:
        tokens *= d
    x, q, s, meta, b, dense, ref, scale = case(
        tokens, 23, 256, 2, 4, bits, 32, dtype, True, seed=tokens + bits
    )
    calls = []

    class Recorder:  # the extension, with a log of which entry point ran
        def __getattr__(self, name):
            calls.append(name)
            return getattr(EXT, name)

    y = nm_linear_q_cpu(Recorder(), x.view(*lead, -1), q, s, meta, 2, 4, bits, 32, 256, b)
    direct = tokens <= CPU_DECODE_MAX_TOKENS
    assert ("nm_linear_q" in calls) == direct != ("nm_expand_q" in calls)
    assert y.shape == (*lead, 23) and y.dtype == dtype
    if direct:
        check(y.reshape(tokens, 23), x, dense, ref, scale, dtype, EXT.nm_linear_q_route(2, 4, 32))
    else:  # the weight is rounded to x's dtype first, then a dense GEMM
        rounded = dense.to(dtype).double()
        assert_close(y.reshape(tokens, 23), x.double() @ rounded.T + b.double(), scale, dtype)


def test_expand_route_reuses_the_scratch_buffer():
    q, s, meta, dense = ref_quant_case(40, 128, 2, 4, 8, 16, seed=3)
    first = expand_q_cpu(EXT, q, s, meta, 2, 4, 8, 16, 128, torch.float32, keep=False)
    again = expand_q_cpu(
        EXT,
        q[:8].contiguous(),
        s[:8].contiguous(),
        meta[:8].contiguous(),
        2,
        4,
        8,
        16,
        128,
        torch.float32,
        keep=False,
    )
    assert again.data_ptr() == first.data_ptr() and torch.equal(first, dense.float())
    kept = expand_q_cpu(EXT, q, s, meta, 2, 4, 8, 16, 128, torch.float32, keep=True)
    assert kept.data_ptr() != first.data_ptr() and torch.equal(kept, dense.float())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_tokens_result_does_not_depend_on_the_tokens_decoded_with_it(isa, bits):
    # one token runs its own path on the VNNI route (a thread's rows in one call, sums reduced four rows
    # at a time, the block's scale products formed apart, per group size): the same bits as the token's
    # row of a two-token call, float32 so no rounding hides them; 576 and 320 inputs end in a partial block
    for gs, out_f, in_f in [(32, 37, 576), (8, 300, 576), (64, 6, 2048), (16, 513, 256), (16, 41, 320)]:
        x, q, s, meta, b, *_ = case(2, out_f, in_f, 2, 4, bits, gs, torch.float32, True, seed=out_f + bits)
        one = EXT.nm_linear_q(x[:1], q, s, meta, 2, 4, bits, gs, b)
        two = EXT.nm_linear_q(x, q, s, meta, 2, 4, bits, gs, b)
        assert torch.equal(one[0], two[0]), (gs, out_f, in_f)


@pytest.mark.parametrize("level", ["avx2", None])
def test_results_do_not_depend_on_the_thread_count(level):
    set_cpu_isa(level)
    try:
        runs = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            ys = []
            # 576 inputs: short rows, decoded two at a time up to 4 tokens (777 rows: one left alone)
            for bits, dtype, tokens, in_f in [
                (8, torch.bfloat16, 3, 1536), (4, torch.float32, 1, 1536), (4, torch.float16, 8, 1536),
                (8, torch.float32, 1, 576), (4, torch.bfloat16, 4, 576),
            ]:  # fmt: skip
                x, q, s, meta, b, *_ = case(tokens, 777, in_f, 2, 4, bits, 32, dtype, True, seed=bits)
                ys.append(EXT.nm_linear_q(x, q, s, meta, 2, 4, bits, 32, b))
                ys.append(
                    EXT.nm_expand_q(q, s, meta, 2, 4, bits, 32, in_f, torch.empty(777, in_f, dtype=dtype))
                )
            runs.append(ys)
    finally:
        torch.set_num_threads(1)
        set_cpu_isa(None)
    assert all(torch.equal(a, c) for a, c in zip(runs[0], runs[1]))
    assert all(torch.equal(a, c) for a, c in zip(runs[0], runs[2]))


def test_bad_arguments_are_refused():
    x, q, s, meta, b, *_ = case(2, 8, 64, 2, 4, 8, 16, torch.float32, True, seed=1)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        EXT.nm_linear_q(x, q, s, meta, 2, 4, 3, 16, b)
    with pytest.raises(RuntimeError, match="qvalues must be contiguous int8"):
        EXT.nm_linear_q(x, q.to(torch.uint8), s, meta, 2, 4, 8, 16, b)
    with pytest.raises(RuntimeError, match="qvalues must be contiguous uint8"):
        EXT.nm_linear_q(x, q, s, meta, 2, 4, 4, 16, b)  # int4 wants uint8 [out, kept / 2]
    with pytest.raises(RuntimeError, match="group_size 12 must divide"):
        EXT.nm_linear_q(x, q, s, meta, 2, 4, 8, 12, b)
    with pytest.raises(RuntimeError, match="be even"):
        EXT.nm_linear_q(x, q[:, :16].contiguous(), s, meta, 2, 4, 4, 1, b)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        EXT.nm_linear_q(x, q, s.float(), meta, 2, 4, 8, 16, b)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        EXT.nm_linear_q(x, q, s[:, :1].contiguous(), meta, 2, 4, 8, 16, b)
    with pytest.raises(RuntimeError, match="meta must be"):
        EXT.nm_linear_q(x, q, s, meta[:, :3].contiguous(), 2, 4, 8, 16, b)
    with pytest.raises(RuntimeError, match="bias"):
        EXT.nm_linear_q(x, q, s, meta, 2, 4, 8, 16, b[:4])
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        EXT.nm_linear_q(x.double(), q, s, meta, 2, 4, 8, 16, None)
    with pytest.raises(RuntimeError, match="output must be contiguous"):
        EXT.nm_expand_q(q, s, meta, 2, 4, 8, 16, 64, torch.empty(8, 60))
    # no output rows, no tokens: empty results of the right shape
    assert EXT.nm_linear_q(x[:0], q, s, meta, 2, 4, 8, 16, b).shape == (0, 8)
