"""Reference 2:4 format and comparison helpers for the kernel tests (CPU interpreter and GPU).

Written from the format's contract, independent of ``hf_maskllm.sparse.format``.
"""

import math

import pytest
import torch


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


def make_case(tokens, out_f, in_f, dtype, bias, seed=0, lead=None, device="cpu"):
    """Random x and 2:4 weight (never zeros); the float64 reference (on the CPU) uses the rounded inputs."""
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, in_f) if lead else (tokens, in_f)
    x = torch.randn(shape, generator=g).to(dtype)
    values, meta, dense = ref_compress(torch.randn(out_f, in_f, generator=g).to(dtype), 2, 4)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    ref = x.double() @ dense.double().T + (b.double() if bias else 0.0)
    scale = x.double().abs() @ dense.double().abs().T  # bounds the fp32 accumulation error
    x, values, meta = x.to(device), values.to(device), meta.to(device)
    return x, values, meta, b.to(device) if bias else None, ref, scale


def assert_close(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    y = y.cpu()
    assert not torch.isnan(y).any(), f"NaN (unwritten output?) at {torch.isnan(y).nonzero()[:10].tolist()}"
    y = y.double()
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
