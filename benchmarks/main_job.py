"""The main job as a user runs it (``python -m hf_maskllm learn``, what ``make run`` calls), timed end to end.

Runs the command in a fresh process with the given arguments, then copies its perplexity table,
wall time, per-stage times and the dense / 2:4 continuations into benchmarks/results/main_job.md
and .json (``--name`` for other file names), headed by the command, date, machine (CPU model, the CPU
flags its kernels use, the kernel levels, OMP_NUM_THREADS of the run), versions and git commit.

Run: HF_HUB_OFFLINE=1 python benchmarks/main_job.py [--threads 1] [--name main_job] [-- extra learn arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_info import header_lines, run_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the run (default: all)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument(
        "--name", default="main_job", help="file name of the results (<name>.md, <name>.json)"
    )
    parser.add_argument("--render", help="only rewrite <name>.md from this <name>.json")
    parser.add_argument("learn_args", nargs="*", help="arguments passed to `hf_maskllm learn`")
    args = parser.parse_args()
    if any(a == "--output" or a.startswith("--output=") for a in args.learn_args):
        parser.error(
            "drop --output: this script runs `learn` in a temporary folder and reads its results.json there"
        )
    if args.render:
        write(Path(args.out_dir), json.loads(Path(args.render).read_text()), args.name)
        return
    if args.threads:  # here too, so that the header's environment is the run's
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "hf_maskllm", "learn", "--output", tmp, *args.learn_args]
        start, cpu_start = time.perf_counter(), os.times()
        subprocess.run(command, env=env, check=True)
        wall, cpu_end = time.perf_counter() - start, os.times()
        results = json.loads((Path(tmp) / "results.json").read_text())
        mask_bytes = sum(f.stat().st_size for f in (Path(tmp) / "mask").iterdir() if f.is_file())
    cpu = (cpu_end.children_user + cpu_end.children_system) - (
        cpu_start.children_user + cpu_start.children_system
    )
    meta = {
        "runs": "python -m hf_maskllm learn " + " ".join(args.learn_args),
        "omp_num_threads": env.get("OMP_NUM_THREADS", "unset"),
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "load_average_at_end": round(os.getloadavg()[0], 1),
        "mask_folder_bytes": mask_bytes,
    }
    info = run_info("benchmarks/main_job.py")
    write(Path(args.out_dir), {**info, "args": vars(args), "meta": meta, "results": results}, args.name)


def write(out: Path, data: dict, name: str = "main_job") -> None:
    """<name>.json (everything) and <name>.md (the table, gap closed, continuations)."""
    meta, results = data["meta"], data["results"]
    ppl, seconds = results["perplexity"], results["seconds"]
    dense = next(k for k in ppl if k == "dense")
    prior = next(k for k in ppl if k.startswith("prior"))
    learned = next(k for k in ppl if k.startswith("MaskLLM"))
    closed = {
        c: (ppl[prior][c] - ppl[learned][c]) / (ppl[prior][c] - ppl[dense][c]) for c in ("wikipedia", "news")
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(
        json.dumps({**data, "gap_closed": closed}, indent=1, default=str) + "\n"
    )
    # a results file written before run_info: its command, date, machine and versions are in meta
    header = [*header_lines(data), ""] if "git_commit" in data else []
    lines = [
        "# The main job, end to end",
        "",
        *header,
        *[f"- {k}: {v}" for k, v in meta.items()],
        "",
        "| method | Wikipedia PPL | news PPL | seconds |",
        "|---|---:|---:|---:|",
        *[
            f"| {k} | {ppl[k]['wikipedia']:.2f} | {ppl[k]['news']:.2f} | {seconds[k]:.0f} |"
            for k in (dense, prior, learned)
        ],
        "",
        f"Gap between the prior and dense closed: {closed['wikipedia']:.1%} (Wikipedia), {closed['news']:.1%} (news).",
        "",
        f"Continuations ({results['sample']['decoding']}):",
        "",
    ]
    sample = results["sample"]
    for prompt, d, s in zip(sample["prompts"], sample["dense"], sample["sparse"], strict=True):
        lines += [f"- prompt {prompt!r}", f"  - dense: {d!r}", f"  - 2:4: {s!r}"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
