"""Command line: ``hf-maskllm learn``, ``zero-shot`` and ``merge`` (also ``python -m hf_maskllm``).

The main job: load a model (default: the embedded real SmolLM2-135M), measure dense perplexity,
build a one-shot prior mask, learn the 2:4 mask with a short Trainer run, print a perplexity
table (dense / prior / learned on held-out Wikipedia and news), save the mask and the merged
compressed model, reload that model and print its continuations of a few prompts beside the dense
model's. ``zero-shot`` runs lm-evaluation-harness tasks on a model, a masked model or a compressed
checkpoint (``hf_maskllm.zero_shot``). ``merge`` applies a saved mask to a dense checkpoint on disk and
writes the compressed checkpoint, shard by shard (``hf_maskllm.merge_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .adapters.config import MaskConfig
from .zero_shot import PAPER_TASKS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-maskllm", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="command")
    learn = sub.add_parser("learn", help="learn an N:M mask and report perplexity (the default command)")
    learn.add_argument(
        "--model", default="smollm2", help="'smollm2' (embedded, offline) or a folder / Hub id"
    )
    learn.add_argument(
        "--prior",
        nargs="+",
        default=["sparsegpt"],
        help="magnitude | wanda | sparsegpt | none | saved mask folder or repo id; several add their prior "
        "terms (transfer to a domain: --prior <general mask> sparsegpt)",
    )
    learn.add_argument("--n", type=int, default=2)
    learn.add_argument("--m", type=int, default=4)
    learn.add_argument(
        "--steps",
        type=int,
        default=40,
        help="optimizer steps of mask learning (0: score and save the prior alone, e.g. a published mask)",
    )
    learn.add_argument(
        "--lr", type=float, default=5e-4, help="learning rate of the logits (the reference value)"
    )
    learn.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="constant learning rate (default), or the paper's cosine decay to 10%% of --lr",
    )
    learn.add_argument(
        "--tau",
        type=float,
        nargs=2,
        metavar=("START", "END"),
        default=list(MaskConfig.tau),
        help="Gumbel temperature, annealed linearly from START to END (default: %(default)s; the paper's: 4.0 0.05)",
    )
    learn.add_argument(
        "--prior-strength",
        type=float,
        default=MaskConfig.prior_strength,
        help="alpha of the prior rule: the prior's pattern leads in each group by about alpha x --init-std "
        "at the start (default: %(default)s; the paper's: 3.0)",
    )
    learn.add_argument(
        "--wanda-strength",
        type=float,
        default=MaskConfig.wanda_strength,
        help="beta of the Wanda order of each group's starting candidates (default: 4.0 with a wanda or "
        "sparsegpt prior, which calibrate on the training data; 0: the paper's start)",
    )
    learn.add_argument(
        "--init-std",
        type=float,
        default=MaskConfig.init_std,
        help="std of the logits' random init (default: %(default)s, the paper's)",
    )
    learn.add_argument(
        "--kappa",
        type=float,
        nargs=2,
        metavar=("START", "END"),
        default=list(MaskConfig.kappa),
        help="logit scale kappa, annealed linearly from START to END (default: %(default)s; the paper's: 100 500)",
    )
    learn.add_argument(
        "--lm-weight",
        type=float,
        default=MaskConfig.lm_weight,
        help="weight of the language-model loss (default: %(default)s, the paper's)",
    )
    learn.add_argument(
        "--distill-logits",
        type=float,
        default=MaskConfig.distill_logits,
        help="weight of the KL to the unmasked model's next-token distribution (default: 1.0 for a causal "
        "LM; 0: the paper's objective, the language-model loss alone)",
    )
    learn.add_argument(
        "--distill-temperature",
        type=float,
        default=MaskConfig.distill_temperature,
        help="temperature of that KL",
    )
    learn.add_argument(
        "--distill-hidden",
        type=float,
        default=MaskConfig.distill_hidden,
        help="weight of the normalised MSE to the unmasked model's hidden states after every block (0: off)",
    )
    learn.add_argument(
        "--batch-size",
        type=int,
        default=2,
        help="sequences per micro-batch, sharing one mask sample (1: one sample per sequence, as the reference)",
    )
    learn.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    learn.add_argument("--seqlen", type=int, default=256, help="tokens per training sequence")
    learn.add_argument("--calib-samples", type=int, default=32, help="calibration sequences for the prior")
    learn.add_argument("--calib-seqlen", type=int, default=512)
    learn.add_argument("--eval-windows", type=int, default=16, help="held-out windows per corpus")
    learn.add_argument("--eval-seqlen", type=int, default=512)
    learn.add_argument(
        "--train-data", default="wikipedia:train", help="texts to learn on (see hf_maskllm.data)"
    )
    learn.add_argument(
        "--mask-name",
        default="default",
        help="name of the learned mask; saved in <output>/mask/<name> unless 'default' (then <output>/mask)",
    )
    learn.add_argument("--output", default="outputs/smollm2-2of4", help="where the mask and sparse model go")
    learn.add_argument("--seed", type=int, default=0)
    learn.add_argument("--no-merged", action="store_true", help="do not write the compressed sparse model")
    learn.add_argument(
        "--save-logits", action="store_true", help="also save the fp32 logits (to resume / transfer)"
    )
    learn.add_argument(
        "--sample-tokens",
        type=int,
        default=32,
        help="new tokens of the dense and sparse continuations printed at the end (0: none)",
    )
    zero_shot = sub.add_parser(
        "zero-shot", help="zero-shot accuracy with lm-evaluation-harness (pip install 'hf_maskllm[eval]')"
    )
    zero_shot.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded), or a folder / Hub id: a dense model or a compressed N:M checkpoint",
    )
    zero_shot.add_argument(
        "--mask",
        default=None,
        help="a saved or published mask (folder, repo id, mask_compressed.npz or mask.npz)",
    )
    zero_shot.add_argument(
        "--tasks",
        default=",".join(PAPER_TASKS),
        help="comma-separated lm-eval tasks (default: the MaskLLM paper's)",
    )
    zero_shot.add_argument("--limit", type=float, default=None, help="documents per task (below 1: a share)")
    zero_shot.add_argument("--batch-size", type=int, default=1)
    zero_shot.add_argument("--include-path", default=None, help="a folder of your own lm-eval task files")
    zero_shot.add_argument("--output", default=None, help="write the results as JSON to this file")
    merge = sub.add_parser(
        "merge",
        help="apply a saved mask to a dense safetensors checkpoint and write the compressed N:M checkpoint, "
        "one tensor at a time (peak memory measured at 1.27x the whole dense checkpoint for a 1.2B model with "
        "500 MB output files: docs/scale.md)",
    )
    merge.add_argument("--model", required=True, help="the dense checkpoint: a folder or Hub id")
    merge.add_argument(
        "--mask",
        required=True,
        help="a saved or published mask: an hf_maskllm mask folder, NVlabs' mask_compressed.npz or PATCH's "
        "mask.npz (the file, a folder holding it, or a Hub repo id)",
    )
    merge.add_argument("--output", required=True, help="the folder to write")
    merge.add_argument("--max-shard-size", default="2GB", help="the largest output file (e.g. 500MB, 2GB)")
    merge.add_argument("--n", type=int, default=None, help="N of an .npz mask (default: its pattern, else 2)")
    merge.add_argument("--m", type=int, default=None, help="M of an .npz mask (default: its pattern, else 4)")
    merge.add_argument(
        "--exclude-modules",
        nargs="+",
        default=None,
        help="layers an .npz mask leaves dense (names or name suffixes)",
    )
    for command in (learn, merge):
        _add_value_options(command)
    return p


def _add_value_options(command: argparse.ArgumentParser) -> None:
    """``--values`` / ``--group-size``: how the compressed checkpoint stores its kept values."""
    command.add_argument(
        "--values",
        choices=("float", "int8", "int4"),
        default="float",
        help="kept values of the compressed model: the model's float dtype (default), or int8 / int4 with "
        "one float16 scale per --group-size kept values (round-to-nearest)",
    )
    command.add_argument(
        "--group-size", type=int, default=None, help="kept values per scale for int8 / int4 (default 32)"
    )
    command.add_argument(
        "--embedding",
        choices=("float", "int8"),
        default="float",
        help="output embedding (and the input embedding tied to it) of the compressed model: the model's float "
        "dtype (default), or int8 with one float16 scale per row (round-to-nearest)",
    )


def _value_kwargs(args: argparse.Namespace) -> dict:
    values = None if args.values == "float" else args.values
    embedding = None if args.embedding == "float" else args.embedding
    return {"values": values, "group_size": args.group_size, "embedding": embedding}


def _load(name: str):
    if name == "smollm2":
        from .embedded import load_smollm2

        return load_smollm2()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name), AutoTokenizer.from_pretrained(name)


def _heldout(tokenizer, args) -> dict[str, torch.Tensor]:
    """The held-out windows of every corpus of the table, tokenized once for all the models it scores."""
    from .data import tokenize_windows

    return {
        corpus: tokenize_windows(
            f"{corpus}:heldout", tokenizer, args.eval_seqlen, max_windows=args.eval_windows
        )
        for corpus in ("wikipedia", "news")
    }


def _ppl(model, heldout: dict[str, torch.Tensor]) -> dict[str, float]:
    from .perplexity import evaluate_perplexity

    return {corpus: evaluate_perplexity(model, None, windows) for corpus, windows in heldout.items()}


def _check_no_heldout(source: str) -> None:
    """The table reports held-out perplexity: refuse embedded training data that contains it."""
    from .data import EMBEDDED_CORPORA
    from .errors import DataError

    corpus, _, split = source.partition(":")
    if corpus in EMBEDDED_CORPORA and split != "train":
        raise DataError(
            f"--train-data {source!r} includes the held-out articles the perplexity table is measured on; "
            f"use '{corpus}:train'."
        )


PROMPTS = ["The history of the city", "Photosynthesis is the process by which"]
# Greedy decoding with the repetition controls a user would set for a small model: a plain greedy
# continuation of a 135M model loops ("of the city of the city ...") whether it is dense or sparse.
DECODING = {"do_sample": False, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}
DECODING_NOTE = "greedy, repetition_penalty=1.3, no_repeat_ngram_size=3"


def _continue(model, tokenizer, new_tokens: int, dense: bool = False) -> list[str]:
    """Continuations of :data:`PROMPTS` (without the prompt); ``dense``: a MaskModel with its masks off."""
    import contextlib

    texts = []
    context = model.disable_masks() if dense else contextlib.nullcontext()
    with context, torch.no_grad():
        for prompt in PROMPTS:
            inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
            out = model.generate(
                **inputs,
                **DECODING,
                max_new_tokens=new_tokens,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
            texts.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return texts


def learn(args: argparse.Namespace) -> dict:
    """Run the main job; returns the results it prints and saves."""
    from .adapters import get_mask_model
    from .adapters.save_and_load import check_mask_name, mask_folder
    from .check import check_nm
    from .data import calibration_tokens, causal_lm_dataset
    from .errors import ConfigError
    from .learn import learn_mask
    from .serialization import save_json
    from .sparse.quantize import resolve_values
    from .training_args import PAPER_LR_SCHEDULE

    _check_no_heldout(args.train_data)
    check_mask_name(args.mask_name)  # before the slow steps
    if args.steps < 0:
        raise ConfigError(f"--steps must be 0 (score the prior alone) or more, got {args.steps}.")
    if args.sample_tokens < 0:
        raise ConfigError(f"--sample-tokens must be 0 (no continuations) or more, got {args.sample_tokens}.")
    resolve_values(args.values, args.group_size)
    torch.manual_seed(args.seed)
    out = Path(args.output)
    rows: list[tuple[str, dict[str, float], float]] = []
    t0 = time.perf_counter()
    model, tokenizer = _load(args.model)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s")

    heldout = _heldout(tokenizer, args)
    t0 = time.perf_counter()
    rows.append(("dense", _ppl(model, heldout), time.perf_counter() - t0))

    prior = None if args.prior == ["none"] else args.prior
    config = MaskConfig(
        n=args.n,
        m=args.m,
        prior=prior,
        calibration_samples=args.calib_samples,
        calibration_seqlen=args.calib_seqlen,
        tau=tuple(args.tau),
        prior_strength=args.prior_strength,
        wanda_strength=args.wanda_strength,
        init_std=args.init_std,
        kappa=tuple(args.kappa),
        lm_weight=args.lm_weight,
        distill_logits=args.distill_logits,
        distill_temperature=args.distill_temperature,
        distill_hidden=args.distill_hidden,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    calibration = None
    if prior is not None and ({"wanda", "sparsegpt"} & set(prior) or (args.wanda_strength or 0) > 0):
        calibration = calibration_tokens(
            args.train_data,
            tokenizer,
            num_samples=args.calib_samples,
            seqlen=args.calib_seqlen,
            seed=args.seed,
        )
    mask_model = get_mask_model(model, config, calibration_data=calibration, mask_name=args.mask_name)
    prior_time = time.perf_counter() - t0
    mask_model.eval()
    rows.append((f"prior ({' + '.join(args.prior)})", _ppl(mask_model, heldout), prior_time))

    tokens = args.steps * args.batch_size * args.grad_accum * args.seqlen
    log_history: list[dict] = []
    if args.steps:
        train = causal_lm_dataset(args.train_data, tokenizer, seqlen=args.seqlen)
        t0 = time.perf_counter()
        trainer = learn_mask(
            mask_model,
            train,
            max_steps=args.steps,
            learning_rate=args.lr,
            **(PAPER_LR_SCHEDULE if args.lr_schedule == "cosine" else {}),
            batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            output_dir=str(out / "trainer"),
            seed=args.seed,
            logging_steps=max(1, args.steps // 10),
        )
        log_history = trainer.state.log_history
        rows.append((f"MaskLLM ({tokens:,} tokens)", _ppl(mask_model, heldout), time.perf_counter() - t0))

    print(
        f"\n{args.n}:{args.m} sparsity, perplexity on held-out text ({args.eval_windows} x {args.eval_seqlen} tokens)"
    )
    print(f"| {'method':<28} | {'wikipedia':>9} | {'news':>9} | {'time (s)':>8} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 11}|{'-' * 10}|")
    for name, ppl, seconds in rows:
        print(f"| {name:<28} | {ppl['wikipedia']:>9.2f} | {ppl['news']:>9.2f} | {seconds:>8.1f} |")

    mask_model.training_summary.update(
        {f"heldout_ppl_{k}": round(v, 3) for k, v in rows[-1][1].items()}
        | {"training_tokens": tokens, "prior": " + ".join(args.prior)}
    )
    mask_model.save_pretrained(out / "mask", save_logits=args.save_logits)
    print(f"\nmask {args.mask_name!r} saved to {mask_folder(out / 'mask', args.mask_name)}")
    if not args.no_merged:
        mask_model.save_pretrained(
            out / "sparse-model", merged=True, tokenizer=tokenizer, **_value_kwargs(args)
        )
        print(f"compressed {args.n}:{args.m} model saved to {out / 'sparse-model'}")
    new_tokens = args.sample_tokens
    dense_texts = _continue(mask_model, tokenizer, new_tokens, dense=True) if new_tokens else []
    sparse = mask_model.merge_and_unload()
    report = check_nm(sparse, args.n, args.m, target_modules=config.target_modules)
    print(report.__str__().splitlines()[0])
    sample = None
    if new_tokens:
        generator, source = sparse, "merged in memory"
        if not args.no_merged:  # generate from the compressed checkpoint as a user would load it
            from transformers import AutoModelForCausalLM

            generator = AutoModelForCausalLM.from_pretrained(out / "sparse-model").to(sparse.device).eval()
            source = f"loaded from {out / 'sparse-model'}"
        sparse_texts = _continue(generator, tokenizer, new_tokens)
        note = f"{DECODING_NOTE}, {new_tokens} new tokens"
        print(f"\ncontinuations ({note}); dense vs {args.n}:{args.m} ({source}):")
        for prompt, dense_text, sparse_text in zip(PROMPTS, dense_texts, sparse_texts, strict=True):
            print(
                f"\n  prompt: {prompt!r}\n  dense:  {dense_text!r}\n  {args.n}:{args.m}:    {sparse_text!r}"
            )
        decoding = {**DECODING, "max_new_tokens": new_tokens}
        sample = {"prompts": PROMPTS, "decoding": decoding, "dense": dense_texts, "sparse": sparse_texts}
    results = {
        "perplexity": {name: ppl for name, ppl, _ in rows},
        "seconds": {name: s for name, _, s in rows},
        "log_history": log_history,
        "sample": sample,
    }
    save_json(json.loads(json.dumps(results, default=str)), out / "results.json")  # atomic
    return results


def zero_shot(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """``hf-maskllm zero-shot``: lm-eval tasks on the model (with ``--mask`` applied); prints a table."""
    from .adapters import MaskModel
    from .serialization import save_json
    from .zero_shot import evaluate_zero_shot

    model, tokenizer = _load(args.model)
    if args.mask is not None:
        model = MaskModel.from_pretrained(model, args.mask)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    results = evaluate_zero_shot(
        model, tokenizer, tasks, batch_size=args.batch_size, limit=limit, include_path=args.include_path
    )
    print(f"\n{args.model}" + (f" + mask {args.mask}" if args.mask else ""))
    print("| task | metric | value |\n|---|---|---:|")
    for task, metrics in results.items():
        for metric, value in metrics.items():
            print(f"| {task} | {metric} | {value:.4f} |")
    if args.output:
        save_json(results, args.output)
    return results


def merge(args: argparse.Namespace) -> list[str]:
    """``hf-maskllm merge``: ``merge_checkpoint`` from the command line; returns the compressed layers."""
    from .adapters import MaskConfig, merge_checkpoint

    fields = {"n": args.n, "m": args.m, "exclude_modules": args.exclude_modules}
    given = {key: value for key, value in fields.items() if value is not None}
    names = merge_checkpoint(
        args.model,
        args.mask,
        args.output,
        config=MaskConfig(**given) if given else None,
        max_shard_size=args.max_shard_size,
        **_value_kwargs(args),
    )
    print(f"{len(names)} layers stored compressed in {args.output}")
    return names


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``hf-maskllm``; without a command it runs ``learn``.

    From the command line (``argv`` None) an hf_maskllm error prints its message, not a traceback.
    """
    import sys

    from .errors import MaskLLMError

    command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("learn", "zero-shot", "merge", "-h", "--help"):
        argv = ["learn", *argv]
    args = _parser().parse_args(argv)
    try:
        if args.command == "learn":
            learn(args)
        elif args.command == "zero-shot":
            zero_shot(args)
        elif args.command == "merge":
            merge(args)
    except MaskLLMError as e:
        if not command_line:
            raise
        sys.exit(f"hf-maskllm: error: {e}")


if __name__ == "__main__":
    main()
