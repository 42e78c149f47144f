"""The 2:4 kernels compiled for and run on a CUDA GPU, against a float64 reference.

Skipped without a GPU (CI); the GPU session runs it first (``benchmarks/gpu_session.sh``):
``TRITON_INTERPRET=0 python -m pytest -q tests/kernels/test_ops_gpu.py``. It covers what the interpreter
cannot: the inline-PTX byte permutes, real tensor-core ``tl.dot`` in fp16/bf16/fp32, TMA copies,
every autotune config (not only the winners), CUDA graphs and ``torch.compile(mode="reduce-overhead")``.
Ordered by what only a GPU can tell, so that a timeout loses the least.
"""

import os

import pytest
import torch
from kernel_reference import assert_close, make_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0",
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (dtype, (out, in), tokens): odd sizes (partial blocks, odd meta tail, rows not 16-byte aligned),
# model-like sizes, both sides of each route boundary, one prefill-sized batch
CASES = (
    [(BF16, shape, t) for shape in [(123, 204), (1000, 2056), (4096, 4096)] for t in (1, 7, 16, 17, 64, 2048)]
    + [(FP16, (1000, 2056), t) for t in (1, 17, 2048)]
    + [(FP32, (1000, 2056), t) for t in (1, 64)]
)  # fmt: skip


@pytest.fixture(autouse=True)
def _exact_cublas():
    # the expand route ends in cuBLAS: keep its 16-bit reductions in fp32 like the kernels
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


def test_cuda_graph_and_compile_reduce_overhead():
    from torch._dynamo.utils import counters

    from hf_maskllm.kernels import nm_linear

    counters.clear()
    g = torch.Generator().manual_seed(6)
    for tokens in (1, 64):  # the decode route; the tl.dot route with x through TMA
        _, values, meta, b, _, _ = make_case(tokens, 4096, 4096, BF16, True, seed=5, device="cuda")

        def f(x, values=values, meta=meta, b=b):
            return torch.nn.functional.silu(nm_linear(x, values, meta, 2, 4, 4096, b))

        compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
        for _ in range(4):  # fresh inputs through the captured CUDA graph each time
            x = torch.randn(tokens, 4096, generator=g).to(BF16).cuda()
            got, want = compiled(x).float(), f(x).float()  # eager: checked against float64 below
            assert torch.allclose(got, want, rtol=2**-7, atol=1e-3), (got - want).abs().max()
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled graphs did not run as CUDA graphs"


@pytest.mark.parametrize("dtype,shape,tokens", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_every_route_on_the_gpu(dtype, shape, tokens):
    from hf_maskllm.kernels import DECODE_MAX_TOKENS, nm_linear
    from hf_maskllm.kernels.ops import nm_linear_decode, nm_linear_dot, nm_linear_expand

    out_f, in_f = shape
    x, values, meta, b, ref, scale = make_case(
        tokens, out_f, in_f, dtype, True, seed=tokens + out_f, device="cuda"
    )
    routes = {"decode": nm_linear_decode} if tokens <= DECODE_MAX_TOKENS else {"dot": nm_linear_dot}
    for fn in routes.values():
        fn(x, values, meta, b)  # autotune first: it writes every config's output into `out`
        out = torch.full((tokens, out_f), float("nan"), dtype=dtype, device="cuda")  # poison
        assert_close(fn(x, values, meta, b, out=out), ref, scale, dtype)
    assert_close(nm_linear_expand(x, values, meta, b), ref, scale, dtype)
    assert_close(nm_linear(x, values, meta, 2, 4, in_f, b), ref, scale, dtype)


@pytest.mark.parametrize("has_desc", [True, False], ids=["x-tma", "x-pointers"])
@pytest.mark.parametrize("module,tokens", [("nm_decode", 5), ("nm_dot", 300)])
def test_every_candidate_config_on_the_gpu(module, tokens, has_desc):
    # not only the autotune winners: any config can win on another shape or through timing noise
    import importlib

    from hf_maskllm.kernels.ops import nm_linear_decode, nm_linear_dot

    fn = nm_linear_decode if module == "nm_decode" else nm_linear_dot
    in_f = 2056 if has_desc else 2052  # 2052 bf16 rows are not 16-byte multiples: no descriptor
    x, values, meta, b, ref, scale = make_case(tokens, 1000, in_f, BF16, True, seed=7, device="cuda")
    for config in importlib.import_module(f"hf_maskllm.kernels.{module}").candidate_configs(has_desc):
        out = torch.full((tokens, 1000), float("nan"), dtype=BF16, device="cuda")
        assert_close(fn(x, values, meta, b, out=out, config=config), ref, scale, BF16)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_decompress_is_exact_on_the_gpu(dtype):
    from kernel_reference import ref_compress

    from hf_maskllm.kernels.ops import nm_decompress_24

    g = torch.Generator().manual_seed(3)
    values, meta, dense = ref_compress(torch.randn(1000, 2056, generator=g).to(dtype), 2, 4)
    assert torch.equal(nm_decompress_24(values.cuda(), meta.cuda(), 2056).cpu(), dense)


@pytest.mark.parametrize("values", ["float", "int8"])
def test_compiled_static_cache_generation_on_the_gpu(values):
    # the registered op's CUDA route (Triton; int8 codes dequantized first) under torch.compile: one
    # graph for the prefill and one for the decode step, the eager greedy tokens
    from test_compile import compressed_llama
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = compressed_llama(BF16, values).cuda()
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3)).cuda()
    kwargs = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static"
    )
    with torch.no_grad():
        eager = model.generate(prompt, **kwargs)
        counter = CompileCounterWithBackend("aot_eager")  # the same kernels as eager: equal tokens
        model.forward = torch.compile(model.forward, backend=counter, fullgraph=True)
        got = [model.generate(prompt, **kwargs) for _ in range(2)]
    assert counter.frame_count == 2
    assert all(torch.equal(g, eager) for g in got)
