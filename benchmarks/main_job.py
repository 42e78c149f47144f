"""The main job as a user runs it (``python -m hf_maskllm learn``, what ``make run`` calls), timed end to end.

Runs the command in a fresh process with the given arguments, then copies its perplexity table,
wall time, per-stage times and the dense / 2:4 continuations into benchmarks/results/main_job.md
and .json, with the machine, thread count, date and versions.

Run: HF_HUB_OFFLINE=1 python benchmarks/main_job.py [--threads 1] [-- extra learn arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the run (default: all)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("learn_args", nargs="*", help="arguments passed to `hf_maskllm learn`")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "hf_maskllm", "learn", "--output", tmp, *args.learn_args]
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True)
        wall = time.perf_counter() - start
        results = json.loads((Path(tmp) / "results.json").read_text())
        mask_bytes = sum(f.stat().st_size for f in (Path(tmp) / "mask").iterdir())
    ppl, seconds = results["perplexity"], results["seconds"]
    losses = [r for r in results["log_history"] if "loss" in r]
    meta = {
        "command": "HF_HUB_OFFLINE=1 python benchmarks/main_job.py"
        + (f" --threads {args.threads}" if args.threads else "")
        + (" -- " + " ".join(args.learn_args) if args.learn_args else ""),
        "runs": "python -m hf_maskllm learn " + " ".join(args.learn_args),
        "date": str(date.today()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS={args.threads or 'unset'}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "wall_seconds": round(wall, 1),
        "mask_folder_bytes": mask_bytes,
    }
    dense, prior, learned = (ppl[k] for k in ppl)
    closed = {c: (prior[c] - learned[c]) / (prior[c] - dense[c]) for c in ("wikipedia", "news")}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "main_job.json").write_text(
        json.dumps({"meta": meta, "results": results, "gap_closed": closed}, indent=1, default=str)
    )
    lines = [
        "# The main job, end to end",
        "",
        *[f"- {k}: {v}" for k, v in meta.items()],
        "",
        "| method | Wikipedia PPL | news PPL | seconds |",
        "|---|---:|---:|---:|",
        *[f"| {k} | {v['wikipedia']:.2f} | {v['news']:.2f} | {seconds[k]:.0f} |" for k, v in ppl.items()],
        "",
        f"Gap between the prior and dense closed: {closed['wikipedia']:.1%} (Wikipedia), {closed['news']:.1%} (news).",
        "",
        "Training log (language-model loss; the regulariser apart): "
        + ", ".join(f"step {r['step']}: {r['loss']:.3f}" for r in losses),
        "",
        f"Continuations ({results['sample']['decoding']}):",
        "",
    ]
    sample = results["sample"]
    for prompt, d, s in zip(sample["prompts"], sample["dense"], sample["sparse"], strict=True):
        lines += [f"- prompt {prompt!r}", f"  - dense: {d!r}", f"  - 2:4: {s!r}"]
    (out / "main_job.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
