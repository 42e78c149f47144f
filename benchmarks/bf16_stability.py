"""bf16 stability of mask learning: a long run on SmolLM2-135M with the paper's schedules.

The reference's bf16 runs hit NaN near tau = 2. This run trains with bf16 autocast, bf16 logits and
MaskAdamW (the defaults) for ``--steps`` optimizer steps and checks, at every step, the loss, every
logit gradient (before the optimizer step) and every logit (after it) for NaN / inf. Prints a
table of the loss by tau band and the final held-out perplexity; exits non-zero on any non-finite value.

Run (CPU, about 2-3 s per step at the defaults):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/bf16_stability.py --steps 300 --seqlen 128
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from run_info import header_lines, run_info
from transformers import TrainerCallback

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.adapters.config import PAPER_MASK_CONFIG
from hf_maskllm.data import causal_lm_dataset
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.learn import learn_mask
from hf_maskllm.perplexity import evaluate_perplexity
from hf_maskllm.training_args import PAPER_LR_SCHEDULE


class FiniteWatch(TrainerCallback):
    """Counts non-finite gradients (before each optimizer step) and logits (after it); records the loss."""

    def __init__(self) -> None:
        self.bad_grads: list[int] = []
        self.bad_logits: list[int] = []
        self.max_abs_logit = 0.0
        self.max_abs_grad = 0.0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for p in model.parameters():
            if p.requires_grad and p.grad is not None:
                if not torch.isfinite(p.grad).all():
                    self.bad_grads.append(state.global_step + 1)
                    return
                self.max_abs_grad = max(self.max_abs_grad, float(p.grad.abs().max()))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for p in model.parameters():
            if p.requires_grad:
                if not torch.isfinite(p.detach()).all():
                    self.bad_logits.append(state.global_step)
                    return
                self.max_abs_logit = max(self.max_abs_logit, float(p.detach().abs().max()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/bf16_stability.md")
    args = p.parse_args()

    model, tokenizer = load_smollm2()
    # bf16 logits (the default) and the paper's recipe: its temperature range passes tau = 2 mid-run
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude", **PAPER_MASK_CONFIG))
    watch = FiniteWatch()
    start = time.perf_counter()
    trainer = learn_mask(
        mask_model,
        causal_lm_dataset("wikipedia:train", tokenizer, seqlen=args.seqlen),
        max_steps=args.steps,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        gradient_accumulation_steps=1,  # one forward (and mask sample) per step, as measured
        logging_steps=1,
        bf16=True,  # autocast bf16 (also on CPU)
        disable_tqdm=True,
        callbacks=[watch],
        **PAPER_LR_SCHEDULE,  # the paper's cosine decay, as the reference's runs
    )
    seconds = time.perf_counter() - start
    logs = [r for r in trainer.state.log_history if "loss" in r and "tau" in r]
    bad_loss = [
        r["step"] for r in logs if not math.isfinite(r["loss"]) or not math.isfinite(r.get("grad_norm", 0.0))
    ]
    bands = [(4.0, 3.0), (3.0, 2.0), (2.0, 1.0), (1.0, 0.0)]
    info = run_info("benchmarks/bf16_stability.py")
    lines = [
        "# bf16 stability of mask learning: SmolLM2-135M-Instruct",
        "",
        *header_lines(info),
        "",
        f"SmolLM2-135M-Instruct, 2:4, magnitude prior, bf16 autocast + bf16 logits + MaskAdamW, the paper's schedules "
        f"(tau 4 -> 0.05, kappa 100 -> 500); {args.steps} steps x {args.batch_size} x {args.seqlen} tokens, "
        f"lr {args.lr} decaying to 10% with a cosine; {seconds / 60:.1f} min on {torch.get_num_threads()} CPU threads",
        "",
        "| tau band | steps | mean loss | max loss | max grad norm |",
        "|---|---:|---:|---:|---:|",
    ]
    for hi, lo in bands:
        band = [r for r in logs if lo < r["tau"] <= hi]
        if band:
            losses = [r["loss"] for r in band]
            norms = [r.get("grad_norm", float("nan")) for r in band]
            lines.append(
                f"| {hi:g} .. {lo:g} | {len(band)} | {sum(losses) / len(losses):.3f} | {max(losses):.3f} | "
                f"{max(norms):.3g} |"
            )
    mask_model.eval()
    ppl = evaluate_perplexity(
        mask_model, tokenizer, "wikipedia:heldout", seqlen=512, max_windows=args.eval_windows, progress=False
    )
    lines += [
        "",
        f"non-finite: loss/grad-norm at steps {bad_loss or 'none'}; logit grads at steps {watch.bad_grads or 'none'}; "
        f"logits at steps {watch.bad_logits or 'none'}",
        f"largest |logit| {watch.max_abs_logit:.4g}, largest |logit grad| {watch.max_abs_grad:.4g}; "
        f"held-out Wikipedia PPL after training ({args.eval_windows} x 512): {ppl:.2f}",
    ]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    summary = {
        "minutes": seconds / 60,
        "threads": torch.get_num_threads(),
        "nonfinite": {
            "loss_or_grad_norm": bad_loss,
            "logit_grads": watch.bad_grads,
            "logits": watch.bad_logits,
        },
        "max_abs_logit": watch.max_abs_logit,
        "max_abs_logit_grad": watch.max_abs_grad,
        "heldout_wikipedia_ppl": ppl,
        "loss": {"first": logs[0]["loss"], "last": logs[-1]["loss"], "max": max(r["loss"] for r in logs)},
    }
    out.with_suffix(".json").write_text(
        json.dumps({**info, "args": vars(args), "summary": summary, "log": logs}, indent=2) + "\n"
    )
    if bad_loss or watch.bad_grads or watch.bad_logits:
        raise SystemExit("non-finite values: see the table")


if __name__ == "__main__":
    main()
