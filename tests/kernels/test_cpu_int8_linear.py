"""The dense int8 CPU linear (``int8_linear``, ``cpu_ops.int8_linear_cpu``: int8 codes, one float16 scale per
row) against a float64 reference, at every instruction-set level the CPU has (``set_cpu_isa``): random codes
over [-127, 127] and scales, ``in_features`` not a multiple of the vector widths, 1 to 8 tokens (and the
dequantize + GEMM route beyond), float32 / bfloat16 / float16, with and without bias. The AVX-512 VNNI route
rounds the inputs to 8 bits per 32 inputs and token; its tolerance adds that rounding's bound (only there).
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_reference import assert_close, ref_input_rounding
from models import single_thread  # noqa: F401  (autouse fixture)

from hf_maskllm.kernels.cpu_extension import CPU_ISA_LEVELS, cpu_isa, cpu_kernels, set_cpu_isa
from hf_maskllm.kernels.cpu_ops import CPU_DECODE_MAX_TOKENS, int8_linear_cpu

EXT = cpu_kernels()
# `make test` sets HF_MASKLLM_REQUIRE_CPU_KERNELS=1: there a build failure fails instead of skipping
REQUIRED = os.environ.get("HF_MASKLLM_REQUIRE_CPU_KERNELS") == "1"
pytestmark = pytest.mark.skipif(
    EXT is None and not REQUIRED, reason="the CPU kernels could not be built here"
)

BEST = cpu_isa() if EXT is not None else "scalar"
LEVELS = CPU_ISA_LEVELS[: CPU_ISA_LEVELS.index(BEST) + 1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=LEVELS)
def isa(request):
    """Run the test at one instruction-set level, then restore the best one."""
    assert set_cpu_isa(request.param) == request.param
    yield request.param
    set_cpu_isa(None)


def case(tokens, out_f, in_f, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-127, 128, (out_f, in_f), generator=g).to(torch.int8)
    scales = (torch.rand(out_f, generator=g) * 0.02 + 1e-4).to(torch.float16)
    scales[0] = 0.0  # an all-zero row
    weight = qweight.double() * scales.double()[:, None]
    x = torch.randn(tokens, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    ref = x.double() @ weight.T + (b.double() if bias else 0.0)
    return x, qweight, scales, b, weight, ref, x.double().abs() @ weight.abs().T


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_every_route(isa, dtype):
    route = EXT.int8_linear_route()
    vnni = "avx512_vnni" in (open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else "")
    assert route == {"scalar": "scalar", "avx2": "avx2_q8"}.get(isa, "vnni" if vnni else "avx2_q8")
    for i, (out_f, in_f) in enumerate([(37, 1000), (3, 64), (1, 7), (16, 200), (5, 2048)]):
        for tokens in range(1, CPU_DECODE_MAX_TOKENS + 1):
            x, q, s, b, w, ref, scale = case(
                tokens, out_f, in_f, dtype, (tokens + i) % 2 == 0, seed=100 * i + tokens
            )
            y = EXT.int8_linear(x, q, s, b)
            assert y.dtype == dtype and y.shape == (tokens, out_f)
            extra = ref_input_rounding(x) @ w.abs().T if route != "scalar" else None
            assert_close(y, ref, scale, dtype, extra)


def test_nan_and_inf_inputs_reach_their_token_only(isa):
    """One NaN or inf input makes its token's outputs NaN / non-finite on every route (the VNNI route's input
    rounding never turns it into a finite code); the other tokens are unchanged."""
    x, q, s, b, w, ref, scale = case(3, 11, 200, torch.float32, True, seed=9)
    clean = EXT.int8_linear(x, q, s, b)
    x[1, 5] = float("nan")
    x[2, 150] = float("inf")
    y = EXT.int8_linear(x, q, s, b)
    assert torch.equal(y[0], clean[0])
    assert torch.isnan(y[1]).all()
    assert not torch.isfinite(y[2]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (2, 4), (3, 5)])
def test_route_by_token_count(dtype, lead):
    tokens = 1
    for d in lead:
        tokens *= d
    x, q, s, b, w, ref, scale = case(tokens, 29, 96, dtype, True, seed=tokens)
    calls = []

    class Recorder:  # the extension, with a log of which entry point ran
        def __getattr__(self, name):
            calls.append(name)
            return getattr(EXT, name)

    y = int8_linear_cpu(Recorder(), x.view(*lead, -1), q, s, b)
    assert y.shape == (*lead, 29) and y.dtype == dtype
    assert ("int8_linear" in calls) == (tokens <= CPU_DECODE_MAX_TOKENS)
    if tokens <= CPU_DECODE_MAX_TOKENS:
        extra = ref_input_rounding(x) @ w.abs().T if EXT.int8_linear_route() != "scalar" else None
        assert_close(y.reshape(tokens, 29), ref, scale, dtype, extra)
    else:  # the weight is rounded to x's dtype, then a dense GEMM
        rounded = w.to(dtype).double()
        assert_close(y.reshape(tokens, 29), x.double() @ rounded.T + b.double(), scale, dtype)


@pytest.mark.parametrize("level", ["avx2", None])
def test_results_do_not_depend_on_the_thread_count(level):
    set_cpu_isa(level)
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x, q, s, b, *_ = case(5, 1001, 1536, torch.bfloat16, True, seed=4)
            runs.append(EXT.int8_linear(x, q, s, b))
    finally:
        torch.set_num_threads(1)
        set_cpu_isa(None)
    assert torch.equal(runs[0], runs[1])


def test_bad_arguments_are_refused():
    x, q, s, b, *_ = case(2, 8, 64, torch.float32, True, seed=1)
    with pytest.raises(RuntimeError, match="qweight must be contiguous int8"):
        EXT.int8_linear(x, q.to(torch.uint8), s, b)
    with pytest.raises(RuntimeError, match="qweight must be contiguous int8"):
        EXT.int8_linear(x[:, :60], q, s, b)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        EXT.int8_linear(x, q, s.float(), b)
    with pytest.raises(RuntimeError, match="bias"):
        EXT.int8_linear(x, q, s, b[:3])
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        EXT.int8_linear(x.double(), q, s, None)
