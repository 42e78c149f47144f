"""N:M kernels (Triton, run by the interpreter on CPU) against a float64 reference.

TRITON_INTERPRET=1 must be set before the kernels are imported (conftest.py sets it too).
Passing here proves the kernels compute the right thing; it does not prove they compile for a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import pytest
import torch

from hf_maskllm.errors import CheckpointError, ConfigError, MaskLLMError
from hf_maskllm.kernels import GEMV_MAX_TOKENS, nm_linear
from hf_maskllm.kernels.ops import nm_linear_dot, nm_linear_gemv

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="kernel tests run the Triton interpreter on CPU"
)

# ------------------------------------------------------------------------------------------------
# Reference format (written from the contract, independent of hf_maskllm.sparse.format)
# ------------------------------------------------------------------------------------------------


def ref_compress(weight: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the n largest |w| of each group of m; return (values, meta, dense pruned weight)."""
    out, inp = weight.shape
    groups = weight.reshape(out, inp // m, m)
    idx = groups.abs().topk(n, dim=-1).indices.sort(dim=-1).values  # [out, G, n], increasing positions
    values = groups.gather(-1, idx).reshape(out, inp * n // m)
    dense = torch.zeros_like(groups).scatter(-1, idx, groups.gather(-1, idx)).reshape(out, inp)
    # bitstream: kept value j's position at bits [j*b, (j+1)*b), bit k = bit k%8 of byte k//8
    b = math.ceil(math.log2(m))
    pos = idx.reshape(out, -1).to(torch.int64)
    nbytes = math.ceil(pos.shape[1] * b / 8)
    bits = ((pos[:, :, None] >> torch.arange(b)) & 1).reshape(out, -1)
    bits = torch.cat([bits, bits.new_zeros(out, nbytes * 8 - bits.shape[1])], dim=1).reshape(out, nbytes, 8)
    meta = (bits << torch.arange(8)).sum(-1).to(torch.uint8)
    return values, meta, dense


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


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def make_case(tokens, out_f, in_f, dtype, bias, seed=0, lead=None):
    """Random x and 2:4 weight (never zeros); the float64 reference uses the rounded inputs."""
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, in_f) if lead else (tokens, in_f)
    x = torch.randn(shape, generator=g).to(dtype)
    values, meta, dense = ref_compress(torch.randn(out_f, in_f, generator=g).to(dtype), 2, 4)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    ref = x.double() @ dense.double().T + (b.double() if bias else 0.0)
    scale = x.double().abs() @ dense.double().abs().T  # bounds the fp32 accumulation error
    return x, values, meta, b, ref, scale


def assert_close(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(y).any(), f"NaN (unwritten output?) at {torch.isnan(y).nonzero()[:10].tolist()}"
    y, ref = y.double(), ref
    # fp32 accumulation in any order: a few fp32 eps of sum |x||w|
    tol = 4 * torch.finfo(torch.float32).eps * (scale + 1.0)
    if dtype != torch.float32:
        # final cast to fp16/bf16: half an ulp on the GPU; the interpreter truncates bf16 -> one full ulp
        ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))))
        tol = tol + ulp.clamp_min(torch.finfo(dtype).smallest_normal)
    bad = (y - ref).abs() > tol
    if bad.any():
        idx = bad.nonzero()[:10]
        rows = [(i.tolist(), y[tuple(i)].item(), ref[tuple(i)].item(), tol[tuple(i)].item()) for i in idx]
        pytest.fail(f"{int(bad.sum())} mismatches; first (index, got, want, tol): {rows}")


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_kernel(tokens, dtype, bias):
    # out=123 and in=204 (51 groups, odd meta-byte tail) are not multiples of any block size
    x, values, meta, b, ref, scale = make_case(tokens, 123, 204, dtype, bias, seed=tokens)
    out = torch.full((tokens, 123), float("nan"), dtype=dtype)  # poison: every element must be written
    y = nm_linear_gemv(x, values, meta, b, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, ref, scale, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dot_kernel(tokens, dtype, bias):
    x, values, meta, b, ref, scale = make_case(tokens, 123, 200, dtype, bias, seed=100 + tokens)
    out = torch.full((tokens, 123), float("nan"), dtype=dtype)
    y = nm_linear_dot(x, values, meta, b, out=out)
    assert_close(y, ref, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lead", [(2, 5), (2, 40)], ids=["gemv", "dot"])
def test_nm_linear_3d(lead, dtype):
    x, values, meta, b, ref, scale = make_case(None, 70, 96, dtype, True, seed=7, lead=lead)
    y = nm_linear(x, values, meta, 2, 4, 96, b)
    assert y.shape == (*lead, 70) and y.dtype == dtype
    assert_close(y, ref, scale, dtype)


def test_dispatch_boundary_agrees():
    # GEMV_MAX_TOKENS tokens go to the GEMV kernel, one more to tl.dot; both must match the reference
    for tokens in (GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1):
        x, values, meta, _, ref, scale = make_case(tokens, 40, 64, torch.float32, False, seed=tokens)
        assert_close(nm_linear(x, values, meta, 2, 4, 64), ref, scale, torch.float32)


def test_weight_not_symmetric_in_positions():
    # a weight with one kept value per position class: a wrong position decode changes the output
    w = torch.zeros(4, 16)
    for r in range(4):
        for g in range(4):
            w[r, 4 * g + (r + g) % 4] = 1.0 + r + 10 * g
            w[r, 4 * g + (r + g + 1) % 4] = -(2.0 + r + 10 * g)
    values, meta, dense = ref_compress(w, 2, 4)
    x = torch.randn(2, 16)
    ref = x.double() @ dense.double().T
    for fn in (nm_linear_gemv, nm_linear_dot):
        assert_close(fn(x, values, meta), ref, x.double().abs() @ dense.double().abs().T, torch.float32)


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
def test_other_nm_fall_back_to_torch(n, m):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=g)
    values, meta, dense = ref_compress(torch.randn(10, 32, generator=g), n, m)
    y = nm_linear(x, values, meta, n, m, 32)
    assert_close(y, x.double() @ dense.double().T, x.double().abs() @ dense.double().abs().T, torch.float32)


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
        nm_linear_gemv(torch.randn(GEMV_MAX_TOKENS + 1, 16, dtype=torch.float16), values, meta)


# ------------------------------------------------------------------------------------------------
# GPU compilation without a GPU: the interpreter accepts code the GPU compiler rejects
# ------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_maskllm.kernels.nm_gemv import nm24_gemv_kernel
from hf_maskllm.kernels.nm_dot import nm24_dot_kernel
sig = {"x_ptr": "*bf16", "values_ptr": "*bf16", "meta_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16",
       "num_tokens": "i32", "out_features": "i32", "in_features": "i32",
       "stride_xt": "i32", "stride_vn": "i32", "stride_mn": "i32", "stride_ot": "i32"}
def build(fn, constexprs, extra=None, **options):
    src = ASTSource(fn, {**sig, **(extra or {}), **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
build(nm24_gemv_kernel, dict(HAS_BIAS=True, BLOCK_T=1, BLOCK_N=8, BLOCK_K=256), num_warps=4)
build(nm24_gemv_kernel, dict(HAS_BIAS=False, BLOCK_T=16, BLOCK_N=4, BLOCK_K=64), num_warps=4)
ptx = build(nm24_dot_kernel, dict(HAS_BIAS=True, UPCAST=False, INPUT_PRECISION="tf32",
            BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8), {"tokens_bucket": "i32"}, num_warps=4, num_stages=4)
assert "wgmma" in ptx, "the tl.dot kernel should use Hopper wgmma"
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Compile both kernels to sm_90 PTX with Triton's own toolchain (no GPU needed, ~15 s)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
