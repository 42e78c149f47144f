"""bf16 logit gradients accumulated over micro-batches (and two DDP ranks) vs an exact sum, on SmolLM2-135M.

With bf16 logits (the default) autograd sums each micro-batch's logit gradient into ``.grad`` in
bf16, and DDP all-reduces it in bf16. This script measures what that rounding costs against the
float64 sum of float32 micro-batch gradients computed from the same logit values and the same
Gumbel noise, and sets it beside the size of what it is averaged against: the difference between
two exact accumulations that differ only in their Gumbel noise (another seed). Two DDP ranks are
modelled as the average of two accumulations rounded to bf16, as an all-reduce in bf16 does.

Run: HF_HUB_OFFLINE=1 python benchmarks/grad_accumulation.py [--micro 8,16 --seqlen 128]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from run_info import header_lines, run_info

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.data import tokenize_windows
from hf_maskllm.embedded import load_smollm2


def logit_grads(model) -> dict[str, torch.Tensor]:
    return {k: layer.mask_logits.grad for k, layer in model.masked_layers().items()}


def accumulate(bf16, fp32, batches, seed0: int):
    """bf16 ``.grad`` accumulated as the Trainer does (loss / k), and the float64 sum of float32 gradients."""
    bf16.zero_grad(set_to_none=True)
    exact: dict[str, torch.Tensor] = {}
    for i, ids in enumerate(batches):
        torch.manual_seed(seed0 + i)  # the same Gumbel noise for both
        (bf16(input_ids=ids, labels=ids).loss / len(batches)).backward()
        torch.manual_seed(seed0 + i)
        fp32.zero_grad(set_to_none=True)
        (fp32(input_ids=ids, labels=ids).loss / len(batches)).backward()
        for k, g in logit_grads(fp32).items():
            exact[k] = exact.get(k, 0) + g.double()
    return {k: g.clone() for k, g in logit_grads(bf16).items()}, exact


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float(((a[k].double() - b[k]) ** 2).sum()) for k in b)
    den = sum(float((b[k] ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    dot = sum(float((a[k].double() * b[k]).sum()) for k in b)
    na = sum(float((a[k].double() ** 2).sum()) for k in b) ** 0.5
    nb = sum(float((b[k] ** 2).sum()) for k in b) ** 0.5
    return dot / (na * nb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", default="8,16", help="micro-batches per optimizer step")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    bf16 = get_mask_model(model, MaskConfig(prior="magnitude")).train()  # bf16 logits, the default
    fp32 = copy.deepcopy(bf16)
    for layer in fp32.masked_layers().values():
        layer.mask_logits.data = layer.mask_logits.data.float()  # the same values, float32 gradients
    windows = tokenize_windows("wikipedia:train", tokenizer, args.seqlen)
    rows = []
    for k in (int(x) for x in args.micro.split(",")):
        rank_a, rank_b = windows[:k, None], windows[k : 2 * k, None]  # [k, 1, seqlen] each
        acc_a, exact_a = accumulate(bf16, fp32, rank_a, seed0=0)
        acc_b, exact_b = accumulate(bf16, fp32, rank_b, seed0=10_000)
        _, other_noise = accumulate(bf16, fp32, rank_a, seed0=20_000)  # same data, other Gumbel noise
        ddp = {
            n: ((acc_a[n].float() + acc_b[n].float()).to(torch.bfloat16) / 2) for n in acc_a
        }  # bf16 all-reduce
        exact_ddp = {n: (exact_a[n] + exact_b[n]) / 2 for n in exact_a}
        rounded = {n: t.to(torch.bfloat16) for n, t in exact_a.items()}  # the exact sum, rounded once
        rows.append(
            {
                "micro-batches": k,
                "bf16 accumulation vs exact (rel. L2)": rel(acc_a, exact_a),
                "cosine": cosine(acc_a, exact_a),
                "exact sum rounded once to bf16 (rel. L2)": rel(rounded, exact_a),
                "2 DDP ranks, bf16 all-reduce vs exact (rel. L2)": rel(ddp, exact_ddp),
                "other Gumbel noise, exact (rel. L2)": rel(other_noise, exact_a),
            }
        )
        print(rows[-1], flush=True)
    setup = {
        "model": "SmolLM2-135M-Instruct (embedded), 2:4 on all 210 linears, magnitude prior, bf16 logits",
        "data": f"wikipedia:train windows of {args.seqlen} tokens, one per micro-batch",
    }
    info = run_info("benchmarks/grad_accumulation.py")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grad_accumulation.json").write_text(
        json.dumps({**info, "args": vars(args), **setup, "rows": rows}, indent=2) + "\n"
    )
    keys = list(rows[0])
    lines = [
        "# bf16 logit-gradient accumulation vs an exact sum",
        "",
        *header_lines(info),
        "",
        *[f"- {k}: {v}" for k, v in setup.items()],
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---:|" * len(keys),
        *[
            "| " + " | ".join(f"{r[k]:.2e}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
            for r in rows
        ],
    ]
    (out / "grad_accumulation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
