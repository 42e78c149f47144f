"""The CPU N:M kernels (``hf_maskllm.kernels.cpu_ops``) against a float64 reference.

Every instruction-set level the CPU has is tested (the C++ dispatch is capped with ``set_cpu_isa``),
on fresh random inputs, with edge shapes: ``in_features`` not a multiple of the vector width, odd
``out_features``, 1 to 16 tokens (the direct kernel; routed up to 8) and 512 (expand + GEMM), with
and without bias, 2:4 and other N:M patterns.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_reference import assert_close, ref_compress
from models import single_thread  # noqa: F401  (autouse fixture)

from hf_maskllm.kernels.cpu_extension import CPU_ISA_LEVELS, cpu_isa, cpu_kernels, set_cpu_isa
from hf_maskllm.kernels.cpu_ops import CPU_DECODE_MAX_TOKENS, expand_cpu, nm_linear_cpu, scratch_bytes
from hf_maskllm.sparse.format import compress, decompress

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


def case(tokens, out_f, in_f, n, m, dtype, bias, seed):
    """Random x, an N:M weight (never zeros), its compressed form, and the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=g).to(dtype)
    _, _, dense = ref_compress(torch.randn(out_f, in_f, generator=g).to(dtype), n, m)
    values, meta = compress(dense, n, m)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    ref = x.double() @ dense.double().T + (b.double() if bias else 0.0)
    scale = x.double().abs() @ dense.double().abs().T
    return x, values, meta, b, dense, ref, scale


# in_features: multiples of 4 below, at and between the vector widths (16 fp32 / 32 bf16 kept values)
SHAPES_24 = [(1, 4), (7, 36), (33, 64), (5, 100), (16, 136), (3, 576)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", list(range(1, 17)))
def test_direct_kernel_2of4_every_token_count(isa, dtype, tokens):
    for i, (out_f, in_f) in enumerate(SHAPES_24):
        for bias in (True, False):
            x, values, meta, b, _, ref, scale = case(
                tokens, out_f, in_f, 2, 4, dtype, bias, seed=100 * tokens + i
            )
            y = EXT.nm_linear(x, values, meta, 2, 4, b)
            assert y.dtype == dtype and y.shape == (tokens, out_f)
            assert_close(y, ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(1, 2), (1, 4), (3, 4), (2, 8), (4, 8), (5, 8), (3, 6)])
def test_direct_kernel_other_patterns(isa, dtype, n, m):
    for tokens, out_f, in_f in [(1, 9, 8 * m), (5, 3, 2 * m), (16, 17, 13 * m)]:
        x, values, meta, b, _, ref, scale = case(
            tokens, out_f, in_f, n, m, dtype, True, seed=n * 10 + m + tokens
        )
        assert_close(EXT.nm_linear(x, values, meta, n, m, b), ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 8), (1, 2)])
def test_expand_is_exact(isa, dtype, n, m):
    for out_f, in_f in [(1, m), (7, 9 * m), (33, 64 * m // 4), (5, 100 * m // 4)]:
        x, values, meta, _, dense, _, _ = case(1, out_f, in_f, n, m, dtype, False, seed=out_f + in_f)
        buffer = torch.full((out_f, in_f), float("nan"), dtype=dtype)  # every entry must be written
        assert torch.equal(EXT.nm_expand(values, meta, n, m, in_f, buffer), dense)
        assert torch.equal(decompress(values, meta, n, m, in_f), dense)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("lead", [(1,), (2, 4), (3, 3), (2, 8), (512,), (2, 256)])
def test_route_by_token_count(isa, dtype, n, m, lead):
    """``nm_linear_cpu``: direct for up to CPU_DECODE_MAX_TOKENS tokens, expand into the scratch buffer + GEMM beyond."""
    tokens = 1
    for d in lead:
        tokens *= d
    x, values, meta, b, _, ref, scale = case(tokens, 23, 24 * m // 2, n, m, dtype, True, seed=tokens)
    calls = []

    class Recorder:  # the extension, with a log of which entry point ran
        def __getattr__(self, name):
            calls.append(name)
            return getattr(EXT, name)

    y = nm_linear_cpu(Recorder(), x.view(*lead, -1), values, meta, n, m, x.shape[1], b)
    assert ("nm_linear" in calls) == (tokens <= CPU_DECODE_MAX_TOKENS) != ("nm_expand" in calls)
    assert y.shape == (*lead, 23)
    assert_close(y.reshape(tokens, 23), ref, scale, dtype)


def test_expand_route_reuses_one_buffer_and_keep_gets_a_fresh_one():
    _, values, meta, _, dense, _, _ = case(1, 40, 64, 2, 4, torch.float32, False, seed=3)
    first = expand_cpu(EXT, values, meta, 2, 4, 64, keep=False)
    held = scratch_bytes()
    assert held >= dense.numel() * 4 and torch.equal(first, dense)
    small = expand_cpu(EXT, values[:8].contiguous(), meta[:8].contiguous(), 2, 4, 64, keep=False)
    assert small.data_ptr() == first.data_ptr() and scratch_bytes() == held  # the same buffer, not grown
    kept = expand_cpu(EXT, values, meta, 2, 4, 64, keep=True)
    assert kept.data_ptr() != first.data_ptr() and torch.equal(kept, dense)


def test_results_do_not_depend_on_the_thread_count():
    x, values, meta, b, _, _, _ = case(3, 777, 1536, 2, 4, torch.bfloat16, True, seed=7)
    xf, valuesf, metaf, bf, _, _, _ = case(1, 777, 1536, 2, 4, torch.float32, True, seed=8)
    torch.set_num_threads(1)
    one = (EXT.nm_linear(x, values, meta, 2, 4, b), EXT.nm_linear(xf, valuesf, metaf, 2, 4, bf))
    torch.set_num_threads(2)
    try:
        two = (EXT.nm_linear(x, values, meta, 2, 4, b), EXT.nm_linear(xf, valuesf, metaf, 2, 4, bf))
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, c) for a, c in zip(one, two))
    assert torch.equal(EXT.nm_linear(x, values, meta, 2, 4, b), one[0])  # and from call to call


def test_bad_arguments_are_refused():
    x, values, meta, b, _, _, _ = case(2, 8, 16, 2, 4, torch.float32, True, seed=1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        EXT.nm_linear(x.double(), values, meta, 2, 4, b)
    with pytest.raises(RuntimeError, match="in_features"):
        EXT.nm_linear(x[:, :12], values, meta, 2, 4, b)
    with pytest.raises(RuntimeError, match="bias"):
        EXT.nm_linear(x, values, meta, 2, 4, b[:4])
    with pytest.raises(RuntimeError, match="output"):
        EXT.nm_expand(values, meta, 2, 4, 16, torch.empty(8, 12))
    with pytest.raises(ValueError, match="level"):
        set_cpu_isa("sse9")
    with pytest.raises(RuntimeError, match="level"):
        EXT.set_isa(7)
    # no input features: the bias alone
    assert torch.equal(EXT.nm_linear(torch.empty(3, 0), values[:, :0], meta[:, :0], 2, 4, b), b.expand(3, -1))
