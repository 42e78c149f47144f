"""Recovering quality after 2:4 pruning on SmolLM2-135M, keeping the mask: reconstruction, LoRA, direct training.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/recovery.py [--learn-steps 40] [--steps 150]
        [--rows lora,direct,reconstruction-direct,sparsegpt-direct] [--bf16] [--direct-lr 1e-4] [--jobs 1]

One run, one mask. The mask is learned here by the main job's recipe (a SparseGPT prior calibrated on
``wikipedia:train``, then ``learn_mask`` for ``--learn-steps`` steps), so every path's wall time counts
the mask learning; ``--mask PATH`` starts from a saved MaskModel mask folder instead and
``--mask wanda``/``magnitude``/``sparsegpt`` from a one-shot mask. Rows (held-out perplexity, the
protocol of ``benchmarks/quality.py``):

- ``dense``; ``SparseGPT mask only``: the one-shot prior (in ``benchmarks/results/quality_*.md`` the
  best mask-only one-shot method), the reference of the "gap closed" column;
- ``SparseGPT + update``: the SparseGPT baseline with its own weight update;
- ``learned mask only``: the dense weights times the learned mask;
- ``+ reconstruction``: ``hf_maskllm.sparse.reconstruct`` (SparseGPT's update for this fixed mask);
- ``+ LoRA``: PEFT LoRA (rank ``--lora-r``, all decoder linears) on the loaded compressed model,
  trained with ``Trainer`` for ``--steps`` steps, then PEFT's ``merge_and_unload``;
- ``+ direct sparse training``: the kept weights (``SparseLinear.values``) of the loaded compressed
  model trained with ``Trainer``, everything else frozen, the same token budget as LoRA;
- ``+ reconstruction + direct training``: both, in that order;
- ``SparseGPT + update + direct training``: direct training (the same budget) of the SparseGPT
  baseline's kept weights, its own mask, no mask learning: the one-shot path to compare with.

Every row below ``dense`` is checked to be exactly 2:4 before it is scored. Training state: what the row's
training holds across steps (``hf_maskllm.memory.training_state_bytes``: gradients, optimizer state,
callback state, and trainable tensors that are not model weights: logits, LoRA factors) per masked
weight. Path time: wall seconds from the dense model to that row (prior, mask learning,
reconstruction, training), evaluation excluded. ``--jobs 2`` trains the rows in two processes at once
(``--threads`` each), so a row's time is measured beside another row's training: slower, never faster,
than alone. Writes ``benchmarks/results/recovery.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from run_info import header_lines, run_info

RESULTS = Path(__file__).resolve().parent / "results"
# the training rows, in the table's order
TRAIN_ROWS = ("lora", "direct", "reconstruction-direct", "sparsegpt-direct")
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ppl(model, tokenizer, args) -> dict[str, float]:
    from hf_maskllm.perplexity import evaluate_perplexity

    model.eval()
    return {
        corpus: evaluate_perplexity(
            model, tokenizer, f"{corpus}:heldout", seqlen=args.eval_seqlen,
            max_windows=args.eval_windows, progress=False,
        )
        for corpus in ("wikipedia", "news")
    }  # fmt: skip


def _cpu_multiplies_bf16() -> bool | None:
    """Whether this CPU has native bf16 matmul instructions (AVX-512 BF16 or AMX); ``None``: unknown."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _state_per_weight(model, trainer, masked_weights: int, weights_train: bool = False) -> float:
    from hf_maskllm.memory import training_state_bytes

    sizes = training_state_bytes(model, trainer.optimizer, trainer.callback_handler.callbacks)
    held = sizes["total"] - (sizes["params"] if weights_train else 0)  # trained weights are the model
    return round(held / masked_weights, 2)


def _assert_nm(model, what: str, layers: int) -> None:
    from hf_maskllm import check_nm

    report = check_nm(model, 2, 4)
    if not report.ok or len(report.layers) != layers:
        raise SystemExit(f"{what}: not exactly 2:4 on {layers} layers: {report}")


def _fit(model, train, lr: float, name: str, args, tmp: Path):
    from transformers import Trainer, TrainingArguments

    start = time.perf_counter()
    training_args = TrainingArguments(
        output_dir=str(tmp / name), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
        weight_decay=0.0, logging_steps=max(1, args.steps // 5), save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0, seed=0,
        bf16=args.bf16,
    )  # fmt: skip
    model.train()
    trainer = Trainer(model=model, args=training_args, train_dataset=train)
    trainer.train()
    return trainer, time.perf_counter() - start


def _train_row(
    key: str, args, tmp: Path, before: float, layers: int, masked_weights: int
) -> tuple[str, str, dict]:
    """Train one row from its saved compressed start, check it is 2:4 and score it: ``(key, label, row)``."""
    torch.set_num_threads(args.threads)
    # LoRA's initialisation: the same whichever rows ran before, in this process or in a fresh worker
    torch.manual_seed(0)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_maskllm.data import causal_lm_dataset
    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.sparse import SparseLinear, register_lora

    tokenizer = load_smollm2()[1]
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=args.seqlen)
    tokens = args.steps * args.batch_size * args.seqlen
    start_from = {"reconstruction-direct": "reconstructed", "sparsegpt-direct": "sparsegpt"}.get(
        key, "mask_only"
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp / start_from)
    if key == "lora":  # PEFT's own get_peft_model / merge_and_unload on the loaded compressed model
        config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=PROJ)
        peft_model = get_peft_model(loaded, register_lora(config))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        trainer, seconds = _fit(peft_model, train, args.lora_lr, key, args, tmp)
        state = _state_per_weight(peft_model, trainer, masked_weights)
        model = peft_model.merge_and_unload()
        label = f"+ LoRA (r={args.lora_r}, lr {args.lora_lr})"
    else:  # direct sparse training of the kept weights, everything else frozen
        for param in loaded.parameters():
            param.requires_grad_(False)
        for module in loaded.modules():
            if isinstance(module, SparseLinear):
                module.values.requires_grad_(True)
        trainable = sum(p.numel() for p in loaded.parameters() if p.requires_grad)
        trainer, seconds = _fit(loaded, train, args.direct_lr, key, args, tmp)
        state = _state_per_weight(loaded, trainer, masked_weights, weights_train=True)
        model = loaded
        label = {
            "reconstruction-direct": "+ reconstruction + direct training",
            "sparsegpt-direct": "SparseGPT + update + direct training",
        }.get(key, "+ direct sparse training") + f" (lr {args.direct_lr})"
    _assert_nm(model, label, layers)
    row = {"ppl": _ppl(model, tokenizer, args), "seconds": round(seconds, 1)}
    row.update(
        path_seconds=round(before + seconds, 1),
        trainable=trainable,
        tokens=tokens,
        state_bytes_per_weight=state,
    )
    print(label, json.dumps(row), flush=True)
    return key, label, row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--mask", default="learn", help="learn (default), wanda, magnitude, sparsegpt, or a saved mask folder"
    )
    p.add_argument("--learn-steps", type=int, default=40, help="mask-learning steps (the main job's 40)")
    p.add_argument("--learn-lr", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=150, help="training steps of the LoRA and direct rows")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--direct-lr", type=float, default=1e-4)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument(
        "--recon-samples",
        type=int,
        default=None,
        help="calibration sequences of reconstruction (default: --calib-samples)",
    )
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-seqlen", type=int, default=512)
    p.add_argument(
        "--rows",
        default=",".join(TRAIN_ROWS),
        help=f"training rows to run (comma-separated): {', '.join(TRAIN_ROWS)}",
    )
    p.add_argument(
        "--bf16", action="store_true", help="train the LoRA / direct rows under bf16 autocast (fp32 weights)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--jobs", type=int, default=1, help="training rows run at once, in separate processes")
    p.add_argument("--out", default=str(RESULTS / "recovery"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.bf16 and not torch.cuda.is_available() and _cpu_multiplies_bf16() is False:
        print(
            "warning: --bf16 on a CPU without AVX-512 BF16 or AMX: PyTorch emulates bf16 matmuls there and "
            "training steps run many times slower than in float32; drop --bf16 on this machine.",
            file=sys.stderr,
            flush=True,
        )
    train_rows = set(args.rows.split(",")) if args.rows else set()
    if train_rows - set(TRAIN_ROWS):
        p.error(f"--rows: unknown rows {sorted(train_rows - set(TRAIN_ROWS))}")

    import peft

    from hf_maskllm import MaskConfig, MaskModel, get_mask_model
    from hf_maskllm.data import calibration_tokens, causal_lm_dataset
    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.learn import learn_mask
    from hf_maskllm.priors import compute_prior_masks, sparsegpt_prune
    from hf_maskllm.sparse import reconstruct, save_compressed

    started = time.perf_counter()
    cpu_started = sum(os.times()[:4])  # this process and its finished workers
    tmp = Path(tempfile.mkdtemp(prefix="recovery_"))
    dense, tokenizer = load_smollm2()
    names = [n for n, mod in dense.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    masked_weights = sum(dense.get_submodule(n).weight.numel() for n in names)
    calib = calibration_tokens(
        "wikipedia:train", tokenizer, num_samples=args.calib_samples, seqlen=args.calib_seqlen, seed=0
    )
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=args.seqlen)
    tokens = args.steps * args.batch_size * args.seqlen

    def fresh() -> torch.nn.Module:
        return load_smollm2()[0]

    def assert_nm(model, what: str) -> None:
        _assert_nm(model, what, len(names))

    rows: dict[str, dict] = {}

    def record(name: str, model, seconds: float, path_seconds: float, **extra) -> None:
        rows[name] = {
            "ppl": _ppl(model, tokenizer, args),
            "seconds": round(seconds, 1),
            "path_seconds": round(path_seconds, 1),
        }
        rows[name].update(extra)
        print(name, json.dumps(rows[name]), flush=True)

    record("dense", dense, 0.0, 0.0)

    # ---- the one-shot prior, and the mask
    start = time.perf_counter()
    prior_config = MaskConfig(n=2, m=4, prior="sparsegpt", calibration_samples=args.calib_samples,
                              calibration_seqlen=args.calib_seqlen, seed=0)  # fmt: skip
    mm = get_mask_model(fresh(), prior_config, calibration_data=calib)
    prior_seconds = time.perf_counter() - start
    mm.eval()
    record("SparseGPT mask only (one-shot prior)", mm, prior_seconds, prior_seconds)
    reference = rows["SparseGPT mask only (one-shot prior)"]["ppl"]
    if args.mask == "learn":
        start = time.perf_counter()
        trainer = learn_mask(
            mm, train, max_steps=args.learn_steps, learning_rate=args.learn_lr, batch_size=args.batch_size,
            gradient_accumulation_steps=1,  # one forward (and mask sample) per step, as measured
            output_dir=str(tmp / "learn"), seed=0, logging_steps=max(1, args.learn_steps // 10),
            disable_tqdm=True,
        )  # fmt: skip
        mask_seconds = prior_seconds + time.perf_counter() - start
        mask_state = _state_per_weight(
            mm, trainer, masked_weights
        )  # before hard_masks(): eval mode caches the hard masks
        masks = mm.hard_masks()
        learn_tokens = args.learn_steps * args.batch_size * args.seqlen
        mask_name = f"learned: SparseGPT prior + {args.learn_steps} MaskLLM steps ({learn_tokens:,} tokens)"
    elif args.mask in ("wanda", "magnitude", "sparsegpt"):
        start = time.perf_counter()
        masks = (
            mm.hard_masks()
            if args.mask == "sparsegpt"
            else compute_prior_masks(
                dense, args.mask, 2, 4, names, calibration=calib, batch_size=8, progress=False
            )
        )
        mask_seconds = prior_seconds if args.mask == "sparsegpt" else time.perf_counter() - start
        mask_name, mask_state = f"{args.mask} (one-shot)", 0.0
    else:
        mask_name, mask_state, mask_seconds = f"saved mask {args.mask}", 0.0, 0.0
        masks = MaskModel.from_pretrained(fresh(), args.mask).hard_masks()
    del mm

    start = time.perf_counter()
    model = fresh()
    sparsegpt_prune(model, 2, 4, names, calib, batch_size=8, progress=False)
    sparsegpt_seconds = time.perf_counter() - start
    assert_nm(model, "SparseGPT + update")
    record("SparseGPT + update (its own mask)", model, sparsegpt_seconds, sparsegpt_seconds)
    save_compressed(model, tmp / "sparsegpt")

    with torch.no_grad():
        model = fresh()
        for name, mask in masks.items():
            model.get_submodule(name).weight.mul_(mask)
    assert_nm(model, "mask only")
    mask_row = "learned mask only" if args.mask == "learn" else "mask only"
    record(mask_row, model, mask_seconds, mask_seconds, state_bytes_per_weight=mask_state)
    save_compressed(model, tmp / "mask_only")

    start = time.perf_counter()
    model = fresh()
    recon_calib = (
        calib
        if args.recon_samples is None
        else calibration_tokens(
            "wikipedia:train", tokenizer, num_samples=args.recon_samples, seqlen=args.calib_seqlen, seed=0
        )
    )
    reconstruct(model, recon_calib, masks=masks, batch_size=8, progress=False)
    recon_seconds = time.perf_counter() - start
    assert_nm(model, "+ reconstruction")
    if any(bool(((model.get_submodule(n).weight != 0) & ~masks[n]).any()) for n in names):
        raise SystemExit("reconstruction changed the mask")
    record("+ reconstruction", model, recon_seconds, mask_seconds + recon_seconds)
    save_compressed(model, tmp / "reconstructed")

    # ---- the training rows, each from its saved compressed start, --jobs at a time
    before = {
        "lora": mask_seconds,
        "direct": mask_seconds,
        "reconstruction-direct": mask_seconds + recon_seconds,
        "sparsegpt-direct": sparsegpt_seconds,
    }
    # the longest row (LoRA) first, so that the rows after it fill the other process
    order = [
        key for key in ("lora", "sparsegpt-direct", "reconstruction-direct", "direct") if key in train_rows
    ]
    jobs = [(key, args, tmp, before[key], len(names), masked_weights) for key in order]
    at_once = max(1, min(args.jobs, len(order)))
    if at_once > 1:
        with ProcessPoolExecutor(
            max_workers=at_once, mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            trained = {key: (label, row) for key, label, row in pool.map(_train_row, *zip(*jobs))}
    else:
        trained = {key: (label, row) for key, label, row in (_train_row(*job) for job in jobs)}
    for key in TRAIN_ROWS:  # the table's order
        if key in trained:
            label, row = trained[key]
            rows[label] = row

    gap = {
        corpus: {
            name: round(100 * (reference[corpus] - row["ppl"][corpus]) / (reference[corpus] - rows["dense"]["ppl"][corpus]), 1)
            for name, row in rows.items()
        }
        for corpus in ("wikipedia", "news")
    }  # fmt: skip
    info = run_info("benchmarks/recovery.py")
    info["versions"]["peft"] = peft.__version__
    meta = {
        "threads_per_process": torch.get_num_threads(),
        "training_rows_at_once": at_once,
        "mask": mask_name,
        "masked_weights": masked_weights,
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(sum(os.times()[:4]) - cpu_started, 1),
        "gap_closed_percent": gap,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(
        json.dumps({**info, "args": vars(args), **meta, "rows": rows}, indent=2) + "\n"
    )
    best = max((name for name in rows if name != "dense"), key=lambda name: gap["wikipedia"][name])
    lines = [
        "# Recovery after 2:4 pruning, keeping the mask (SmolLM2-135M-Instruct, fp32 weights, CPU)",
        "",
        *header_lines(info),
        "",
        f"{torch.get_num_threads()} thread(s) per process, {at_once} training row(s) at once.",
        "",
        f"Mask: {mask_name}, every decoder linear ({len(names)} layers, {masked_weights:,} weights). "
        f"Held-out perplexity, {args.eval_windows} x {args.eval_seqlen} tokens per corpus. Training rows: "
        f"{args.steps} steps x {args.batch_size} x {args.seqlen} = {tokens:,} Wikipedia training tokens each, "
        f"AdamW, cosine schedule, {'bf16 autocast' if args.bf16 else 'fp32'}, no tuning. Reconstruction and "
        "SparseGPT calibration: "
        f"{args.calib_samples} x {args.calib_seqlen} tokens"
        + (
            ""
            if args.recon_samples is None
            else f" ({args.recon_samples} x {args.calib_seqlen} for reconstruction)"
        )
        + ". Every row below `dense` is exactly 2:4 (checked). "
        "Gap closed: of the gap between the SparseGPT mask only and dense. Path time: wall seconds from the "
        "dense model to the row (prior and mask learning included, evaluation excluded); step: the row's own step."
        + (
            f" The training rows ran {at_once} at a time in separate processes ({args.threads} thread(s) each; "
            f"started in the order {', '.join(order)}): their times were measured beside another row's training."
            if at_once > 1
            else ""
        ),
        "",
        "| row | wikipedia | news | gap closed (wiki / news) | trainable params | state B / masked weight | step | path time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        closed = "" if name == "dense" else f"{gap['wikipedia'][name]:.1f}% / {gap['news'][name]:.1f}%"
        state = row.get("state_bytes_per_weight")
        lines.append(
            f"| {name} | {row['ppl']['wikipedia']:.2f} | {row['ppl']['news']:.2f} | {closed} | "
            f"{row.get('trainable', 0):,} | {'' if state is None else f'{state:.2f}'} | "
            f"{row['seconds']:.0f} s | {row['path_seconds'] / 60:.1f} min |"
        )
    lines += [
        "",
        f"Best path on Wikipedia: {best}: {gap['wikipedia'][best]:.1f}% of the gap closed, "
        f"{rows[best]['path_seconds'] / 60:.1f} min from the dense model. Whole run: "
        f"{meta['seconds'] / 60:.1f} min wall, {meta['cpu_seconds'] / 60:.1f} CPU-min (evaluations included).",
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
