"""Recovering quality after 2:4 pruning on SmolLM2-135M, keeping the mask: reconstruction, LoRA, direct training.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/recovery.py [--mask wanda|PATH] [--steps 40]

Start: a 2:4 mask on every decoder linear of SmolLM2-135M-Instruct: a saved MaskModel mask folder
(``--mask PATH``, e.g. ``outputs/smollm2-2of4/mask`` from ``python -m hf_maskllm learn``) or a
one-shot mask computed here (``--mask wanda``/``magnitude``). Rows (held-out perplexity, the
protocol of ``benchmarks/quality.py``):

- ``dense``; ``sparsegpt+update``: the SparseGPT baseline (its own mask and weight update);
- ``mask only``: the dense weights times the mask;
- ``+ reconstruction``: ``hf_maskllm.sparse.reconstruct`` (SparseGPT's update for this fixed mask);
- ``+ LoRA``: PEFT LoRA (r, alpha below, all decoder linears) on the loaded compressed mask-only
  model, trained with ``Trainer``, then PEFT's ``merge_and_unload``;
- ``+ direct sparse training``: the kept weights of the loaded compressed model trained with
  ``Trainer`` (everything else frozen), the same token budget as LoRA;
- ``+ reconstruction + direct training``: both, in that order.

Every trained model is checked to be exactly 2:4 before it is scored. Writes
``benchmarks/results/recovery.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mask", default="wanda", help="wanda, magnitude, or a saved MaskModel folder")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--direct-lr", type=float, default=1e-4)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "recovery"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_maskllm
    from hf_maskllm import MaskModel, check_nm
    from hf_maskllm.data import calibration_tokens, causal_lm_dataset
    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.perplexity import evaluate_perplexity
    from hf_maskllm.priors import compute_prior_masks, sparsegpt_prune
    from hf_maskllm.sparse import SparseLinear, reconstruct, save_compressed

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="recovery_"))
    dense, tokenizer = load_smollm2()
    names = [n for n, mod in dense.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    calib = calibration_tokens(
        "wikipedia:train", tokenizer, num_samples=args.calib_samples, seqlen=args.calib_seqlen, seed=0
    )
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=args.seqlen)
    tokens = args.steps * args.batch_size * args.seqlen

    def fresh() -> torch.nn.Module:
        return load_smollm2()[0]

    def ppl(model) -> dict[str, float]:
        model.eval()
        return {
            corpus: evaluate_perplexity(
                model, tokenizer, f"{corpus}:heldout", seqlen=args.eval_seqlen,
                max_windows=args.eval_windows, progress=False,
            )
            for corpus in ("wikipedia", "news")
        }  # fmt: skip

    def fit(model, lr: float, name: str) -> float:
        start = time.perf_counter()
        training_args = TrainingArguments(
            output_dir=str(tmp / name), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
            learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
            weight_decay=0.0, logging_steps=max(1, args.steps // 5), save_strategy="no", report_to="none",
            use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        model.train()
        Trainer(model=model, args=training_args, train_dataset=train).train()
        return time.perf_counter() - start

    def assert_nm(model, what: str) -> None:
        report = check_nm(model, 2, 4)
        if not report.ok or len(report.layers) != len(names):
            raise SystemExit(f"{what}: not exactly 2:4 on {len(names)} layers: {report}")

    # ---- the mask
    if args.mask in ("wanda", "magnitude"):
        masks = compute_prior_masks(
            dense, args.mask, 2, 4, names, calibration=calib, batch_size=8, progress=False
        )
        mask_name = f"{args.mask} (one-shot)"
    else:
        mm = MaskModel.from_pretrained(fresh(), args.mask)
        masks = mm.hard_masks()
        mask_name = f"saved mask {args.mask}"
        del mm
    rows: dict[str, dict] = {}

    def record(name: str, model, seconds: float, **extra) -> None:
        rows[name] = {"ppl": ppl(model), "seconds": round(seconds, 1), **extra}
        print(name, json.dumps(rows[name]), flush=True)

    record("dense", dense, 0.0)

    start = time.perf_counter()
    model = fresh()
    sparsegpt_prune(model, 2, 4, names, calib, batch_size=8, progress=False)
    record("sparsegpt+update (reference, own mask)", model, time.perf_counter() - start)

    with torch.no_grad():
        model = fresh()
        for name, mask in masks.items():
            model.get_submodule(name).weight.mul_(mask)
    assert_nm(model, "mask only")
    record("mask only", model, 0.0)
    save_compressed(model, tmp / "mask_only")

    start = time.perf_counter()
    model = fresh()
    reconstruct(model, calib, masks=masks, batch_size=8, progress=False)
    seconds = time.perf_counter() - start
    assert_nm(model, "+ reconstruction")
    if any(bool(((model.get_submodule(n).weight != 0) & ~masks[n]).any()) for n in names):
        raise SystemExit("reconstruction changed the mask")
    record("+ reconstruction", model, seconds)
    save_compressed(model, tmp / "reconstructed")

    # ---- LoRA on the loaded compressed model (PEFT's own get_peft_model / merge_and_unload)
    loaded = AutoModelForCausalLM.from_pretrained(tmp / "mask_only")
    config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=PROJ)
    peft_model = get_peft_model(loaded, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    seconds = fit(peft_model, args.lora_lr, "lora")
    merged = peft_model.merge_and_unload()
    assert_nm(merged, "+ LoRA")
    record(
        f"+ LoRA (r={args.lora_r}, lr {args.lora_lr})", merged, seconds, trainable=trainable, tokens=tokens
    )

    # ---- direct sparse training of the kept weights
    for start_from, label in (
        ("mask_only", "+ direct sparse training"),
        ("reconstructed", "+ reconstruction + direct training"),
    ):
        loaded = AutoModelForCausalLM.from_pretrained(tmp / start_from)
        for param in loaded.parameters():
            param.requires_grad_(False)
        for module in loaded.modules():
            if isinstance(module, SparseLinear):
                module.values.requires_grad_(True)
        trainable = sum(p.numel() for p in loaded.parameters() if p.requires_grad)
        seconds = fit(loaded, args.direct_lr, label.replace(" ", "_"))
        assert_nm(loaded, label)
        record(f"{label} (lr {args.direct_lr})", loaded, seconds, trainable=trainable, tokens=tokens)

    meta = {
        "command": "HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/recovery.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), shared 2-core CPU machine",
        "versions": {
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "hf_maskllm": hf_maskllm.__version__,
        },
        "mask": mask_name,
        "args": vars(args),
        "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Recovery after 2:4 pruning, keeping the mask (SmolLM2-135M-Instruct, fp32, CPU)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; {meta['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        f"Mask: {mask_name}, every decoder linear ({len(names)} layers). Held-out perplexity, "
        f"{args.eval_windows} x {args.eval_seqlen} tokens per corpus. Training rows: {args.steps} steps x "
        f"{args.batch_size} x {args.seqlen} = {tokens:,} Wikipedia training tokens each, cosine schedule, "
        f"AdamW, no tuning. Calibration: {args.calib_samples} x {args.calib_seqlen} tokens. "
        "Every row below `dense` is exactly 2:4 (checked).",
        "",
        "| row | wikipedia | news | trainable params | wall time |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['ppl']['wikipedia']:.2f} | {row['ppl']['news']:.2f} | "
            f"{row.get('trainable', 0):,} | {row['seconds']:.0f} s |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
