"""Compressed models under ``torch.compile``: registered ops, no graph break, no recompilation, eager results.

A tiny seeded Llama is pruned to 2:4 and compressed (``SparseLinear``, float32 / bfloat16 values) or
quantized (``QuantizedSparseLinear``, int8 / int4 codes). Compiled with ``fullgraph=True`` (any graph
break raises), it must produce the eager logits and greedy tokens, and transformers' static-cache
generation must compile once for the prefill and once for the decode step, then never again. Most tests
use the ``aot_eager`` backend (dynamo, fake tensors and AOT autograd: everything ``fullgraph`` checks);
one runs inductor.
"""

from __future__ import annotations

import os

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)
from sparse_helpers import VOCAB, assert_logits_close, merged_model
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from hf_maskllm.kernels import route
from hf_maskllm.kernels.cpu_extension import cpu_kernels
from hf_maskllm.sparse import SparseLinear, to_sparse_layers
from hf_maskllm.sparse.quantize import quantize_layers
from hf_maskllm.sparse.quantized_linear import QuantizedSparseLinear

REQUIRED = os.environ.get("HF_MASKLLM_REQUIRE_CPU_KERNELS") == "1"
pytestmark = [
    pytest.mark.skipif(
        cpu_kernels() is None and not REQUIRED, reason="the CPU kernels could not be built here"
    ),
    pytest.mark.usefixtures("fresh_dynamo"),
]

GROUP_SIZE = 16  # divides every layer's kept count (32 and 64) of the tiny Llama
OPS = {
    "float": "hf_maskllm.sparse_linear",
    "int8": "hf_maskllm.sparse_linear_q",
    "int4": "hf_maskllm.sparse_linear_q",
}


def compressed_llama(dtype: torch.dtype, values: str) -> torch.nn.Module:
    """The tiny Llama, 2:4, with every linear but the head compressed (``values``: float, int8 or int4)."""
    model = to_sparse_layers(merged_model("llama", dtype), trainable=False)
    if values == "float":
        return model
    bits = int(values[3:])
    layers = {name: mod for name, mod in model.named_modules() if isinstance(mod, SparseLinear)}
    quantized = quantize_layers(model, {k: v.values.detach() for k, v in layers.items()}, bits, GROUP_SIZE)
    for name, layer in layers.items():
        qvalues, scales = quantized[name]
        model.set_submodule(
            name,
            QuantizedSparseLinear.from_tensors(
                qvalues, scales, layer.meta, layer.in_features, 2, 4, bits, GROUP_SIZE, layer.bias, dtype
            ),
        )
    return model


def layer_count(model: torch.nn.Module) -> int:
    return sum(isinstance(mod, (SparseLinear, QuantizedSparseLinear)) for mod in model.modules())


class OpLog(TorchDispatchMode):
    """The names of the ops that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def graph_ops(counter: CompileCounterWithBackend) -> list[str]:
    """The ``hf_maskllm`` ops in the FX graphs the counter's backend received."""
    return [
        str(node.target).removesuffix(".default")
        for gm in counter.graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and "hf_maskllm" in str(node.target)
    ]


CASES = [
    (torch.float32, "float"),
    (torch.bfloat16, "float"),
    (torch.bfloat16, "int8"),
    (torch.float32, "int4"),
]


@pytest.mark.parametrize("dtype,values", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_compiled_forward_is_one_graph_of_kernel_ops_and_equals_eager(dtype, values):
    model = compressed_llama(dtype, values)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for length in (7, 5, 3, 6):  # the second length compiles a dynamic graph; then nothing new
            got = compiled(ids[:, :length]).logits
            expected = model(ids[:, :length]).logits
            assert torch.equal(got, expected)  # aot_eager runs the same kernels in the same order
    assert counter.frame_count == 2 and not counters["graph_break"]
    ops = graph_ops(counter)
    # every compressed linear is one opaque kernel node: none was decompressed inside the graph
    assert ops.count(OPS[values]) == 2 * layer_count(model) == len(ops)


def test_eager_calls_skip_the_dispatcher_and_compiled_ones_use_it():
    model = compressed_llama(torch.float32, "float")
    ids = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), OpLog() as log:
        model(ids)
    assert not any(name.startswith("hf_maskllm::") for name in log.names)
    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        torch.compile(model, backend=counter, fullgraph=True)(ids)
    assert graph_ops(counter).count("hf_maskllm.sparse_linear") == layer_count(model)


@pytest.mark.parametrize("dtype,values", CASES[1::2], ids=lambda c: str(c).replace("torch.", ""))
def test_static_cache_generation_compiles_once_and_gives_the_eager_tokens(dtype, values):
    model = compressed_llama(dtype, values)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (1, 6), generator=g) for _ in range(2)]
    kwargs = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
        cache_implementation="static", return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    with torch.no_grad():
        eager = [model.generate(prompt, **kwargs) for prompt in prompts]
        counter = CompileCounterWithBackend("aot_eager")
        model.forward = torch.compile(
            model.forward, backend=counter, fullgraph=True
        )  # as transformers documents
        got = [model.generate(prompts[0], **kwargs)]
        assert counter.frame_count == 2  # the prefill and the decode step: 7 decode steps reuse one graph
        got.append(model.generate(prompts[1], **kwargs))
    assert counter.frame_count == 2 and not counters["graph_break"]  # warm: another prompt compiles nothing
    for compiled, reference in zip(got, eager):
        assert torch.equal(compiled.sequences, reference.sequences)
        for a, b in zip(compiled.logits, reference.logits):
            # AOT autograd's decompositions may round differently
            assert_logits_close(a, b, computed_in=dtype)


def test_the_cpu_recipe_compiles_once_and_gives_the_eager_tokens():
    """docs/kernels.md's CPU recipe: hf_maskllm attention, no guards on the modules' parameters."""
    model = compressed_llama(torch.bfloat16, "int8")
    model.set_attn_implementation("hf_maskllm")
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    kwargs = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
        cache_implementation="static", max_cache_len=32, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    with torch.no_grad():
        eager = model.generate(prompt, **kwargs)
        counter = CompileCounterWithBackend("aot_eager")
        model.forward = torch.compile(
            model.forward, backend=counter, fullgraph=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )  # fmt: skip
        got = model.generate(prompt, **kwargs)
        again = model.generate(prompt, **kwargs)
    assert model.config._attn_implementation == "hf_maskllm"
    assert counter.frame_count == 2 and not counters["graph_break"]  # the prefill and the decode step
    # both graphs (the 6-token prompt and the one-token step: fixed token counts of at most 8) call the C++
    # decode op of the compressed layers directly, one node per layer; the step's attention is the C++
    # decode attention, one node per decoder layer. The prompt's attention is the kernel's too where
    # transformers gives it a mask, SDPA's where it leaves the causal mask out (newer versions).
    ops = graph_ops(counter)
    assert ops.count("hf_maskllm.sparse_decode_q") == 2 * layer_count(model)
    layers = model.config.num_hidden_layers
    attention = [
        [str(node.target).removesuffix(".default") for node in gm.graph.nodes].count(
            "hf_maskllm.decode_attention"
        )
        for gm in counter.graphs
    ]
    assert attention[1] == layers and attention[0] in (0, layers)
    assert len(ops) == 2 * layer_count(model) + sum(attention)
    assert torch.equal(got.sequences, eager.sequences) and torch.equal(again.sequences, eager.sequences)
    for a, b in zip(got.logits, eager.logits):
        # bfloat16: where transformers masks the compiled prompt but not the eager one, the prompt's attention
        # is the kernel's in one and SDPA's in the other, rounded differently
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.slow  # inductor's C++ compilation of the graph takes minutes on a small CPU
def test_inductor_decode_matches_eager():
    # the real backend: inductor compiles the graph around the opaque kernel ops
    model = compressed_llama(torch.bfloat16, "float")
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got, expected = compiled(ids).logits, model(ids).logits
    assert not counters["graph_break"]
    # inductor fuses the norms and rotary embeddings in float32 where eager rounds to bfloat16 between ops
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


# ------------------------------------------------------------------------------------------------
# The registered ops on their own
# ------------------------------------------------------------------------------------------------


def op_case(dtype: torch.dtype, bits: int | None, tokens: int = 3, out_f: int = 20, in_f: int = 64):
    from hf_maskllm.sparse.format import compress

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(out_f, in_f, generator=g)
    groups = weight.view(out_f, -1, 4)
    groups.scatter_(-1, groups.abs().argsort(dim=-1)[..., :2], 0.0)
    values, meta = compress(weight.to(dtype), 2, 4)
    x = torch.randn(tokens, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    if bits is None:
        return x, values, meta, bias
    qvalues, scales = quantize_layers(torch.nn.Module(), {"w": values}, bits, GROUP_SIZE)["w"]
    return x, qvalues, scales, meta, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 12])  # the direct kernel and expand + GEMM
def test_opcheck_float_ops(dtype, tokens):
    x, values, meta, bias = op_case(dtype, None, tokens)
    torch.library.opcheck(torch.ops.hf_maskllm.sparse_linear.default, (x, values, meta, 2, 4, 64, bias))
    torch.library.opcheck(torch.ops.hf_maskllm.sparse_linear.default, (x[None], values, meta, 2, 4, 64, None))
    torch.library.opcheck(torch.ops.hf_maskllm.sparse_expand.default, (values, meta, 2, 4, 64))


@pytest.mark.parametrize("bits", [8, 4])
def test_opcheck_quantized_ops(bits):
    x, qvalues, scales, meta, bias = op_case(torch.float32, bits)
    args = (x, qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 64, bias)
    torch.library.opcheck(torch.ops.hf_maskllm.sparse_linear_q.default, args)
    for tokens in (1, 3):  # the C++ decode op: the same results as the general op
        decode_args = (x[:tokens], qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, bias)
        torch.library.opcheck(torch.ops.hf_maskllm.sparse_decode_q.default, decode_args)
        assert torch.equal(
            torch.ops.hf_maskllm.sparse_decode_q(*decode_args),
            torch.ops.hf_maskllm.sparse_linear_q(
                x[:tokens], qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 64, bias
            ),
        )
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(
            torch.ops.hf_maskllm.sparse_expand_q.default,
            (qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 64, dtype),
        )


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_route_against_float64(bits):
    from hf_maskllm.kernels.cpu_ops import nm_linear_q_cpu
    from hf_maskllm.sparse.format import dequantize

    x, qvalues, scales, meta, bias = op_case(torch.float32, bits, tokens=5, out_f=23, in_f=96)
    dense = dequantize(qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 96, torch.float64)
    expected = x.double() @ dense.T + bias.double()
    # the decode kernel may round x to 8 bits per block of 32 inputs (AVX-512 VNNI, docs/kernels.md):
    # at most half a step of the block's absmax / 127 per input, plus float32 accumulation
    step = x.double().view(5, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1) / 127
    bound = step @ dense.abs().T + 1e-5 * (x.double().abs() @ dense.abs().T + 1)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = route.sparse_linear_q(xd, qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 96, bias)
        assert got.dtype == dtype and got.shape == (5, 23)
        # the route is the kernel's: the same bits as calling it directly
        direct = nm_linear_q_cpu(cpu_kernels(), xd, qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 96, bias)
        assert torch.equal(got, direct)
        ulp = 0.0 if dtype == torch.float32 else 2**-8 * expected.abs()
        reference = xd.double() @ dense.T + bias.to(dtype).double()
        assert ((got.double() - reference).abs() <= bound + ulp).all()
        weight = route.expand_q(qvalues, scales, meta, 2, 4, bits, GROUP_SIZE, 96, dtype)
        assert torch.equal(weight, dense.to(dtype))


def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, values, meta, bias = op_case(torch.bfloat16, None)
    _, qvalues, scales, _, _ = op_case(torch.float32, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.hf_maskllm.sparse_linear(x.view(3, 1, 64), values, meta, 2, 4, 64, bias)
        assert y.shape == (3, 1, 20) and y.dtype == torch.bfloat16
        yq = torch.ops.hf_maskllm.sparse_linear_q(x, qvalues, scales, meta, 2, 4, 4, GROUP_SIZE, 64, None)
        assert yq.shape == (3, 20) and yq.dtype == torch.bfloat16
        w = torch.ops.hf_maskllm.sparse_expand_q(
            qvalues, scales, meta, 2, 4, 4, GROUP_SIZE, 64, torch.float16
        )
        assert w.shape == (20, 64) and w.dtype == torch.float16


def test_int8_dense_layer_op():
    # a dense layer of int8 codes with one float16 scale per row (e.g. a quantized output embedding)
    g = torch.Generator().manual_seed(6)
    qweight = torch.randint(-127, 128, (37, 96), generator=g, dtype=torch.int8)
    scales = (torch.rand(37, generator=g) / 100).half()
    x, bias = torch.randn(3, 96, generator=g), torch.randn(37, generator=g)
    assert route.has_kernel_int8(x, qweight)
    torch.library.opcheck(torch.ops.hf_maskllm.int8_linear.default, (x, qweight, scales, bias))
    weight = qweight.double() * scales.double()[:, None]
    step = x.double().view(3, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1) / 127  # VNNI rounding of x
    bound = step @ weight.abs().T + 1e-5 * (x.double().abs() @ weight.abs().T + 1)
    got = route.int8_linear(x, qweight, scales, bias)
    assert ((got.double() - (x.double() @ weight.T + bias.double())).abs() <= bound).all()
    compiled = torch.compile(
        lambda x: route.int8_linear(x, qweight, scales, bias), backend="aot_eager", fullgraph=True
    )
    assert torch.equal(compiled(x), got)
