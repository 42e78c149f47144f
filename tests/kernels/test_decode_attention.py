"""``attn_implementation="hf_maskllm"``: the C++ decode attention against float64, and in models.

The kernel (``hf_maskllm::decode_attention``) on every instruction-set level against a float64 softmax
attention on fresh random inputs: grouped-query heads, masks that broadcast or not, no mask, rows with
nothing to attend, strided queries, head sizes that are and are not multiples of 16. In tiny seeded models
(Llama, Gemma): the same greedy tokens and close logits as ``sdpa`` with static and dynamic caches; a
result that does not depend on the static cache's size; under ``torch.compile(fullgraph=True)`` one op node
per layer in the decode step and none in a longer prompt's forward (SDPA serves it).
"""

from __future__ import annotations

import os

import pytest
import torch
from models import single_thread, tiny_gemma, tiny_llama  # noqa: F401  (autouse fixture)
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from hf_maskllm.kernels import attention
from hf_maskllm.kernels.attention import ATTENTION_NAME, decode_attention
from hf_maskllm.kernels.cpu_extension import CPU_ISA_LEVELS, cpu_isa, cpu_kernels, set_cpu_isa

REQUIRED = os.environ.get("HF_MASKLLM_REQUIRE_CPU_KERNELS") == "1"
pytestmark = [
    pytest.mark.skipif(
        cpu_kernels() is None and not REQUIRED, reason="the CPU kernels could not be built here"
    ),
    pytest.mark.usefixtures("fresh_dynamo"),
]
BEST = cpu_isa() if cpu_kernels() is not None else "scalar"
LEVELS = CPU_ISA_LEVELS[: CPU_ISA_LEVELS.index(BEST) + 1]
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # ~2 ulp of the output's dtype
DTYPES = list(TOL)


@pytest.fixture(params=LEVELS)
def isa(request):
    assert set_cpu_isa(request.param) == request.param
    yield request.param
    set_cpu_isa(None)


def reference(q, k, v, mask, scale):
    """Softmax attention in float64, key / value heads repeated for grouped queries; [B, T, H, Dv]."""
    groups = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q.double() @ k64.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with nothing to attend: zeros
    return (weights @ v64).transpose(1, 2)


def check(out, q, k, v, mask, scale):
    expected = reference(q, k, v, mask, scale)
    assert out.shape == expected.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, rtol=TOL[q.dtype], atol=TOL[q.dtype])


SHAPES = [  # B, H, KVH, T, L, D, Dv
    (1, 32, 8, 1, 48, 64, 64),  # Llama-3.2-1B's heads, one decode token
    (2, 9, 3, 3, 130, 64, 64),  # SmolLM2's heads, three tokens
    (1, 4, 4, 2, 7, 20, 12),  # head sizes not multiples of 16, value size != key size
    (2, 6, 2, 8, 300, 128, 128),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_against_float64(isa, dtype, shape):
    b, h, kvh, t, length, d, dv = shape
    g = torch.Generator().manual_seed(
        100 * LEVELS.index(isa) + 10 * SHAPES.index(shape) + DTYPES.index(dtype)
    )
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, kvh, length, d, generator=g).to(dtype)
    v = torch.randn(b, kvh, length, dv, generator=g).to(dtype)
    scale = d**-0.5
    masks = {
        "none": None,
        "shared": torch.rand(1, 1, 1, length, generator=g) < 0.5,
        "per batch and token": torch.rand(b, 1, t, length, generator=g) < 0.5,
        "per head": torch.rand(b, h, t, length, generator=g) < 0.5,
        "a prefix (a static cache)": (torch.arange(length) < length // 3 + 1).view(1, 1, 1, length),
    }
    for mask in masks.values():
        check(decode_attention(q, k, v, mask, scale), q, k, v, mask, scale)


def test_strided_query_and_cache_views(isa):
    # transformers hands over q as a transposed view [B, H, T, D] of [B, T, H, D]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 8, 64, generator=g).transpose(1, 2)  # [2, 8, 3, 64], not contiguous
    cache_k, cache_v = torch.randn(2, 2, 40, 64, generator=g), torch.randn(2, 2, 40, 64, generator=g)
    k, v = cache_k[:, :, :33], cache_v[:, :, :33]  # views with the cache's strides
    mask = torch.rand(2, 1, 3, 33, generator=g) < 0.7
    check(decode_attention(q, k, v, mask, 0.3), q, k, v, mask, 0.3)


def test_a_row_with_nothing_to_attend_gives_zeros(isa):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 2, 16, generator=g) for _ in range(3))
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    mask[0, 0, 1] = False  # the second token (a padded position) attends nothing
    out = decode_attention(q, k, v, mask, 0.25)
    assert torch.equal(out[0, 1], torch.zeros(2, 16))
    check(out, q, k, v, mask, 0.25)


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 16, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 4, 2000, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(2, 1, 1, 2000, generator=g) < 0.9
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, k, v, mask, 0.125)
        torch.set_num_threads(4)
        four = decode_attention(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)


def test_bad_inputs_are_refused_naming_the_problem():
    q, k = torch.randn(1, 3, 1, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(RuntimeError, match="multiple of the key / value heads"):
        decode_attention(q, k, k, None, 1.0)
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="boolean CPU tensor"):
        decode_attention(q, k, k, torch.zeros(1, 1, 1, 5), 1.0)
    with pytest.raises(RuntimeError, match=r"broadcast to \[1, 4, 1, 5\]"):
        decode_attention(q, k, k, torch.ones(1, 1, 1, 6, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        decode_attention(q, k.double(), k, None, 1.0)


def test_opcheck():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 2, 32, generator=g)
    k, v = torch.randn(1, 2, 9, 32, generator=g), torch.randn(1, 2, 9, 32, generator=g)
    mask = torch.rand(1, 1, 2, 9, generator=g) < 0.6
    for m in (mask, None):
        torch.library.opcheck(torch.ops.hf_maskllm.decode_attention.default, (q, k, v, m, 0.2))


# ------------------------------------------------------------------------------------------------
# In models
# ------------------------------------------------------------------------------------------------


def with_attention(model: torch.nn.Module, name: str) -> torch.nn.Module:
    model.set_attn_implementation(name)
    return model.eval()


GENERATE = dict(
    max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
    return_dict_in_generate=True, output_logits=True,
)  # fmt: skip


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_matches_sdpa(build, cache, monkeypatch):
    calls = []
    monkeypatch.setattr(
        attention, "decode_attention", lambda *args: calls.append(1) or decode_attention(*args)
    )
    model = build(seed=5)
    prompts = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :2] = 0  # left padding in the second row
    kwargs = dict(GENERATE, attention_mask=attention_mask)
    if cache == "static":
        kwargs.update(cache_implementation="static", max_cache_len=64)
    with torch.no_grad():
        expected = with_attention(model, "sdpa").generate(prompts, **kwargs)
        got = with_attention(model, ATTENTION_NAME).generate(prompts, **kwargs)
    # the 9 one-token steps in every layer went to the kernel (the 6-token prompt too)
    assert len(calls) == 10 * model.config.num_hidden_layers
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_static_cache_size_does_not_change_the_result():
    model = with_attention(tiny_llama(seed=6), ATTENTION_NAME)
    prompt = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    runs = []
    with torch.no_grad():
        for size in (16, 500):
            runs.append(model.generate(prompt, **GENERATE, cache_implementation="static", max_cache_len=size))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_decode_step_is_one_op_per_layer_and_gives_the_eager_tokens():
    model = with_attention(tiny_llama(seed=7), ATTENTION_NAME)
    prompt = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
    kwargs = dict(GENERATE, cache_implementation="static", max_cache_len=48)
    with torch.no_grad():
        eager = model.generate(prompt, **kwargs)
        counter = CompileCounterWithBackend("aot_eager")
        model.forward = torch.compile(model.forward, backend=counter, fullgraph=True)
        got = model.generate(prompt, **kwargs)
        again = model.generate(prompt, **kwargs)
    assert counter.frame_count == 2 and not counters["graph_break"]  # the 12-token prompt and the decode step
    per_graph = [
        sum(node.op == "call_function" and "decode_attention" in str(node.target) for node in gm.graph.nodes)
        for gm in counter.graphs
    ]
    # the prompt (12 tokens, more than a decode step) goes to SDPA; the step calls the kernel in every layer
    assert per_graph == [0, model.config.num_hidden_layers]
    assert torch.equal(got.sequences, eager.sequences) and torch.equal(again.sequences, eager.sequences)
    for a, b in zip(got.logits, eager.logits):
        torch.testing.assert_close(a, b)


def test_training_goes_to_sdpa_and_gets_gradients():
    model = with_attention(tiny_llama(seed=8), ATTENTION_NAME).train()
    ids = torch.randint(3, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(8))
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_calls_the_kernel_cannot_serve_go_to_sdpa(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []
    monkeypatch.setattr(
        attention, "decode_attention", lambda *args: calls.append(1) or decode_attention(*args)
    )
    module = tiny_llama(seed=9).model.layers[0].self_attn.eval()
    g = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(1, 4, 1, 16, generator=g),
        torch.randn(1, 2, 6, 16, generator=g),
        torch.randn(1, 2, 6, 16, generator=g),
    )
    cases = {
        "a mask that broadcasts over the keys": dict(attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool)),
        "a float mask": dict(attention_mask=torch.zeros(1, 1, 1, 6)),
    }
    for name, kwargs in cases.items():
        got, _ = attention.decode_attention_forward(module, q, k, v, **kwargs)
        expected, _ = sdpa_attention_forward(module, q, k, v, **kwargs)
        assert torch.equal(got, expected), name
    attention.decode_attention_forward(module, q, k, v, None, dropout=0.1)  # SDPA applies any dropout given
    assert not calls
    for name in ("softcap", "s_aux", "sinks"):  # SDPA would ignore them: refused, naming them
        with pytest.raises(ValueError, match=f"does not support {name}.*attn_implementation='eager'"):
            attention.decode_attention_forward(module, q, k, v, None, **{name: torch.ones(4)})
    gemma4 = type(
        "Gemma4TextAttention",
        (torch.nn.Module,),
        {"__module__": "transformers.models.gemma4.modeling_gemma4"},
    )
    with pytest.raises(ValueError, match="Gemma4TextAttention.*attn_implementation='sdpa'"):
        attention.decode_attention_forward(gemma4(), q, k, v, None)  # its code special-cases "sdpa"
    got, _ = attention.decode_attention_forward(module, q, k, v, None)  # one token, no mask: the kernel
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, None)[0])
    assert calls == [1]
