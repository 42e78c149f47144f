"""N:M kernels (Triton, run by the interpreter on CPU) against a float64 reference.

TRITON_INTERPRET=1 must be set before the kernels are imported (conftest.py sets it too).
Passing here proves the kernels compute the right thing; it does not prove they compile for a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hf_maskllm.errors import CheckpointError, ConfigError, MaskLLMError
from hf_maskllm.kernels import DECODE_MAX_TOKENS, EXPAND_MIN_TOKENS, nm_linear
from hf_maskllm.kernels.ops import (
    nm_decompress_24,
    nm_linear_decode,
    nm_linear_dot,
    nm_linear_expand,
)

triton = pytest.importorskip("triton")

from kernel_reference import assert_close, make_case, ref_compress  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="kernel tests run the Triton interpreter on CPU"
)

# ------------------------------------------------------------------------------------------------
# Reference format (tests/kernel_reference.py, written from the contract)
# ------------------------------------------------------------------------------------------------


def test_ref_compress_matches_the_contract_by_hand():
    # row groups [0, a, 0, b] and [c, 0, d, 0]: positions 1, 3, 0, 2 -> 1 | 3<<2 | 0<<4 | 2<<6 = 141
    w = torch.tensor([[0.0, 5.0, 0.0, -6.0, 7.0, 0.0, 8.0, 0.0]])
    values, meta, dense = ref_compress(w, 2, 4)
    assert values.tolist() == [[5.0, -6.0, 7.0, 8.0]]
    assert meta.tolist() == [[141]]
    assert torch.equal(dense, w)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (2, 8), (3, 8)])
def test_real_format_matches_reference(n, m):
    from hf_maskllm.sparse.format import compress, decompress

    torch.manual_seed(0)
    _, _, dense = ref_compress(torch.randn(7, 48), n, m)
    values, meta = compress(dense, n, m)
    ref_values, ref_meta, _ = ref_compress(dense, n, m)
    assert torch.equal(values, ref_values)
    assert torch.equal(meta, ref_meta)
    assert torch.equal(decompress(values, meta, n, m, 48), dense)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_kernel(tokens, dtype, bias):
    # out=123 and in=204 (51 groups, odd meta-byte tail) are not multiples of any block size
    x, values, meta, b, ref, scale = make_case(tokens, 123, 204, dtype, bias, seed=tokens)
    out = torch.full((tokens, 123), float("nan"), dtype=dtype)  # poison: every element must be written
    y = nm_linear_decode(x, values, meta, b, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_f", [200, 204], ids=["k200", "k204"])
def test_dot_kernel(tokens, dtype, bias, in_f):
    from hf_maskllm.kernels.tma import x_descriptor

    x, values, meta, b, ref, scale = make_case(tokens, 123, in_f, dtype, bias, seed=100 + tokens)
    # rows of 200 elements are 16-byte multiples (TMA descriptor); 204 fp16/bf16 are not (pointers;
    # 204 fp32 rows are: the fp32 pointer path is test_unaligned_activations_take_the_pointer_path)
    assert (x_descriptor(x) is None) == (in_f * x.element_size() % 16 != 0)
    out = torch.full((tokens, 123), float("nan"), dtype=dtype)
    y = nm_linear_dot(x, values, meta, b, out=out)
    assert_close(y, ref, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn,tokens", [(nm_linear_decode, 5), (nm_linear_dot, 33)], ids=["decode", "dot"])
def test_kernels_on_whole_blocks_and_unaligned_values(fn, tokens, dtype):
    # in=256: K a multiple of every BLOCK_K (the EVEN_K path, no masks along K)
    x, values, meta, b, ref, scale = make_case(tokens, 64, 256, dtype, True, seed=11)
    assert_close(fn(x, values, meta, b), ref, scale, dtype)
    # 16-bit values 2 bytes off a 4-byte boundary cannot be read as words: the select path runs
    shifted = torch.empty(values.numel() + 1, dtype=dtype)[1:].view_as(values).copy_(values)
    assert shifted.is_contiguous() and shifted.data_ptr() % 4 == 2
    assert_close(fn(x, shifted, meta, b), ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn,tokens", [(nm_linear_decode, 5), (nm_linear_dot, 33)], ids=["decode", "dot"])
def test_unaligned_activations_take_the_pointer_path(fn, tokens, dtype):
    from hf_maskllm.kernels.tma import x_descriptor

    x, values, meta, b, ref, scale = make_case(tokens, 40, 128, dtype, True, seed=12)
    # rows of x starting one element after a 16-byte boundary: no TMA descriptor (any dtype)
    shifted = torch.empty(x.numel() + 1, dtype=dtype)[1:].view_as(x).copy_(x)
    assert shifted.is_contiguous() and x_descriptor(shifted) is None and x_descriptor(x) is not None
    assert_close(fn(shifted, values, meta, b), ref, scale, dtype)
    # a broadcast row (stride 0) is not a TMA layout either
    assert x_descriptor(x[:1].expand(1, 128).as_strided((1, 128), (0, 1))) is None


@pytest.mark.parametrize("has_desc", [True, False], ids=["x-tma", "x-pointers"])
@pytest.mark.parametrize(
    "fn,module,tokens", [(nm_linear_decode, "nm_decode", 3), (nm_linear_dot, "nm_dot", 40)]
)
def test_every_candidate_config(fn, module, tokens, has_desc):
    # every config the autotuner may pick, run on its own (one config under the interpreter)
    import importlib

    x, values, meta, b, ref, scale = make_case(
        tokens, 48, 128 if has_desc else 132, torch.bfloat16, True, seed=13
    )
    configs = importlib.import_module(f"hf_maskllm.kernels.{module}").candidate_configs(has_desc)
    assert configs
    for config in configs:
        out = torch.full((tokens, 48), float("nan"), dtype=torch.bfloat16)
        assert_close(fn(x, values, meta, b, out=out, config=config), ref, scale, torch.bfloat16)


def test_bias_any_strides_and_dtype_checked():
    x, values, meta, b, ref, scale = make_case(3, 40, 64, torch.bfloat16, True, seed=14)
    strided = torch.stack([b, torch.zeros_like(b)], dim=1)[:, 0]  # stride 2
    assert strided.stride() == (2,)
    for fn in (nm_linear_decode, nm_linear_dot, nm_linear_expand):
        assert_close(fn(x, values, meta, strided), ref, scale, torch.bfloat16)
    with pytest.raises(MaskLLMError, match="bias.to"):
        nm_linear(x, values, meta, 2, 4, 64, b.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lead", [(2, 5), (2, 40)], ids=["decode", "dot"])
def test_nm_linear_3d(lead, dtype):
    x, values, meta, b, ref, scale = make_case(None, 70, 96, dtype, True, seed=7, lead=lead)
    y = nm_linear(x, values, meta, 2, 4, 96, b)
    assert y.shape == (*lead, 70) and y.dtype == dtype
    assert_close(y, ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decompress_kernel_is_exact(dtype):
    # out=37, in=204: partial row and column blocks, odd meta-byte tail; exact, not just close
    g = torch.Generator().manual_seed(21)
    values, meta, dense = ref_compress(torch.randn(37, 204, generator=g).to(dtype), 2, 4)
    assert torch.equal(nm_decompress_24(values, meta, 204), dense)
    shifted = torch.empty(values.numel() + 1, dtype=dtype)[1:].view_as(values).copy_(values)
    assert torch.equal(nm_decompress_24(shifted, meta, 204), dense)  # unaligned: the select path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_route(dtype):
    x, values, meta, b, ref, scale = make_case(5, 37, 204, dtype, True, seed=22)
    assert_close(nm_linear_expand(x, values, meta, b), ref, scale, dtype)


def test_dispatch_boundaries_agree(monkeypatch):
    # each route's last and first token count must match the reference (the expand threshold is
    # lowered so that the test stays small: the boundary logic is what is checked)
    import hf_maskllm.kernels.ops as ops

    monkeypatch.setattr(ops, "EXPAND_MIN_TOKENS", 24)
    calls = []
    for name in ("nm_linear_decode", "nm_linear_dot", "nm_linear_expand"):
        fn = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k)
        )
    for tokens in (DECODE_MAX_TOKENS, DECODE_MAX_TOKENS + 1, 23, 24):
        x, values, meta, _, ref, scale = make_case(tokens, 40, 64, torch.float32, False, seed=tokens)
        assert_close(nm_linear(x, values, meta, 2, 4, 64), ref, scale, torch.float32)
    assert calls == ["nm_linear_decode", "nm_linear_dot", "nm_linear_dot", "nm_linear_expand"]
    assert DECODE_MAX_TOKENS < EXPAND_MIN_TOKENS


def test_weight_not_symmetric_in_positions():
    # a weight with one kept value per position class: a wrong position decode changes the output
    w = torch.zeros(4, 16)
    for r in range(4):
        for g in range(4):
            w[r, 4 * g + (r + g) % 4] = 1.0 + r + 10 * g
            w[r, 4 * g + (r + g + 1) % 4] = -(2.0 + r + 10 * g)
    values, meta, dense = ref_compress(w, 2, 4)
    x = torch.randn(2, 16)
    for dtype in (torch.float32, torch.bfloat16):  # the select expansion and the word expansion
        xd, vd = x.to(dtype), values.to(dtype)
        ref = xd.double() @ dense.to(dtype).double().T
        for fn in (nm_linear_decode, nm_linear_dot):
            assert_close(fn(xd, vd, meta), ref, xd.double().abs() @ dense.double().abs().T, dtype)


def test_torch_compile_fullgraph():
    x, values, meta, b, ref, scale = make_case(3, 24, 32, torch.float32, True, seed=3)

    def f(x):
        return torch.relu(nm_linear(x, values, meta, 2, 4, 32, b)) * 2.0

    # aot_eager: dynamo + fake tensors (what fullgraph needs); inductor also passes but takes ~33 s on CPU
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x), torch.relu(ref) * 2.0, scale * 2.0, torch.float32)


def test_opcheck():
    x, values, meta, b, _, _ = make_case(2, 8, 16, torch.float32, True, seed=4)
    torch.library.opcheck(torch.ops.hf_maskllm.nm_linear.default, (x, values, meta, 2, 4, 16, b))


@pytest.mark.parametrize("n,m", [(1, 4), (2, 8)])
def test_other_nm_and_devices_without_a_kernel_are_refused(n, m, monkeypatch):
    # the kernels are 2:4 Triton ones; SparseLinear routes everything else (tests/sparse/test_linear.py)
    import hf_maskllm.kernels.ops as ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=g)
    values, meta, _ = ref_compress(torch.randn(10, 32, generator=g), n, m)
    with pytest.raises(MaskLLMError, match=rf"2:4 kernels.*got {n}:{m} on cpu.*SparseLinear"):
        nm_linear(x, values, meta, n, m, 32)
    values, meta, _ = ref_compress(torch.randn(10, 32, generator=g), 2, 4)
    monkeypatch.setattr(ops, "_interpret", lambda: False)  # a CPU tensor outside the interpreter
    with pytest.raises(MaskLLMError, match="got 2:4 on cpu"):
        nm_linear(x, values, meta, 2, 4, 32)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_errors():
    x, values, meta, b, _, _ = make_case(2, 8, 16, torch.float16, True)
    with pytest.raises(MaskLLMError, match="in_features=16"):
        nm_linear(torch.randn(2, 12, dtype=torch.float16), values, meta, 2, 4, 16)
    with pytest.raises(MaskLLMError, match="cast x"):
        nm_linear(x.float(), values, meta, 2, 4, 16)
    with pytest.raises(MaskLLMError, match="not supported"):
        nm_linear(x.to(torch.float64), values.double(), meta, 2, 4, 16)
    with pytest.raises(CheckpointError, match="meta"):
        nm_linear(x, values, meta.to(torch.int32), 2, 4, 16)
    with pytest.raises(CheckpointError, match="meta"):
        nm_linear(x, values, meta[:, :1], 2, 4, 16)
    with pytest.raises(CheckpointError, match="values"):
        nm_linear(x, values[:, :4], meta, 2, 4, 16)
    with pytest.raises(MaskLLMError, match="bias"):
        nm_linear(x, values, meta, 2, 4, 16, b[:3])
    with pytest.raises(ConfigError, match="multiple of m"):
        nm_linear(torch.randn(2, 18, dtype=torch.float16), values, meta, 2, 4, 18)
    with pytest.raises(ConfigError):
        nm_linear(x, values, meta, 4, 4, 16)
    with pytest.raises(MaskLLMError, match="tokens"):
        nm_linear_decode(torch.randn(DECODE_MAX_TOKENS + 1, 16, dtype=torch.float16), values, meta)


# ------------------------------------------------------------------------------------------------
# GPU compilation without a GPU: the interpreter accepts code the GPU compiler rejects
# ------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_maskllm.kernels.nm_decode import nm24_decode_kernel
from hf_maskllm.kernels.nm_dot import nm24_dot_kernel
from hf_maskllm.kernels.nm_expand import nm24_expand_kernel
def build(fn, dtype, words, constexprs, extra=None, desc_block=None, **options):
    # desc_block: compile the variant that reads x through a TMA descriptor with this block
    x_desc = f"tensordesc<{dtype}[{desc_block[0]}, {desc_block[1]}]>" if desc_block else f"*{dtype}"
    sig = {"x_ptr": f"*{dtype}", "x_desc": x_desc, "values_ptr": "*i32" if words else f"*{dtype}",
           "meta_ptr": "*u8", "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "num_tokens": "i32",
           "out_features": "i32", "in_features": "i32", "stride_xt": "i32", "stride_vn": "i32",
           "stride_mn": "i32", "stride_ot": "i32"}
    constexprs = {**constexprs, "WORDS": words, "UPCAST": False, "HAS_DESC": bool(desc_block),
                  "X_DESC": bool(desc_block), "INPUT_PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    src = ASTSource(fn, {**sig, **(extra or {}), **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
# fp16 words take the bf16 words' code path with the other 16-bit type (the interpreter tests run both)
for dtype, words in (("bf16", True), ("bf16", False), ("fp32", False)):
    for bn, bk, w, even in ((16, 256, 2, True), (128, 128, 4, False)):
        for desc in (None, (16, bk)):
            ptx = build(nm24_decode_kernel, dtype, words,
                        dict(HAS_BIAS=not even, EVEN_K=even, BLOCK_T=16, BLOCK_N=bn, BLOCK_K=bk),
                        desc_block=desc, num_warps=w)
            assert ("prmt.b32" in ptx) == words, "the word expansion should be byte permutes"
            assert ("cp.async.bulk.tensor" in ptx) == bool(desc), "x through TMA exactly with a descriptor"
            if dtype != "fp32":
                assert ("wgmma" if bn >= 64 else "mma.sync") in ptx, "decode should run on the tensor cores"
    ptx = build(nm24_dot_kernel, dtype, words, dict(HAS_BIAS=True, EVEN_K=False,
                BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8), {"tokens_bucket": "i32"}, num_warps=4, num_stages=4)
    if dtype != "fp32":
        assert "wgmma" in ptx, "the tl.dot kernel should use Hopper wgmma"
    ptx = build(nm24_dot_kernel, dtype, words, dict(HAS_BIAS=False, EVEN_K=True,
                BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8), {"tokens_bucket": "i32"},
                desc_block=(256, 64), num_warps=8, num_stages=3)
    assert "cp.async.bulk.tensor" in ptx, "x should be read by TMA"
    if dtype != "fp32":
        assert "wgmma" in ptx
    sig = {"values_ptr": "*i32" if words else f"*{dtype}", "meta_ptr": "*u8", "out_ptr": f"*{dtype}",
           "out_features": "i32", "in_features": "i32", "stride_vn": "i32", "stride_mn": "i32", "stride_on": "i32"}
    consts = {"WORDS": words, "BLOCK_N": 32, "BLOCK_K": 256}
    src = ASTSource(nm24_expand_kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert ("prmt.b32" in ptx) == words
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Compile all three kernels (bf16 words, select path, fp32) to sm_90 PTX without a GPU."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
