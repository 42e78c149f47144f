"""Downstream masks on one base model: a domain mask transferred from a general mask vs one learned from scratch.

Model: SmolLM2-135M-Instruct (embedded), 2:4, every linear of the decoder blocks. Two real text domains
available offline, neither Wikipedia nor news, each split by file with a fixed rule (paths sorted;
file ``i`` is held out when ``i % 5 == 4``, the rest is the training split):

- ``python``: the top-level ``*.py`` files of this interpreter's standard library (``sysconfig`` stdlib).
- ``legal``: license texts: ``/usr/share/common-licenses/*`` and the ``LICENSE*`` / ``COPYING*`` files of
  the installed Python packages (``site-packages``), exact duplicates (whitespace-normalised) removed
  before the split.

Masks, all on one ``MaskModel`` (one copy of the base weights):

- ``general``: the main job's mask: SparseGPT prior calibrated on ``wikipedia:train``, ``learn_mask`` on
  ``wikipedia:train`` (``--general-mask`` reuses a saved one instead);
- ``<domain>-scratch``: SparseGPT prior calibrated on the domain's training split, then ``learn_mask``;
- ``<domain>-transfer``: ``MaskConfig(prior=[<general mask folder>, "sparsegpt"])`` (the general mask
  and the domain's SparseGPT mask, calibrated as for scratch: their prior terms add, so the groups where
  they agree start strongly set and learning decides the others), then ``learn_mask``;
- ``<domain>-transfer-general``: ``MaskConfig(prior=<general mask folder>)``, the general mask alone as
  the prior (the paper's transfer), then ``learn_mask``.

Scratch and both transfers: the same steps, batch and sequence length (token budget), in one run.

Reported per domain: held-out domain perplexity (``--eval-windows`` windows drawn with a fixed seed over
the held-out files) of dense, general, scratch and transfer; held-out Wikipedia perplexity of each mask;
learning time (prior + training, wall and process CPU seconds); storage of each extra mask (saved
folder, and in memory while inactive and packed); the time ``set_mask`` takes between masks.

Run (CPU, single-threaded; about an hour: the general mask, then per domain two SparseGPT priors and three
learning runs of ``--steps`` x ~8 s, and the evaluations):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/downstream.py --out-dir benchmarks/results
Smoke test (minutes): add ``--general-steps 2 --steps 2 --calib-samples 2 --eval-windows 1 --eval-seqlen 128
--seqlen 64 --out-dir /tmp/downstream``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from run_info import header_lines, run_info

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.adapters.mask_file import MASKS_NAME
from hf_maskllm.data import calibration_tokens, causal_lm_dataset
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.learn import learn_mask
from hf_maskllm.numerics.sampling import hard_indices
from hf_maskllm.perplexity import evaluate_perplexity

HELDOUT_EVERY = 5


# ---------------------------------------------------------------------------------------------- data
def _split(texts: dict[str, str]) -> dict[str, Any]:
    """Fixed split by sorted path: file i is held out when i % 5 == 4."""
    paths = sorted(texts)
    return {
        "train": [texts[p] for i, p in enumerate(paths) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1],
        "heldout": [texts[p] for i, p in enumerate(paths) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1],
        "files": len(paths),
    }


def python_domain() -> dict[str, Any]:
    """Top-level ``*.py`` files of the standard library of this interpreter."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = {str(p): p.read_text(encoding="utf-8", errors="replace") for p in stdlib.glob("*.py")}
    return _split({p: t for p, t in texts.items() if t.strip()})


def legal_domain() -> dict[str, Any]:
    """License texts of the system and of the installed packages, exact duplicates removed."""
    candidates = [p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file()]
    site = Path(sysconfig.get_paths()["purelib"])
    candidates += [
        p for p in site.rglob("*") if p.is_file() and re.match(r"(LICEN[CS]E|COPYING)", p.name, re.IGNORECASE)
    ]
    texts: dict[str, str] = {}
    seen: set[str] = set()
    for path in sorted(candidates):
        if path.is_symlink() and path.resolve() in {Path(p).resolve() for p in texts}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        key = hashlib.sha256(" ".join(text.split()).encode()).hexdigest()
        if text.strip() and key not in seen:
            seen.add(key)
            texts[str(path)] = text
    return _split(texts)


DOMAINS = {"python": python_domain, "legal": legal_domain}


# ---------------------------------------------------------------------------------------------- helpers
def _ppl(model, windows: torch.Tensor) -> float:
    return evaluate_perplexity(model, None, windows, progress=False)


def _learn(mm: MaskModel, source: Any, tokenizer: Any, args: Any, steps: int, output_dir: Path) -> None:
    """The main job's recipe (``learn_mask``) on the active mask."""
    learn_mask(
        mm,
        causal_lm_dataset(source, tokenizer, seqlen=args.seqlen),
        max_steps=steps,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        gradient_accumulation_steps=1,  # one forward (and mask sample) per step, as measured
        output_dir=str(output_dir),
        seed=args.seed,
        logging_steps=max(1, steps // 10),
        disable_tqdm=True,
    )


class Clock:
    """Wall and process CPU seconds of a block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--domains", default="python,legal")
    p.add_argument("--general-mask", default=None, help="a saved general mask folder or repo id to reuse")
    p.add_argument("--general-steps", type=int, default=40, help="steps of the general mask (the main job's)")
    p.add_argument("--steps", type=int, default=40, help="steps of each domain mask (scratch and transfer)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, help="where the masks are saved (default: a temporary folder)")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument(
        "--name",
        default="downstream",
        help="file name of the results (<name>.md, <name>.json); --switching-only writes downstream_switching.*",
    )
    p.add_argument(
        "--switching-only",
        action="store_true",
        help="only storage and switching (no learning): about a minute",
    )
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="downstream-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.switching_only:
        switching_only(args, out, work, started)
        return

    model, tokenizer = load_smollm2()
    data = {name: DOMAINS[name]() for name in args.domains.split(",")}

    def windows(texts, num=args.eval_windows) -> torch.Tensor:
        return calibration_tokens(texts, tokenizer, num_samples=num, seqlen=args.eval_seqlen, seed=args.seed)

    heldout = {name: windows(d["heldout"]) for name, d in data.items()}
    wiki = evaluate_perplexity  # the main job's protocol: the first windows of wikipedia:heldout

    def wiki_ppl(m) -> float:
        return wiki(m, tokenizer, "wikipedia:heldout", seqlen=args.eval_seqlen, max_windows=args.eval_windows,
                    progress=False)  # fmt: skip

    partial_file = out / f"{args.name}.partial.json"

    def checkpoint() -> None:  # rows so far, should the run stop; removed once <name>.json is written
        partial = {"partial": True, "args": vars(args), "started": started, "rows": rows}
        partial_file.write_text(json.dumps(partial, indent=2, default=str) + "\n")

    rows: dict[str, dict] = {"dense": {"seconds": 0.0}}
    rows["dense"].update({d: _ppl(model, w) for d, w in heldout.items()} | {"wikipedia": wiki_ppl(model)})
    print("dense", rows["dense"], flush=True)
    checkpoint()

    # ------------------------------------------------------------------ the general mask
    general_cfg = dict(
        calibration_samples=args.calib_samples, calibration_seqlen=args.calib_seqlen, seed=args.seed
    )
    with Clock() as clock:
        if args.general_mask:
            mm = MaskModel.from_pretrained(model, args.general_mask, mask_name="general")
            general_folder = str(args.general_mask)
        else:
            calib = calibration_tokens(
                "wikipedia:train",
                tokenizer,
                num_samples=args.calib_samples,
                seqlen=args.calib_seqlen,
                seed=args.seed,
            )
            mm = get_mask_model(
                model,
                MaskConfig(prior="sparsegpt", **general_cfg),
                calibration_data=calib,
                mask_name="general",
            )
            _learn(mm, "wikipedia:train", tokenizer, args, args.general_steps, work / "trainer-general")
            mm.save_pretrained(work / "masks", selected_masks=["general"])
            general_folder = str(work / "masks" / "general")  # masks not named "default" sit in a subfolder
    mm.eval()
    rows["general"] = {"seconds": clock.wall, "cpu_seconds": clock.cpu, "reused": bool(args.general_mask)}
    rows["general"].update({d: _ppl(mm, w) for d, w in heldout.items()} | {"wikipedia": wiki_ppl(mm)})
    print("general", rows["general"], flush=True)
    checkpoint()

    # ------------------------------------------------------------------ domain masks
    for domain, split in data.items():
        calib = calibration_tokens(
            split["train"],
            tokenizer,
            num_samples=args.calib_samples,
            seqlen=args.calib_seqlen,
            seed=args.seed,
        )
        kinds = (
            ("scratch", "sparsegpt"),
            ("transfer", [general_folder, "sparsegpt"]),
            ("transfer-general", general_folder),
        )
        for kind, prior in kinds:
            name = f"{domain}-{kind}"
            with Clock() as prior_clock:
                mm.add_mask(name, MaskConfig(prior=prior, **general_cfg), calibration_data=calib)
                mm.set_mask(name)
            start_ppl = _ppl(mm.eval(), heldout[domain])  # where learning starts (not timed)
            with Clock() as clock:
                _learn(mm, split["train"], tokenizer, args, args.steps, work / f"trainer-{name}")
            mm.eval()
            rows[name] = {
                "seconds": prior_clock.wall + clock.wall, "cpu_seconds": prior_clock.cpu + clock.cpu,
                "domain": domain, "kind": kind, "start_ppl": start_ppl,
            }  # fmt: skip
            rows[name].update({domain: _ppl(mm, heldout[domain]), "wikipedia": wiki_ppl(mm)})
            mm.save_pretrained(work / "masks", selected_masks=[name])
            rows[name]["file_bytes"] = (work / "masks" / name / MASKS_NAME).stat().st_size
            print(name, rows[name], flush=True)
            checkpoint()

    # ------------------------------------------------------------------ storage and switching
    layers = mm.masked_layers()
    masked = sum(layer.in_features * layer.out_features for layer in layers.values())
    names = [n for n in mm.list_masks() if n != "general"]  # the domain masks
    for name in names:
        rows[name]["file_bits_per_weight"] = 8 * rows[name]["file_bytes"] / masked
    ids = heldout[next(iter(heldout))][:1, :64]
    state, switching = measure_switching(mm, names, work / "masks" / names[0], ids)

    # ------------------------------------------------------------------ report
    results = _header(args, started) | {
        "domains": {
            d: {"files": s["files"], "train_texts": len(s["train"]), "heldout_texts": len(s["heldout"])}
            for d, s in data.items()
        },  # fmt: skip
        "masked_weights": masked,
        "rows": rows,
        "mask_states": state,
        "switching": switching,
    }
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / f"{args.name}.md").write_text(_markdown(results) + "\n")
    partial_file.unlink(missing_ok=True)
    print(_markdown(results))


def measure_switching(mm: MaskModel, names: list[str], saved: Path, ids: torch.Tensor) -> tuple[dict, dict]:
    """Memory of every mask's state, ``set_mask`` time between the masks ``names`` (held as logits), the
    time to activate a packed copy of the mask saved in ``saved``, and an eval forward after a switch."""
    mm.load_mask(saved, mask_name="packed-copy")  # is_trainable=False: packed while inactive
    state = {n: vars(mm.mask_state(n)) for n in mm.list_masks()}
    switch = []
    for _ in range(10):
        for target in (names[0], names[-1]):
            start = time.perf_counter()
            mm.set_mask(target)
            switch.append(time.perf_counter() - start)
    start = time.perf_counter()
    mm.set_mask("packed-copy")
    decode = time.perf_counter() - start
    reference = mm.hard_indices(names[0])  # names[0] is inactive now
    identical = all(
        torch.equal(a.cpu(), b.cpu()) for a, b in zip(mm.hard_indices().values(), reference.values())
    )
    # The first eval forward after a switch computes the new hard masks (argmax over the logits).
    mm.eval()
    forward = {}
    for label, switch_first in (("after_switch", True), ("steady", False)):
        if switch_first:
            mm.set_mask(names[-1] if mm.active_mask == names[0] else names[0])
        start = time.perf_counter()
        with torch.no_grad():
            mm(input_ids=ids)
        forward[label] = time.perf_counter() - start
    # The argmax that forward spends most on, over every layer's logits as stored (a strided view when
    # stored candidate-major, as training leaves them) and as hard_indices takes it (a contiguous copy).
    stored = [layer.mask_logits.detach() for layer in mm.masked_layers().values()]
    argmax = {}
    for label, fn in (("view", lambda t: t.argmax(dim=-1)), ("contiguous", hard_indices)):
        start = time.perf_counter()
        for logits in stored:
            fn(logits)
        argmax[label] = time.perf_counter() - start
    candidate_major = any(layer.candidate_major_logits for layer in mm.masked_layers().values())
    mm.set_mask(names[0])
    mm.delete_mask("packed-copy")
    return state, {
        "forward_1x64_after_switch_ms": 1e3 * forward["after_switch"],
        "forward_1x64_steady_ms": 1e3 * forward["steady"],
        "logits_candidate_major": candidate_major,
        "argmax_all_layers_view_ms": 1e3 * argmax["view"],
        "argmax_all_layers_contiguous_copy_ms": 1e3 * argmax["contiguous"],
        "set_mask_logits_ms_median": 1e3 * statistics.median(switch),
        "set_mask_logits_ms_max": 1e3 * max(switch),
        "set_mask_packed_decode_ms": 1e3 * decode,
        "packed_copy_identical": identical,
    }


def switching_only(args: argparse.Namespace, out: Path, work: Path, started: str) -> None:
    """Storage and switching on SmolLM2 without learning: a magnitude mask and a random one."""
    model, tokenizer = load_smollm2()
    mm = get_mask_model(model, MaskConfig(prior="magnitude"), mask_name="magnitude")
    mm.add_mask("random", MaskConfig(seed=1))
    for name in ("random", "magnitude"):  # both in the layout training leaves logits in (MaskAnnealCallback)
        mm.set_mask(name)
        mm.set_candidate_major_logits(True)
    mm.save_pretrained(work / "masks", selected_masks=["magnitude"])
    ids = calibration_tokens("wikipedia:heldout", tokenizer, num_samples=1, seqlen=64, seed=args.seed)
    state, switching = measure_switching(mm, ["magnitude", "random"], work / "masks" / "magnitude", ids)
    results = _header(args, started) | {"mask_states": state, "switching": switching}
    (out / "downstream_switching.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    lines = [
        "# Switching between masks on one SmolLM2-135M",
        "",
        *header_lines(results),
        "",
        f"Started {started}; {results['threads']} thread(s).",
        "",
        "Masks `magnitude` (magnitude prior) and `random` (random logits), bf16 logits, both held as logits "
        "and stored candidate-major (as training leaves them); "
        "`packed-copy`: the `magnitude` mask saved and loaded with `is_trainable=False`.",
        "",
        "| mask | state | memory | bits per masked weight |",
        "|---|---|---:|---:|",
    ]
    for name, st in state.items():
        lines.append(
            f"| {name} | {st['state']} | {st['nbytes'] / 2**20:.2f} MiB | {st['bits_per_weight']:.3f} |"
        )
    lines += ["", _switching_line(switching)]
    (out / "downstream_switching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _header(args: argparse.Namespace, started: str) -> dict:
    """run_info's fields (command, date, machine, versions, git commit), the arguments, the start time
    and the thread count."""
    return {
        **run_info("benchmarks/downstream.py"),
        "args": vars(args),
        "started": started,
        "threads": torch.get_num_threads(),
    }


def _switching_line(sw: dict) -> str:
    layout = (
        "stored candidate-major, as training leaves them" if sw.get("logits_candidate_major") else "row-major"
    )
    return (
        f"- switching between masks held as logits: median {sw['set_mask_logits_ms_median']:.2f} ms, max "
        f"{sw['set_mask_logits_ms_max']:.2f} ms (target < 50 ms); activating a packed mask (decode): "
        f"{sw['set_mask_packed_decode_ms']:.0f} ms (decoded mask identical to the saved one: "
        f"{sw['packed_copy_identical']}). The first eval forward after a switch computes the new hard masks: "
        f"{sw['forward_1x64_after_switch_ms']:.0f} ms for 1 x 64 tokens, against {sw['forward_1x64_steady_ms']:.0f} ms "
        "for the next one."
        + (
            f" The argmax over every layer's logits ({layout}): {sw['argmax_all_layers_view_ms']:.0f} ms over the "
            f"stored tensors, {sw['argmax_all_layers_contiguous_copy_ms']:.0f} ms over contiguous copies "
            "(what `hard_indices` does)."
            if "argmax_all_layers_view_ms" in sw
            else ""
        )
    )


def _markdown(r: dict) -> str:
    a = r["args"]
    tokens = a["steps"] * a["batch_size"] * a["seqlen"]
    rows = r["rows"]
    lines = [
        "# Downstream masks: transfer from a general mask vs learning from scratch",
        "",
        *header_lines(r),
        "",
        f"Started {r['started']}; {r['threads']} thread(s).",
        "",
        f"SmolLM2-135M-Instruct, 2:4 over {r['masked_weights']:,} weights. Domain masks: {a['steps']} steps x "
        f"{a['batch_size']} x {a['seqlen']} tokens ({tokens:,} tokens) each, lr {a['lr']}; SparseGPT priors on "
        f"{a['calib_samples']} x {a['calib_seqlen']} tokens. Perplexity: {a['eval_windows']} x {a['eval_seqlen']} "
        "tokens, domain windows drawn (seed "
        f"{a['seed']}) over the held-out files, Wikipedia the first windows of `wikipedia:heldout`.",
        "",
        "Domains (split by sorted file path, every fifth file held out): "
        + "; ".join(
            f"{d}: {v['files']} files, {v['train_texts']} train / {v['heldout_texts']} held out"
            for d, v in r["domains"].items()
        )  # fmt: skip
        + ".",
        "",
        "Masks: `scratch`: SparseGPT prior calibrated on the domain; `transfer`: the general mask and the "
        'domain\'s SparseGPT mask together as the prior (`MaskConfig(prior=[general, "sparsegpt"])`); '
        "`transfer-general`: the general mask alone as the prior. Start: the domain perplexity of the hard "
        "mask learning starts from. Learning time: prior (SparseGPT calibration included) and learning.",
        "",
        "| domain | mask | start PPL | domain PPL | Wikipedia PPL | learning time (wall / CPU) | saved mask |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    general = rows["general"]
    for domain in r["domains"]:
        lines.append(
            f"| {domain} | dense | | {rows['dense'][domain]:.2f} | {rows['dense']['wikipedia']:.2f} | | |"
        )
        g_time = (
            "reused" if general["reused"] else f"{general['seconds']:.0f} s / {general['cpu_seconds']:.0f} s"
        )
        lines.append(
            f"| {domain} | general | | {general[domain]:.2f} | {general['wikipedia']:.2f} | {g_time} | |"
        )
        for kind in ("scratch", "transfer", "transfer-general"):
            if f"{domain}-{kind}" not in rows:
                continue
            row = rows[f"{domain}-{kind}"]
            start = f"{row['start_ppl']:.2f}" if "start_ppl" in row else ""
            lines.append(
                f"| {domain} | {kind} | {start} | {row[domain]:.2f} | {row['wikipedia']:.2f} | {row['seconds']:.0f} s / "
                f"{row['cpu_seconds']:.0f} s | {row['file_bytes'] / 2**20:.2f} MiB ({row['file_bits_per_weight']:.3f}"
                " bit/weight) |"
            )
    lines += ["", "Targets:", ""]
    for domain in r["domains"]:
        d, g = rows["dense"][domain], general[domain]
        s = rows[f"{domain}-scratch"][domain]
        for kind in ("transfer", "transfer-general"):
            if f"{domain}-{kind}" not in rows:
                continue
            t = rows[f"{domain}-{kind}"]
            closed = (g - t[domain]) / (g - d) if g != d else float("nan")
            lines.append(
                f"- {domain}: {kind} {t[domain]:.2f} vs scratch {s:.2f} "
                f"({'beats' if t[domain] < s else 'does not beat'} scratch); {kind} closes {closed:.1%} of the "
                f"general -> dense gap ({g:.2f} -> {d:.2f}; target 75%) in {t['cpu_seconds'] / 60:.1f} CPU-minutes "
                "(target 30)."
            )
    sw = r["switching"]
    packed = [v for v in r["mask_states"].values() if v["state"] == "packed"]
    logits = [v for v in r["mask_states"].values() if v["state"] == "logits"]
    lines.append(_switching_line(sw))
    if packed:
        lines.append(
            f"- an inactive packed mask holds {packed[0]['nbytes'] / 2**20:.2f} MiB = "
            f"{packed[0]['bits_per_weight']:.3f} bit per masked weight (target <= 0.7)"
            + (
                f"; an inactive mask held as logits {logits[0]['bits_per_weight']:.1f} bit."
                if logits
                else "."
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
