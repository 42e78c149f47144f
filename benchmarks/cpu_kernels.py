"""Per-layer CPU N:M linear: the C++ kernels against dense ``F.linear`` and the machine's own bandwidth.

    PYTHONPATH=. python benchmarks/cpu_kernels.py [--threads 1,2] [--dtypes float32,bfloat16] [--values int8,int4]

For every linear shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536),
a 2:4 weight (random, never zero) is built in enough copies that one pass over them reads about 192 MB
of dense weights (far beyond the caches, as in decoding, where every weight is read once per token),
and each pass is timed, routes interleaved:

- ``dense``: ``F.linear`` on the dense-with-zeros weight (torch's CPU GEMM / GEMV);
- ``direct``: ``nm_linear`` reading ``values`` + ``meta`` (the route for up to 8 tokens), at the best
  instruction set the CPU has and at AVX2;
- ``expand + GEMM``: ``nm_expand`` into a reused buffer, then ``F.linear`` (the route beyond 8 tokens;
  ``hf_maskllm.kernels.cpu_ops.expand_linear``, as shipped).

Both CPU routes run from 2 to 16 tokens, to show the crossover.

Achieved GB/s = bytes of the weight the route reads (dense: the dense weight; direct: values + meta;
expand: values + meta, plus the dense buffer the GEMM reads back) / time. The copy and read
bandwidth of this machine are measured in the same run, on 256 MiB buffers, at each thread count.

Quantized kept values (``--values``, format version 2; the ``quant_rows`` of the JSON): at the linear
shapes of SmolLM2-135M and of Llama-3.2-1B (q/o 2048x2048, k/v 512x2048, gate/up 8192x2048, down
2048x8192), bfloat16 inputs, ``--group-size`` kept values per scale (one or several), each route timed over copies of
at least ``QUANT_PASS_BYTES`` of the weight it reads, interleaved: dense bf16 ``F.linear``, the 2:4
bf16 direct kernel, and ``nm_linear_q_cpu`` (int8 / int4 codes + scales + meta; up to 8 tokens the
direct kernel at the best instruction set and at AVX2 (both round the inputs to 8 bits on their integer
routes, ``vnni`` and ``avx2_q8``; the label names the route); beyond, dequantize + GEMM). GB/s counts codes + scales +
meta.

Writes ``benchmarks/results/cpu_kernels.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from run_info import header_lines, run_info

from hf_maskllm.kernels.cpu_extension import CPU_ISA_LEVELS, cpu_isa, cpu_kernels, set_cpu_isa
from hf_maskllm.kernels.cpu_ops import expand_linear, int8_linear_cpu, nm_linear_q_cpu
from hf_maskllm.sparse.format import compress

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "q/o 576x576": (576, 576),
    "k/v 192x576": (192, 576),
    "gate/up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
}
PASS_BYTES = 192 * 2**20
QUANT_SHAPES = {
    "SmolLM2 q/o 576x576": (576, 576),
    "SmolLM2 k/v 192x576": (192, 576),
    "SmolLM2 gate/up 1536x576": (1536, 576),
    "SmolLM2 down 576x1536": (576, 1536),
    "1B q/o 2048x2048": (2048, 2048),
    "1B k/v 512x2048": (512, 2048),
    "1B gate/up 8192x2048": (8192, 2048),
    "1B down 2048x8192": (2048, 8192),
}
QUANT_PASS_BYTES = 128 * 2**20
OUTPUT_SHAPE = "output 49152x2048 (dense)"  # SmolLM2's vocabulary at the 1B hidden size, tied embedding
OUTPUT_DIMS = (49152, 2048)


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after one warm-up."""
    return interleaved({"fn": fn}, repeats)["fn"]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each function, the functions run in turn within each repeat."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def fresh_build_seconds() -> float:
    """Wall time of building the kernels from scratch (a new cache folder, a new process), as a user's first run."""
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from hf_maskllm.kernels.cpu_extension import cpu_kernels; assert cpu_kernels()",
            ],
            env={**os.environ, "HF_MASKLLM_CACHE": cache},
            check=True,
            capture_output=True,
        )
        return time.perf_counter() - start


def at_isa(level: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the CPU kernels capped at ``level``."""

    def run() -> object:
        set_cpu_isa(level)
        return fn()

    return run


def bandwidth(repeats: int) -> dict:
    a = torch.ones(64 * 2**20)  # 256 MiB of float32
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    return {
        "copy_GBps": 2 * nbytes / seconds(lambda: b.copy_(a), repeats) / 1e9,  # read + write
        "read_GBps": nbytes / seconds(lambda: a.sum(), repeats) / 1e9,
    }


def layers(
    out_f: int, in_f: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(dense, values, meta)`` copies of a random 2:4 weight, about PASS_BYTES of dense weight in all."""
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    copies = max(4, PASS_BYTES // (out_f * in_f * torch.finfo(dtype).bits // 8))
    built = []
    for _ in range(copies):
        w = torch.randn(out_f, in_f, generator=g).to(dtype)
        groups = w.view(out_f, -1, 4)
        groups.scatter_(-1, groups.abs().argsort(dim=-1)[..., :2], 0.0)
        built.append((w, *compress(w, 2, 4)))
    return built


def route_fns(
    ext: ModuleType,
    built: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    isas: list[str],
    best: str,
    dense_bytes: int,
    sparse_bytes: int,
) -> dict[str, tuple[Callable[[], object], int]]:
    """``{route: (one pass over the copies, bytes of weight read per layer)}`` for ``x``'s token count."""
    tokens, in_f = x.shape
    routes = {"dense": (lambda: [F.linear(x, w) for w, _, _ in built], dense_bytes)}
    if tokens <= 16:
        for isa in isas:
            direct = at_isa(isa, lambda: [ext.nm_linear(x, v, m, 2, 4, None) for _, v, m in built])
            routes[f"direct ({isa})"] = (direct, sparse_bytes)
    if tokens >= 2:
        expand = at_isa(best, lambda: [expand_linear(ext, x, v, m, 2, 4, in_f, None) for _, v, m in built])
        routes[f"expand + GEMM ({best})"] = (expand, sparse_bytes + dense_bytes)
    return routes


def random_meta(out_f: int, in_f: int, g: torch.Generator) -> torch.Tensor:
    """2:4 meta bytes with valid position pairs (p0 < p1), uniformly over the six per group."""
    pairs = torch.tensor([p0 | p1 << 2 for p0 in range(4) for p1 in range(p0 + 1, 4)], dtype=torch.uint8)
    nibbles = pairs[torch.randint(0, 6, (out_f, in_f // 4), generator=g)]
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()


def copies_for(nbytes: int) -> int:
    return max(4, -(-QUANT_PASS_BYTES // nbytes))


def quant_routes(
    ext: ModuleType, out_f: int, in_f: int, bits: int, gs: int, tokens: int, isas: list[str], best: str
) -> dict[str, tuple[Callable[[], object], int, int]]:
    """``{route: (one pass over its copies, copies, bytes of weight read per layer)}`` at ``tokens`` bfloat16 tokens."""
    g = torch.Generator().manual_seed(out_f * 13 + in_f + bits)
    kept = in_f // 2
    meta_bytes = out_f * kept // 4
    x = torch.randn(tokens, in_f, generator=g).to(torch.bfloat16)
    routes: dict[str, tuple[Callable[[], object], int, int]] = {}
    dense_bytes = out_f * in_f * 2
    dense = [torch.randn(out_f, in_f, generator=g).to(torch.bfloat16) for _ in range(copies_for(dense_bytes))]
    routes["dense bf16"] = (lambda: [F.linear(x, w) for w in dense], len(dense), dense_bytes)
    if tokens <= 8:
        bf16_bytes = out_f * kept * 2 + meta_bytes
        float_copies = [
            (torch.randn(out_f, kept, generator=g).to(torch.bfloat16), random_meta(out_f, in_f, g))
            for _ in range(copies_for(bf16_bytes))
        ]
        routes[f"2:4 bf16 direct ({best})"] = (
            at_isa(best, lambda: [ext.nm_linear(x, v, m, 2, 4, None) for v, m in float_copies]),
            len(float_copies),
            bf16_bytes,
        )
    quant_bytes = out_f * (kept * bits // 8 + kept // gs * 2) + meta_bytes
    low, high = (-127, 128) if bits == 8 else (0, 256)
    quant = [
        (
            torch.randint(low, high, (out_f, kept * bits // 8), generator=g, dtype=torch.int16).to(
                torch.int8 if bits == 8 else torch.uint8
            ),
            (torch.rand(out_f, kept // gs, generator=g) * 0.01 + 1e-3).to(torch.float16),
            random_meta(out_f, in_f, g),
        )
        for _ in range(copies_for(quant_bytes))
    ]

    def run_quant() -> object:
        return [nm_linear_q_cpu(ext, x, q, s, m, 2, 4, bits, gs, in_f, None) for q, s, m in quant]

    for isa in isas if tokens <= 8 else [best]:
        if tokens <= 8:  # the direct kernel; say which of its routes runs at this instruction set
            set_cpu_isa(isa)
            label = f"2:4 int{bits} direct ({isa}, {ext.nm_linear_q_route(2, 4, gs)} route)"
            set_cpu_isa(None)
        else:
            label = f"2:4 int{bits} dequantize + GEMM ({isa})"
        routes[label] = (
            at_isa(isa, run_quant),
            len(quant),
            quant_bytes + (0 if tokens <= 8 else dense_bytes),
        )
    return routes


def int8_dense_routes(
    ext: ModuleType, out_f: int, in_f: int, tokens: int, isas: list[str]
) -> dict[str, tuple[Callable[[], object], int, int]]:
    """Dense bf16 against the dense int8 layer (one scale per row) at ``tokens`` bfloat16 tokens."""
    g = torch.Generator().manual_seed(out_f + in_f)
    x = torch.randn(tokens, in_f, generator=g).to(torch.bfloat16)
    dense_bytes, int8_bytes = out_f * in_f * 2, out_f * (in_f + 2)
    dense = [torch.randn(out_f, in_f, generator=g).to(torch.bfloat16) for _ in range(copies_for(dense_bytes))]
    quant = [
        (
            torch.randint(-127, 128, (out_f, in_f), generator=g, dtype=torch.int16).to(torch.int8),
            (torch.rand(out_f, generator=g) * 0.01 + 1e-3).to(torch.float16),
        )
        for _ in range(copies_for(int8_bytes))
    ]
    routes = {"dense bf16": (lambda: [F.linear(x, w) for w in dense], len(dense), dense_bytes)}
    for isa in isas:
        set_cpu_isa(isa)
        label = f"dense int8 ({isa}, {ext.int8_linear_route()} route)"
        set_cpu_isa(None)
        run = at_isa(isa, lambda: [int8_linear_cpu(ext, x, q, s, None) for q, s in quant])
        routes[label] = (run, len(quant), int8_bytes)
    return routes


def group_sizes(args: argparse.Namespace) -> list[int]:
    """``--group-size`` as a list (``"8,16,32"``)."""
    return [int(g) for g in str(args.group_size).split(",") if g]


def quant_rows(
    ext: ModuleType, args: argparse.Namespace, threads: int, bandwidths: dict, isas: list[str], best: str
) -> list[dict]:
    rows = []
    cases = [
        (values, gs, shape_name, tokens)
        for values in [v for v in args.values.split(",") if v]
        for gs in group_sizes(args)
        for shape_name in QUANT_SHAPES
        for tokens in [int(t) for t in args.quant_tokens.split(",")]
    ]
    if "int8" in args.values.split(
        ","
    ):  # the output embedding kept dense, stored in int8 (one scale per row)
        cases += [
            ("int8", None, OUTPUT_SHAPE, t) for t in [int(t) for t in args.quant_tokens.split(",")] if t <= 8
        ]
    for values, gs, shape_name, tokens in cases:
        bits = {"int8": 8, "int4": 4}[values]
        if shape_name == OUTPUT_SHAPE:
            routes = int8_dense_routes(ext, *OUTPUT_DIMS, tokens, isas)
        else:
            out_f, in_f = QUANT_SHAPES[shape_name]
            routes = quant_routes(ext, out_f, in_f, bits, gs, tokens, isas, best)
        timed = interleaved({name: fn for name, (fn, _, _) in routes.items()}, args.repeats)
        set_cpu_isa(None)
        per_layer = {name: timed[name] / copies for name, (_, copies, _) in routes.items()}
        for name, (_, _, nbytes) in routes.items():
            gbps = nbytes / per_layer[name] / 1e9
            rows.append(
                {
                    "values": values,
                    "group_size": gs,
                    "threads": threads,
                    "layer": shape_name,
                    "tokens": tokens,
                    "route": name,
                    "us_per_layer": per_layer[name] * 1e6,
                    "speed_vs_dense": per_layer["dense bf16"] / per_layer[name],
                    "GBps": gbps,
                    "of_read_bandwidth": gbps / bandwidths[threads]["read_GBps"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del routes
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--tokens", default="1,2,4,8,16,32,512", help="token counts (both routes run from 2 to 16)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--values", default="int8,int4", help="quantized value types ('' for none)")
    parser.add_argument(
        "--group-size", default="32", help="kept values per scale of the quantized rows; several: 8,16,32"
    )
    parser.add_argument(
        "--quant-tokens",
        default="1,2,4,8,16",
        help="token counts of the quantized rows (> 8: dequantize + GEMM)",
    )
    parser.add_argument("--out", default=str(RESULTS / "cpu_kernels"))
    args = parser.parse_args()
    ext = cpu_kernels()
    if ext is None:
        raise SystemExit("the CPU kernels could not be built (see the warning above)")
    best = cpu_isa()
    isas = [best] + (["avx2"] if CPU_ISA_LEVELS.index(best) > CPU_ISA_LEVELS.index("avx2") else [])
    info = run_info("benchmarks/cpu_kernels.py")
    info["fresh_build_seconds"] = round(fresh_build_seconds(), 1)
    started = time.perf_counter()
    rows, bandwidths, qrows = [], {}, []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bandwidths[threads] = bandwidth(args.repeats)
        print(threads, "threads:", json.dumps(bandwidths[threads]), flush=True)
        for dtype_name in [d for d in args.dtypes.split(",") if d]:
            dtype = getattr(torch, dtype_name)
            for shape_name, (out_f, in_f) in SHAPES.items():
                built = layers(out_f, in_f, dtype)
                dense_bytes = out_f * in_f * built[0][0].element_size()
                sparse_bytes = built[0][1].numel() * built[0][1].element_size() + built[0][2].numel()
                for tokens in [int(t) for t in args.tokens.split(",")]:
                    x = torch.randn(tokens, in_f).to(dtype)
                    routes = route_fns(ext, built, x, isas, best, dense_bytes, sparse_bytes)
                    timed = interleaved({name: fn for name, (fn, _) in routes.items()}, args.repeats)
                    per_layer = {name: t / len(built) for name, t in timed.items()}
                    set_cpu_isa(None)
                    for name, (_, nbytes) in routes.items():
                        rows.append(
                            {
                                "dtype": dtype_name,
                                "threads": threads,
                                "layer": shape_name,
                                "tokens": tokens,
                                "route": name,
                                "us_per_layer": per_layer[name] * 1e6,
                                "speed_vs_dense": per_layer["dense"] / per_layer[name],
                                "GBps": nbytes / per_layer[name] / 1e9,
                                "of_read_bandwidth": nbytes
                                / per_layer[name]
                                / 1e9
                                / bandwidths[threads]["read_GBps"],
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
                del built
        qrows += quant_rows(ext, args, threads, bandwidths, isas, best)

    info["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(
        json.dumps({**info, "bandwidth": bandwidths, "rows": rows, "quant_rows": qrows}, indent=2) + "\n"
    )
    lines = [
        "# CPU N:M linear per layer: the C++ kernels vs dense F.linear vs this machine's bandwidth",
        "",
        *header_lines(info),
        "",
        "Random 2:4 weights of SmolLM2-135M's linear shapes, one pass over ~192 MB of dense weights per "
        f"timing (from memory, not cache), median of {args.repeats} interleaved passes; GB/s counts the bytes "
        "of weight each route reads (direct: values + meta; expand + GEMM: also the dense buffer). Building "
        f"the kernels from scratch (a new cache folder, a new process) took {info['fresh_build_seconds']} s.",
        "",
        "| threads | copy GB/s (read + write) | read GB/s |",
        "|---|---|---|",
    ]
    lines += [f"| {t} | {b['copy_GBps']:.1f} | {b['read_GBps']:.1f} |" for t, b in bandwidths.items()]
    lines += [
        "",
        "| dtype | threads | layer | tokens | route | us / layer | speed vs dense | GB/s | of read bandwidth |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['layer']} | {r['tokens']} | {r['route']} | "
            f"{r['us_per_layer']:.0f} | {r['speed_vs_dense']:.2f}x | {r['GBps']:.1f} | {100 * r['of_read_bandwidth']:.0f}% |"
        )
    if qrows:
        lines += [
            "",
            "Quantized kept values (kept values per scale: the group size column; - for the dense int8 rows, one "
            "scale per row), bfloat16 inputs; GB/s counts codes + scales + meta "
            "(dense: the bf16 weight; 2:4 bf16: values + meta; dequantize + GEMM: also the dense buffer).",
            "",
            "| values | group size | threads | layer | tokens | route | us / layer | speed vs dense bf16 | GB/s | of read bandwidth |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in qrows:
            lines.append(
                f"| {r['values']} | {r['group_size'] or '-'} | {r['threads']} | {r['layer']} | {r['tokens']} | {r['route']} | "
                f"{r['us_per_layer']:.0f} | {r['speed_vs_dense']:.2f}x | {r['GBps']:.1f} | {100 * r['of_read_bandwidth']:.0f}% |"
            )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
