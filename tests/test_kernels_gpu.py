"""The 2:4 kernels compiled for and run on a CUDA GPU, against a float64 reference.

Skipped without a GPU (CI); the GPU session runs it first (``benchmarks/gpu_session.sh``):
``TRITON_INTERPRET=0 python -m pytest -q tests/test_kernels_gpu.py``. It covers what the interpreter
cannot: the inline-PTX byte permutes, real tensor-core ``tl.dot`` in fp16/bf16, every autotune
config that wins on real shapes, CUDA graphs and ``torch.compile(mode="reduce-overhead")``.
"""

import os

import pytest
import torch
from kernel_reference import assert_close, make_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0",
)

# (out, in): odd sizes (partial blocks, odd meta tail), then model-like sizes
SHAPES = [(123, 204), (1000, 2056), (4096, 4096)]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _exact_cublas():
    # the expand route ends in cuBLAS: keep its bf16/fp16 reductions in fp32 like the kernels
    saved = (
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    )
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    yield
    (
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    ) = saved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 64, 2048])
def test_every_route_on_the_gpu(tokens, shape, dtype):
    from hf_maskllm.kernels import DECODE_MAX_TOKENS, nm_linear
    from hf_maskllm.kernels.ops import nm_linear_decode, nm_linear_dot, nm_linear_expand

    out_f, in_f = shape
    x, values, meta, b, ref, scale = make_case(
        tokens, out_f, in_f, dtype, True, seed=tokens + out_f, device="cuda"
    )
    routes = {"dot": nm_linear_dot, "expand": nm_linear_expand}
    if tokens <= DECODE_MAX_TOKENS:
        routes["decode"] = nm_linear_decode
    for name, fn in routes.items():
        kwargs = {}
        if name != "expand":  # poison: every element must be written
            kwargs["out"] = torch.full((tokens, out_f), float("nan"), dtype=dtype, device="cuda")
        assert_close(fn(x, values, meta, b, **kwargs), ref, scale, dtype)
    assert_close(nm_linear(x, values, meta, 2, 4, in_f, b), ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decompress_is_exact_on_the_gpu(dtype):
    from kernel_reference import ref_compress

    from hf_maskllm.kernels.ops import nm_decompress_24

    g = torch.Generator().manual_seed(3)
    values, meta, dense = ref_compress(torch.randn(1000, 2056, generator=g).to(dtype), 2, 4)
    assert torch.equal(nm_decompress_24(values.cuda(), meta.cuda(), 2056).cpu(), dense)


def test_cuda_graph_and_compile_reduce_overhead():
    from hf_maskllm.kernels import nm_linear

    _, values, meta, b, _, _ = make_case(1, 4096, 4096, torch.bfloat16, True, seed=5, device="cuda")

    def f(x):
        return torch.nn.functional.silu(nm_linear(x, values, meta, 2, 4, 4096, b))

    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator().manual_seed(6)
    for _ in range(4):  # fresh inputs through the captured CUDA graph each time
        x = torch.randn(1, 4096, generator=g).to(torch.bfloat16).cuda()
        got, want = compiled(x).float(), f(x).float()  # eager: checked against float64 above
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-3), (got - want).abs().max()
