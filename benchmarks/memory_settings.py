"""Training-state memory per masked weight against held-out quality, for each supported setting.

Every setting starts from the same SparseGPT 2:4 prior of SmolLM2-135M-Instruct and learns for the
same budget (steps x batch x seqlen tokens of Wikipedia train); only the logits' dtype and the
optimizer differ. Bytes are summed over tensors after the run (``training_state_bytes``): the logits,
one gradient per logit (in the logits' dtype), every optimizer state tensor and the callback's state;
per masked weight.
Perplexity: held-out Wikipedia and news (``hf_maskllm.perplexity``), hard masks, of the prior and of
every setting, all in one run.

Run (CPU, about 5 min per setting at 40 steps on one thread):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/memory_settings.py --steps 40
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from run_info import header_lines, run_info
from transformers import TrainerCallback

from hf_maskllm import MaskAdamW, MaskConfig, get_mask_model
from hf_maskllm.data import calibration_tokens, causal_lm_dataset
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.learn import learn_mask
from hf_maskllm.memory import training_state_bytes
from hf_maskllm.perplexity import evaluate_perplexity

BETAS = (0.9, 0.95)
GROUP = {"second_moment": "group"}
SETTINGS = {
    "fp32-adamw": ("float32 logits, torch AdamW (the reference)", "float32", torch.optim.AdamW, {}),
    "fp32-maskadamw-group": (
        "float32 logits, MaskAdamW, per-group second moment",
        "float32",
        MaskAdamW,
        GROUP,
    ),
    "fp32-adamw-nomomentum": (
        "float32 logits, torch AdamW without momentum (beta1 = 0)",
        "float32",
        torch.optim.AdamW,
        {"betas": (0.0, BETAS[1])},
    ),
    "bf16-maskadamw": (
        "bfloat16 logits, MaskAdamW (per-logit 8-bit second moment)",
        "bfloat16",
        MaskAdamW,
        {},
    ),
    "bf16-maskadamw-v16": (
        "bfloat16 logits, MaskAdamW, per-logit bf16 second moment",
        "bfloat16",
        MaskAdamW,
        {"second_moment_bits": 16},
    ),
    "bf16-maskadamw-group": (
        "bfloat16 logits, MaskAdamW, per-group second moment",
        "bfloat16",
        MaskAdamW,
        GROUP,
    ),
    "bf16-maskadamw-group-m": (
        "bfloat16 logits, MaskAdamW, per-group second moment + bf16 momentum",
        "bfloat16",
        MaskAdamW,
        {"momentum_dtype": torch.bfloat16, **GROUP},
    ),
    "bf16-adamw": (
        "bfloat16 logits, torch AdamW (no stochastic rounding)",
        "bfloat16",
        torch.optim.AdamW,
        {},
    ),
}


class FiniteLogits(TrainerCallback):
    """Fails the run on a non-finite logit after any optimizer step."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for p in model.parameters():
            if p.requires_grad and not torch.isfinite(p).all():
                raise RuntimeError(f"non-finite logits at step {state.global_step}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {list(SETTINGS)}")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0, help="data order and Gumbel noise of every setting")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument(
        "--prior-dir", help="a saved SparseGPT prior mask folder to reuse (else computed and saved)"
    )
    p.add_argument("--out", default="benchmarks/results/memory_settings.md")
    args = p.parse_args()

    model, tokenizer = load_smollm2()
    if args.prior_dir and Path(args.prior_dir, "mask_config.json").exists():
        prior_dir = Path(args.prior_dir)
    else:
        calib = calibration_tokens(
            "wikipedia:train", tokenizer, num_samples=args.calib_samples, seqlen=512, seed=0
        )
        prior_dir = Path(args.prior_dir or tempfile.mkdtemp(prefix="prior-"))
        get_mask_model(model, MaskConfig(prior="sparsegpt"), calibration_data=calib).save_pretrained(
            prior_dir
        )
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=args.seqlen)

    def heldout(model) -> dict[str, float]:
        return {
            corpus: evaluate_perplexity(
                model,
                tokenizer,
                f"{corpus}:heldout",
                seqlen=512,
                max_windows=args.eval_windows,
                progress=False,
            )
            for corpus in ("wikipedia", "news")
        }

    model, tokenizer = load_smollm2()
    dense_ppl = heldout(model)
    prior_ppl = heldout(get_mask_model(model, MaskConfig(prior=str(prior_dir))).eval())
    print("dense", json.dumps(dense_ppl), "prior", json.dumps(prior_ppl), flush=True)

    rows = []
    for key in args.settings.split(","):
        label, dtype, optimizer_cls, extra = SETTINGS[key]
        model, tokenizer = load_smollm2()
        mask_model = get_mask_model(model, MaskConfig(prior=str(prior_dir), logits_dtype=dtype))
        masked = sum(layer.out_features * layer.in_features for layer in mask_model.masked_layers().values())
        start = time.perf_counter()
        trainer = learn_mask(
            mask_model,
            train,
            max_steps=args.steps,
            learning_rate=args.lr,
            batch_size=args.batch_size,
            gradient_accumulation_steps=1,  # one forward (and mask sample) per step, as measured
            logging_steps=max(1, args.steps // 10),
            disable_tqdm=True,
            callbacks=[FiniteLogits()],
            optimizer_cls_and_kwargs=(optimizer_cls, {"lr": args.lr, "betas": BETAS, **extra}),
            seed=args.seed,
        )
        seconds = time.perf_counter() - start
        # What the run holds across steps, callback state included (gradients counted at their size).
        held = training_state_bytes(mask_model, trainer.optimizer, trainer.callback_handler.callbacks)
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        ppl = heldout(mask_model.eval())
        gap = {c: (prior_ppl[c] - ppl[c]) / (prior_ppl[c] - dense_ppl[c]) for c in ppl}
        per_weight = {k: v / masked for k, v in held.items()}
        rows.append(
            {
                "key": key,
                "label": label,
                "bytes_per_weight": per_weight,
                "ppl": ppl,
                "gap_closed": gap,
                "seconds": seconds,
                "losses": losses,
            }
        )
        print(key, json.dumps(per_weight), json.dumps(ppl), f"{seconds:.0f}s", flush=True)

    ref = next((r for r in rows if r["key"] == "fp32-adamw"), None)
    tokens = args.steps * args.batch_size * args.seqlen
    info = run_info("benchmarks/memory_settings.py")
    lines = [
        "# Training-state memory against quality: SmolLM2-135M-Instruct",
        "",
        *header_lines(info),
        "",
        f"SmolLM2-135M-Instruct, 2:4, one SparseGPT prior ({args.calib_samples} x 512 calibration tokens) for every "
        f"setting; {args.steps} steps x {args.batch_size} x {args.seqlen} "
        f"tokens ({tokens:,}), lr {args.lr}, betas {BETAS}, weight decay 0.1, seed {args.seed}; held-out {args.eval_windows} x 512 "
        f"tokens per corpus; {torch.get_num_threads()} CPU threads",
        "",
        "Bytes: `training_state_bytes(model, optimizer, callbacks)` after the run (logits, one gradient per "
        "logit at its allocated size, optimizer state, the callback's mask-statistics state), per masked weight. "
        "Gap closed: the share of the prior-to-dense perplexity gap that learning closed.",
        "",
        f"Dense: {dense_ppl['wikipedia']:.2f} / {dense_ppl['news']:.2f}; the prior (hard masks): "
        f"{prior_ppl['wikipedia']:.2f} / {prior_ppl['news']:.2f} (Wikipedia / news).",
        "",
        "| setting | logits | grads | optimizer | callback | bytes / masked weight | Wikipedia | news "
        "| gap closed (wiki / news) | vs fp32 (wiki / news) | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = r["bytes_per_weight"]
        total = b["total"]
        delta = (
            ""
            if ref is None
            else " / ".join(f"{(r['ppl'][c] / ref['ppl'][c] - 1) * 100:+.1f}%" for c in ("wikipedia", "news"))
        )
        gap = " / ".join(f"{r['gap_closed'][c]:.1%}" for c in ("wikipedia", "news"))
        lines.append(
            f"| {r['label']} | {b['params']:.2f} | {b['grads']:.2f} | {b['optimizer']:.2f} | "
            f"{b.get('callbacks', 0.0):.2f} | {total:.2f} | {r['ppl']['wikipedia']:.2f} | {r['ppl']['news']:.2f} | "
            f"{gap} | {delta} | {r['seconds']:.0f} |"
        )
        if any(not math.isfinite(x) for x in r["losses"]):
            lines.append(f"  ({r['key']}: non-finite loss logged)")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    out.with_suffix(".json").write_text(
        json.dumps(
            {**info, "args": vars(args), "dense": dense_ppl, "prior": prior_ppl, "rows": rows}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
