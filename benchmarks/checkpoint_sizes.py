"""Folder sizes and load times of SmolLM2-135M checkpoints: dense bf16, dense-with-zeros, compressed 2:4, mask only.

Run: HF_HUB_OFFLINE=1 python benchmarks/checkpoint_sizes.py [--out benchmarks/checkpoint_sizes.md]
Prints a markdown table (and writes it to --out). The 2:4 mask is the magnitude prior (sizes do not
depend on which mask it is).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.embedded import load_smollm2


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    model, tokenizer = load_smollm2(dtype=torch.bfloat16)
    config = model.config
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "dense")
        dense_state = {k: v.clone() for k, v in model.state_dict().items()}
        mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
        mask_model.save_pretrained(root / "mask")
        mask_model.save_pretrained(root / "zeros", merged=True, dense=True)
        mask_model.save_pretrained(root / "compressed", merged=True)

        def load_dense(name: str):
            return lambda: AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.bfloat16)

        def load_mask():
            base = LlamaForCausalLM(config).to(torch.bfloat16)
            base.load_state_dict(dense_state)
            MaskModel.from_pretrained(base, root / "mask")

        rows = [
            ("dense bf16", "dense", load_dense("dense")),
            ("dense with zeros (2:4, plain transformers)", "zeros", load_dense("zeros")),
            ("compressed 2:4 (hf_maskllm)", "compressed", load_dense("compressed")),
            ("mask only (base model not included)", "mask", load_mask),
        ]
        dense_size = folder_bytes(root / "dense")
        lines = [
            "| checkpoint | folder size | vs dense | load time (best of 3) |",
            "|---|---:|---:|---:|",
        ]
        for label, folder, loader in rows:
            size = folder_bytes(root / folder)
            seconds = timed(loader)
            lines.append(f"| {label} | {size / 1e6:.1f} MB | {size / dense_size:.1%} | {seconds:.2f} s |")
    table = "\n".join(lines)
    print(table)
    print(
        "\nmask-only load time includes building the fresh bf16 base model it attaches to; "
        "sizes include tokenizer files where saved."
    )
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
