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


def assert_close(
    y: torch.Tensor,
    ref: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    extra: torch.Tensor | None = None,
) -> None:
    """``y`` within fp32 accumulation error (+ one ulp of ``dtype``, + ``extra`` where a route rounds more) of ``ref``."""
    y = y.cpu()
    assert not torch.isnan(y).any(), f"NaN (unwritten output?) at {torch.isnan(y).nonzero()[:10].tolist()}"
    y = y.double()
    # fp32 accumulation in any order: a few fp32 eps of sum |x||w|
    tol = 4 * torch.finfo(torch.float32).eps * (scale + 1.0)
    if extra is not None:
        tol = tol + extra
    if dtype != torch.float32:
        # final cast to fp16/bf16: half an ulp on the GPU; the interpreter truncates bf16 -> one full ulp
        ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))))
        tol = tol + ulp.clamp_min(torch.finfo(dtype).smallest_normal)
    bad = (y - ref).abs() > tol
    if bad.any():
        idx = bad.nonzero()[:10]
        rows = [(i.tolist(), y[tuple(i)].item(), ref[tuple(i)].item(), tol[tuple(i)].item()) for i in idx]
        pytest.fail(f"{int(bad.sum())} mismatches; first (index, got, want, tol): {rows}")


# ------------------------------------------------------------------------------------------------
# Quantized kept values (format version 2), from the format's contract.


def ref_positions(meta: torch.Tensor, kept: int, m: int) -> torch.Tensor:
    """``int64 [out, kept]`` positions (0..m-1) of the kept values: b bits at bit ``j * b`` of each row."""
    b = math.ceil(math.log2(m))
    bits = ((meta.to(torch.int64)[:, :, None] >> torch.arange(8)) & 1).reshape(meta.shape[0], -1)
    bits = bits[:, : kept * b].reshape(meta.shape[0], kept, b)
    return (bits << torch.arange(b)).sum(-1)


def ref_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored ``qvalues`` of integer codes ``[out, kept]``: int8 as is; int4 as nibbles ``code + 8``, even ``j`` low."""
    if bits == 8:
        return codes.to(torch.int8)
    u = (codes.to(torch.int64) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def ref_dequant(qvalues: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """float64 ``[out, kept]``: ``scales[row, j // group_size] * code_j``."""
    if bits == 8:
        codes = qvalues.to(torch.int64)
    else:
        u = qvalues.to(torch.int64)
        codes = torch.stack([u & 15, u >> 4], dim=-1).reshape(u.shape[0], -1) - 8
    return codes.double() * scales.double().repeat_interleave(group_size, dim=1)


def ref_quant_case(
    out_f: int, in_f: int, n: int, m: int, bits: int, group_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes (the full range, int4's -8 included, never all zero), random float16 scales (some
    groups 0), random N:M positions: ``(qvalues, scales, meta, dense float64 [out, in])``."""
    g = torch.Generator().manual_seed(seed)
    _, meta, _ = ref_compress(torch.randn(out_f, in_f, generator=g), n, m)
    kept = in_f // m * n
    low, high = (-127, 127) if bits == 8 else (-8, 7)
    codes = torch.randint(low, high + 1, (out_f, kept), generator=g)
    scales = (torch.rand(out_f, kept // group_size, generator=g) * 0.05 + 1e-3).to(torch.float16)
    scales[torch.rand(scales.shape, generator=g) < 0.05] = 0.0
    qvalues = ref_pack(codes, bits)
    kept_values = ref_dequant(qvalues, scales, bits, group_size)
    cols = (torch.arange(kept) // n * m)[None, :] + ref_positions(meta, kept, m)
    dense = torch.zeros(out_f, in_f, dtype=torch.float64).scatter(1, cols, kept_values)
    return qvalues, scales, meta, dense


def ref_input_rounding(x: torch.Tensor, block: int = 32, levels: int = 127) -> torch.Tensor:
    """Bound on ``|x - dequant(quant(x))|`` per input when each ``block`` inputs of a token are rounded to
    ``levels`` steps of ``absmax / levels`` (half a step, plus float32 slack)."""
    xd = x.double()
    tokens, k = xd.shape
    padded = torch.nn.functional.pad(xd.abs(), (0, (-k) % block))
    amax = padded.view(tokens, -1, block).amax(-1).repeat_interleave(block, dim=1)[:, :k]
    return amax / levels * (0.5 + 1e-4)
