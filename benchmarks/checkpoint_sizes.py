"""Folder sizes, load times and resident memory of SmolLM2-135M checkpoints.

Variants: dense bf16, dense with zeros (2:4, plain transformers), compressed 2:4 (hf_maskllm), and
the mask alone. Each load runs in a fresh subprocess (best of 3 for time) and reads every tensor
once; "resident memory" is the growth of the process's RSS over load + read, on top of the imported
libraries (mask only: the bf16 base plus the logits MaskModel.from_pretrained rebuilds, bf16 by default).

Run: HF_HUB_OFFLINE=1 python benchmarks/checkpoint_sizes.py [--out benchmarks/results/checkpoint_sizes.md]
Writes the table to ``--out`` (.md) and every number in it to the .json beside it.
The mask is the magnitude prior: sizes do not depend on which 2:4 mask it is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from run_info import header_lines, run_info

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.embedded import load_smollm2

REPEATS = 3  # loads per checkpoint, each in a fresh process; the fastest is reported
LOADER = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch, transformers
    import hf_maskllm
    kind, folder, dense = sys.argv[1], sys.argv[2], sys.argv[3]
    def rss_mb():
        status = open("/proc/self/status").read()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    rss0, peak0 = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if kind == "mask":
        model = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
        t_base = time.perf_counter() - start
        model = hf_maskllm.MaskModel.from_pretrained(model, folder)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        t_base = 0.0
    # read every tensor once: safetensors maps files lazily, so untouched weights are not yet resident
    tensors = list(model.parameters()) + list(model.buffers())  # MaskModel.state_dict() holds only logits
    checksum = sum(float(t.detach().float().sum()) for t in tensors)
    seconds = time.perf_counter() - start
    footprint = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "base_seconds": t_base, "rss_mb": rss_mb() - rss0,
                      "peak_mb": peak - peak0, "footprint_mb": footprint}))
    """
)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def load_stats(kind: str, folder: Path, dense: Path, repeats: int = REPEATS) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", LOADER, kind, str(folder), str(dense)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "rss_mb": max(r["rss_mb"] for r in runs), "peak_mb": max(r["peak_mb"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        default="benchmarks/results/checkpoint_sizes.md",
        help="the markdown table (.md); the .json beside it holds every number",
    )
    args = parser.parse_args()
    model, tokenizer = load_smollm2(dtype=torch.bfloat16)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "dense")
        mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
        mask_model.save_pretrained(root / "mask")
        mask_model.save_pretrained(root / "zeros", merged=True, dense=True)
        mask_model.save_pretrained(root / "compressed", merged=True)
        del model, mask_model
        checkpoints = [
            ("dense bf16", "dense", "dense"),
            ("dense with zeros (2:4, plain transformers)", "dense", "zeros"),
            ("compressed 2:4 (hf_maskllm)", "dense", "compressed"),
            ("mask only (+ loading the dense base)", "mask", "mask"),
        ]
        dense_size = folder_bytes(root / "dense")
        for label, kind, folder in checkpoints:
            size = folder_bytes(root / folder)
            stats = load_stats(kind, root / folder, root / "dense")
            rows[folder] = {
                "label": label,
                "folder_bytes": size,
                "vs_dense": size / dense_size,
                "load_seconds": stats["seconds"],
                **(
                    {
                        "base_load_seconds": stats["base_seconds"],
                        "mask_load_seconds": stats["seconds"] - stats["base_seconds"],
                    }
                    if kind == "mask"
                    else {}
                ),
                "rss_mib": stats["rss_mb"],
                "tensor_mib": stats["footprint_mb"],
            }
    info = run_info("benchmarks/checkpoint_sizes.py")
    lines = [
        "# Checkpoint sizes and load times: SmolLM2-135M-Instruct, bf16, 2:4 (magnitude mask)",
        "",
        *header_lines(info),
        "",
        f"Load: a fresh process each time, best of {REPEATS}; memory: its RSS after loading (no forward run yet, so "
        "no decompressed-weight cache).",
        "",
        f"| checkpoint | folder size | vs dense | load time (best of {REPEATS}) | resident memory after load |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows.values():
        seconds = f"{row['load_seconds']:.2f} s"
        if "mask_load_seconds" in row:
            seconds += f" ({row['mask_load_seconds']:.2f} s for the mask)"
        lines.append(
            f"| {row['label']} | {row['folder_bytes'] / 1e6:.1f} MB | {row['vs_dense']:.1%} | {seconds} | "
            f"{row['rss_mib']:.0f} MiB |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({**info, "args": vars(args), "repeats": REPEATS, "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
