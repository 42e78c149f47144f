"""Is the SparseGPT prior the same on another thread count or CPU? float32 against float64 calibration.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/prior_reproducibility.py [--calib-samples 32] [--jobs 2]

The main job's prior, computed several times: SmolLM2-135M-Instruct (embedded), SparseGPT 2:4 masks of
every decoder linear (the targets ``get_mask_model`` picks), ``--calib-samples`` x 512 calibration tokens
of Wikipedia train drawn as ``hf-maskllm learn`` draws them (seed 0), ``compute_prior_masks`` with
``compute_dtype`` float32 and float64, each under several settings: 1 thread, 2 threads, and 1 thread
with the vector code limited to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``,
``ONEDNN_MAX_CPU_ISA=AVX2``: other kernels, other summation orders, as on an older CPU). Every run is
its own process (these settings are read at start-up). Per run: the prior's wall time, the held-out
perplexity of the dense weights under the mask (Wikipedia and news, ``--eval-windows`` x 512 tokens,
evaluated in float32 with the run's settings), and against the first setting of the same dtype the share
of 2:4 groups whose choice differs and the first layer where one does.

Runs with one thread go ``--jobs`` at a time; the two-thread runs run alone, so their times compare the
dtypes' cost. Writes ``benchmarks/results/prior_reproducibility.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from run_info import header_lines, run_info

RESULTS = Path(__file__).resolve().parent / "results"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SETTINGS = {  # name: (threads, extra environment)
    "1 thread": (1, {}),
    "2 threads": (2, {}),
    "1 thread, AVX2": (1, AVX2),
}
DTYPES = ("float32", "float64")


def one_run(dtype: str, threads: int, calib_samples: int, eval_windows: int, out: Path) -> None:
    """In a fresh process: compute the prior, save its masks (packed bits), write its row to ``out``.json."""
    import torch
    from safetensors.numpy import save_file

    from hf_maskllm.adapters.targets import find_targets
    from hf_maskllm.data import calibration_tokens
    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.perplexity import evaluate_perplexity
    from hf_maskllm.priors import compute_prior_masks

    torch.set_num_threads(threads)
    model, tokenizer = load_smollm2()
    model.eval()
    names = find_targets(model, "all-linear", None, 4)
    calib = calibration_tokens("wikipedia:train", tokenizer, num_samples=calib_samples, seqlen=512, seed=0)
    start = time.perf_counter()
    masks = compute_prior_masks(
        model, "sparsegpt", 2, 4, names, calib, progress=False, compute_dtype=getattr(torch, dtype)
    )
    seconds = time.perf_counter() - start
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, mask in masks.items():
            modules[name].weight.mul_(mask)
    ppl = {
        corpus: evaluate_perplexity(
            model, tokenizer, f"{corpus}:heldout", seqlen=512, max_windows=eval_windows, progress=False
        )
        for corpus in ("wikipedia", "news")
    }
    save_file(
        {name: np.packbits(mask.numpy(), axis=-1) for name, mask in masks.items()}, str(out) + ".safetensors"
    )
    row = {
        "prior_seconds": seconds,
        "ppl": ppl,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "layers": names,
    }
    Path(str(out) + ".json").write_text(json.dumps(row))


def launch(dtype: str, setting: str, args: argparse.Namespace, work: Path) -> dict:
    threads, extra = SETTINGS[setting]
    out = work / f"{dtype}-{setting.replace(' ', '_').replace(',', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); from prior_reproducibility import one_run; "
        f"one_run({dtype!r}, {threads}, {args.calib_samples}, {args.eval_windows}, __import__('pathlib').Path({str(out)!r}))"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    row = json.loads(Path(str(out) + ".json").read_text())
    row.update(
        dtype=dtype,
        setting=setting,
        wall_seconds=time.perf_counter() - start,
        masks=str(out) + ".safetensors",
    )
    print(json.dumps({k: v for k, v in row.items() if k != "layers"}), flush=True)
    return row


def compare(row: dict, reference: dict) -> None:
    """Share of 2:4 groups whose kept pair differs from ``reference``'s, and the first layer with one."""
    from safetensors.numpy import load_file

    a, b = load_file(row["masks"]), load_file(reference["masks"])
    differing, total, first = 0, 0, None
    for name in row["layers"]:
        x = np.unpackbits(a[name], axis=-1).reshape(-1, 4)
        y = np.unpackbits(b[name], axis=-1).reshape(-1, 4)
        diff = int((x != y).any(axis=1).sum())
        differing += diff
        total += x.shape[0]
        if diff and first is None:
            first = name
    row["groups_differing"] = differing / total
    row["first_differing_layer"] = first
    row["first_differing_index"] = None if first is None else row["layers"].index(first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib-samples", type=int, default=32, help="as `hf-maskllm learn`'s default")
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--jobs", type=int, default=2, help="one-thread runs at once")
    p.add_argument("--out", default=str(RESULTS / "prior_reproducibility"))
    args = p.parse_args()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="prior-repro-"))
    single = [(d, s) for s in SETTINGS for d in DTYPES if SETTINGS[s][0] == 1]
    multi = [(d, s) for s in SETTINGS for d in DTYPES if SETTINGS[s][0] > 1]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda ds: launch(*ds, args, work), single))
    rows += [launch(d, s, args, work) for d, s in multi]
    rows.sort(key=lambda r: (DTYPES.index(r["dtype"]), list(SETTINGS).index(r["setting"])))
    summary = {}
    for dtype in DTYPES:
        same = [r for r in rows if r["dtype"] == dtype]
        for r in same:
            compare(r, same[0])
        wiki = [r["ppl"]["wikipedia"] for r in same]
        news = [r["ppl"]["news"] for r in same]
        summary[dtype] = {
            "wikipedia_spread": max(wiki) / min(wiki) - 1,
            "news_spread": max(news) / min(news) - 1,
            "max_groups_differing": max(r["groups_differing"] for r in same),
        }
    by = {(r["dtype"], r["setting"]): r for r in rows}
    cost = by[("float64", "2 threads")]["prior_seconds"] / by[("float32", "2 threads")]["prior_seconds"]

    info = run_info("benchmarks/prior_reproducibility.py")
    for r in rows:
        r.pop("layers")
        r.pop("masks")
    payload = {**info, "args": vars(args), "rows": rows, "summary": summary, "float64_cost_2_threads": cost,
               "seconds": time.perf_counter() - started}  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "# The SparseGPT prior across thread counts and CPU code paths",
        "",
        *header_lines(info),
        "",
        f"SmolLM2-135M-Instruct, SparseGPT 2:4 masks of every decoder linear from {args.calib_samples} x 512 "
        "Wikipedia-train calibration tokens (seed 0), the main job's prior; `compute_prior_masks(..., "
        "compute_dtype=...)`, each run in its own process. Perplexity: the dense weights under the mask, "
        f"{args.eval_windows} x 512 held-out tokens per corpus. Groups differing: 2:4 groups whose kept pair "
        "differs from the first row of the same dtype. AVX2: `ATEN_CPU_CAPABILITY=avx2 "
        "MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`. One-thread runs went "
        f"{args.jobs} at a time; the two-thread runs alone.",
        "",
        "| compute dtype | setting | Wikipedia | news | groups differing | first differing layer | prior time |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        first = "none" if r["first_differing_layer"] is None else f"`{r['first_differing_layer']}`"
        lines.append(
            f"| {r['dtype']} | {r['setting']} | {r['ppl']['wikipedia']:.2f} | {r['ppl']['news']:.2f} | "
            f"{r['groups_differing']:.4%} | {first} | {r['prior_seconds']:.0f} s |"
        )
    lines += [""]
    for dtype, s in summary.items():
        lines.append(
            f"- {dtype}: perplexity spread (max / min - 1) {s['wikipedia_spread']:.2%} Wikipedia, "
            f"{s['news_spread']:.2%} news; at most {s['max_groups_differing']:.4%} of groups differ."
        )
    lines += [
        f"- float64 prior time / float32 prior time (2 threads, each run alone): {cost:.2f}x.",
        "",
        f"Whole run: {(time.perf_counter() - started) / 60:.1f} min wall.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
