"""Benchmark the 2:4 kernels against dense cuBLAS (F.linear) and PyTorch semi-structured sparsity.

GPU:  PYTHONPATH=. python benchmarks/gpu_kernels.py [--quick] [--out results/gpu_kernels.md]
CPU:  TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gpu_kernels.py --dry-run   (tiny shapes, checks only)

Writes the table to ``--out`` (.md; default ``benchmarks/results/gpu_kernels.md``, none for a dry run) and
every number in it to the .json beside it, headed by the command, date, machine, versions (CUDA and
Triton included) and git commit, and the GPU.

Weights are rotated over more than 240 MB of copies so the 60 MB L2 cannot serve them; every timed
call sequence is captured in a CUDA graph (launch overhead excluded) and timed with CUDA events;
the table shows medians. Each shape is first checked against F.linear on the decompressed weight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from run_info import gpu_info, header_lines, run_info

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096), (1024, 4096)]
BATCHES = [1, 2, 4, 8, 16, 2048]
ROTATE_BYTES = 240e6


def make_24(out_f: int, in_f: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random weight with the 2 smallest |w| of every group of 4 zeroed."""
    w = torch.randn(out_f, in_f, device=device, dtype=torch.float32).reshape(out_f, in_f // 4, 4)
    drop = w.abs().topk(2, dim=-1, largest=False).indices
    return w.scatter(-1, drop, 0.0).reshape(out_f, in_f).to(dtype)


def compress_24(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hf_maskllm.sparse.format.compress when present; otherwise the same 2:4 format, inline."""
    try:
        from hf_maskllm.sparse.format import compress

        return compress(w, 2, 4)
    except ImportError:
        out_f, in_f = w.shape
        g = w.reshape(out_f, in_f // 4, 4)
        idx = (g != 0).float().topk(2, dim=-1, sorted=False).indices.sort(-1).values  # [out, G, 2]
        values = g.gather(-1, idx).reshape(out_f, in_f // 2)
        pos = idx.reshape(out_f, -1).to(torch.int32)
        pad = (-pos.shape[1]) % 4
        pos = F.pad(pos, (0, pad)).reshape(out_f, -1, 4)
        meta = pos[..., 0] | (pos[..., 1] << 2) | (pos[..., 2] << 4) | (pos[..., 3] << 6)
        return values.contiguous(), meta.to(torch.uint8).contiguous()


def time_calls(fns: list, reps: int, use_graph: bool) -> float:
    """Median microseconds per call of fns[i % len(fns)], run back to back (CUDA graph when possible)."""
    calls = max(len(fns), 24)
    for f in fns:  # warm up: autotune, compile, allocate
        f()
    torch.cuda.synchronize()

    def run_all():
        for i in range(calls):
            fns[i % len(fns)]()

    graph = None
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
        except Exception:  # e.g. an op that cannot be captured: time eagerly
            graph = None
    step = graph.replay if graph is not None else run_all
    step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _num(x: float) -> float | None:
    """``None`` for a route that did not run (NaN), which json cannot hold."""
    return None if math.isnan(x) else x


def cells(row: dict) -> list[str]:
    """A row's cells in the markdown table ("-" where a route did not run)."""

    def f(key: str, fmt: str, unit: str = "") -> str:
        return "-" if row.get(key) is None else format(row[key], fmt) + unit

    if "dense_us" not in row:  # a dry run: checked, not timed
        return [str(row["out"]), str(row["in"]), str(row["batch"]), "checked", *["-"] * 8]
    return [
        str(row["out"]), str(row["in"]), str(row["batch"]), f("dense_us", ".1f"), f("nm_us", ".1f"),
        f("nm_speedup", ".2f", "x"), f("nm_gb_s_compressed", ".0f"), f("decode_us", ".1f"), f("dot_us", ".1f"),
        f("expand_us", ".1f"), f("semi_us", ".1f"), f("semi_speedup", ".2f", "x"),
    ]  # fmt: skip


def bench_shape(out_f, in_f, batches, dtype, device, reps, dry_run, rows):
    from hf_maskllm.kernels import nm_linear
    from hf_maskllm.kernels.ops import DECODE_MAX_TOKENS, nm_linear_decode, nm_linear_dot, nm_linear_expand

    w = make_24(out_f, in_f, dtype, device)
    values, meta = compress_24(w)
    sparse_bytes = values.numel() * values.element_size() + meta.numel()
    dense_bytes = w.numel() * w.element_size()
    copies = 1 if dry_run else max(2, math.ceil(ROTATE_BYTES / sparse_bytes))
    dense_copies = 1 if dry_run else max(2, math.ceil(ROTATE_BYTES / dense_bytes))
    ws = [w] + [w.clone() for _ in range(dense_copies - 1)]
    vm = [(values, meta)] + [(values.clone(), meta.clone()) for _ in range(copies - 1)]
    semi = None
    if device == "cuda":
        try:
            from torch.sparse import to_sparse_semi_structured

            semi = [to_sparse_semi_structured(w)] + [
                to_sparse_semi_structured(w.clone()) for _ in range(copies - 1)
            ]
        except Exception as e:  # unsupported build / shape
            print(f"  semi-structured unavailable for {out_f}x{in_f}: {type(e).__name__}: {e}")

    for batch in batches:
        x = torch.randn(batch, in_f, device=device, dtype=dtype)
        # ---- correctness first: both kernels and the dispatcher against F.linear on the dense weight
        ref = F.linear(x.float(), w.float())
        outs = {
            "nm_linear": nm_linear(x, values, meta, 2, 4, in_f),
            "dot": nm_linear_dot(x, values, meta),
            "expand": nm_linear_expand(x, values, meta),
        }
        if batch <= DECODE_MAX_TOKENS:
            outs["decode"] = nm_linear_decode(x, values, meta)
        for name, y in outs.items():
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:
                raise SystemExit(f"WRONG: {name} {out_f}x{in_f} batch {batch}: max rel err {err:.3g}")
        if dry_run:
            rows.append({"out": out_f, "in": in_f, "batch": batch, "checked": True})
            continue
        # ---- timings (us per call)
        t_dense = time_calls([lambda w=w, x=x: F.linear(x, w) for w in ws], reps, True)
        t_nm = time_calls([lambda v=v, m=m, x=x: nm_linear(x, v, m, 2, 4, in_f) for v, m in vm], reps, True)
        # every route at every size, to place the dispatch thresholds (ops.DECODE_MAX_TOKENS,
        # ops.EXPAND_MIN_TOKENS) from measurements
        t_dec = float("nan")
        if batch <= DECODE_MAX_TOKENS:
            t_dec = time_calls([lambda v=v, m=m, x=x: nm_linear_decode(x, v, m) for v, m in vm], reps, True)
        t_dot = time_calls([lambda v=v, m=m, x=x: nm_linear_dot(x, v, m) for v, m in vm], reps, True)
        t_exp = time_calls([lambda v=v, m=m, x=x: nm_linear_expand(x, v, m) for v, m in vm], reps, True)
        t_semi = float("nan")
        if semi is not None:
            try:
                t_semi = time_calls([lambda s=s, x=x: F.linear(x, s) for s in semi], reps, True)
            except Exception as e:
                print(f"  semi-structured failed at batch {batch}: {type(e).__name__}: {e}")
        moved = sparse_bytes + x.numel() * x.element_size() + batch * out_f * x.element_size()
        rows.append({
            "out": out_f, "in": in_f, "batch": batch, "checked": True, "dense_us": t_dense, "nm_us": t_nm,
            "nm_speedup": t_dense / t_nm, "nm_gb_s_compressed": moved / t_nm / 1e3, "decode_us": _num(t_dec),
            "dot_us": t_dot, "expand_us": t_exp, "semi_us": _num(t_semi), "semi_speedup": _num(t_dense / t_semi),
        })  # fmt: skip
        print("  " + " | ".join(cells(rows[-1])), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="three shapes, batches 1/4/16/2048, fewer repeats"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes, correctness only (CPU interpreter)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the markdown table (.md), the .json beside it (default: benchmarks/results/gpu_kernels.md; "
        "a dry run writes only where --out says)",
    )
    args = parser.parse_args()

    if args.dry_run:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run on CPU needs TRITON_INTERPRET=1 in the environment")
        shapes, batches, dtype, reps = [(96, 128), (40, 64)], [1, 3, 16, 20], torch.bfloat16, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU; use --dry-run with TRITON_INTERPRET=1 on CPU")
        device, dtype = "cuda", torch.bfloat16
        shapes, batches, reps = SHAPES, BATCHES, 15
        if args.quick:
            shapes, batches, reps = [(4096, 4096), (14336, 4096), (4096, 14336)], [1, 4, 16, 2048], 7
    torch.manual_seed(0)
    header = (
        "out", "in", "batch", "dense us", "2:4 us", "2:4 speedup", "2:4 GB/s (compressed)",
        "decode kernel us", "tl.dot kernel us", "expand+cuBLAS us", "semi-structured us", "semi speedup",
    )  # fmt: skip
    rows: list[dict] = []
    t0 = time.time()
    for out_f, in_f in shapes:
        print(f"{out_f}x{in_f}", flush=True)
        bench_shape(out_f, in_f, batches, dtype, device, reps, args.dry_run, rows)
        if device == "cuda":
            torch.cuda.empty_cache()
    seconds = time.time() - t0
    gpu = gpu_info(device)
    name = gpu["name"] if device == "cuda" else "CPU (Triton interpreter)"
    info = run_info("benchmarks/gpu_kernels.py")
    info["versions"].update({k: v for k, v in gpu.items() if k != "name"})
    lines = [
        "# 2:4 linear kernels vs dense cuBLAS and semi-structured sparsity",
        "",
        *header_lines(info),
        "",
        f"2:4 linear, {dtype}, {name}, medians of {reps} graph replays ({seconds:.0f} s)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells(r)) + " |" for r in rows),
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    out = args.out or (None if args.dry_run else "benchmarks/results/gpu_kernels.md")
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(table)
        results = {
            **info,
            **({"gpu": gpu} if device == "cuda" else {}),
            "args": vars(args),
            "device": device,
            "dtype": str(dtype),
            "repeats": reps,
            "seconds": seconds,
            "rows": rows,
        }
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
