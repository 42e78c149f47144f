"""Perplexity of int8 / int4 kept values on SmolLM2-135M with a learned 2:4 mask, beside llama.cpp's Q8_0 / Q4_0.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quant_quality.py --mask OUT/mask

``--mask``: a mask folder saved by ``MaskModel.save_pretrained`` (``python -m hf_maskllm learn --output OUT``
writes one to ``OUT/mask``). SmolLM2-135M-Instruct (``hf_maskllm.embedded.load_smollm2``, float32) gets
the mask merged in; that 2:4 model is the reference row. Every quantized row is written with
``hf_maskllm.sparse.save_compressed(..., values=, group_size=[, calibration_data=])`` and loaded back
with ``AutoModelForCausalLM.from_pretrained``, as a user runs it: int8 and int4 by round-to-nearest
(RTN) and int4 with GPTQ's error compensation (``hf_maskllm.sparse.gptq``; the main job's
calibration: 32 x 512 tokens of the Wikipedia training articles, seed 0).

Perplexity is measured on the held-out windows of ``python -m hf_maskllm learn`` (``--windows`` x 512
tokens of the Wikipedia and the news held-out articles, ``hf_maskllm.data.tokenize_windows``), every
predicted token of a window counted (``W * 511``), the NLL of :func:`hf_maskllm.perplexity.window_nll`;
the 2:4 row is also checked against :func:`hf_maskllm.perplexity.evaluate_perplexity`.

llama.cpp (``benchmarks/llamacpp.py``: built from the pinned source package) converts the same merged
model (saved as a plain float32 checkpoint) to an F32 GGUF and quantizes that to Q8_0 and Q4_0;
``llama-perplexity -c 512`` scores the same windows (their tokens decoded to text, ``--chunks W``).
llama-perplexity counts only the second half of each window (255 predicted tokens of 512, the first
half being context), so every row of ours is also scored that way from the same logits (the
"second half" columns), and the F32 GGUF row checks that both sides then agree.

Bytes per masked weight: the bytes of the masked layers' stored tensors (values or codes, scales,
positions) over their dense weight count, from the saved files (ours) and the GGUF (llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from run_info import header_lines, run_info

CORPORA = ("wikipedia", "news")
# (row name, values, group size, method); the float32 2:4 model is the reference row
ROWS = (
    ("int8 g32 RTN", "int8", 32, "rtn"),
    ("int4 g8 RTN", "int4", 8, "rtn"),
    ("int4 g16 RTN", "int4", 16, "rtn"),
    ("int4 g32 RTN", "int4", 32, "rtn"),
    ("int4 g8 GPTQ", "int4", 8, "gptq"),
    ("int4 g16 GPTQ", "int4", 16, "gptq"),
    ("int4 g32 GPTQ", "int4", 32, "gptq"),
)
LLAMACPP_TYPES = ("F32", "Q8_0", "Q4_0")
MASKED_GGUF = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def log(message: str) -> None:
    print(f"[quant_quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- scoring
@torch.no_grad()
def score(model: torch.nn.Module, windows: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per corpus: ``ppl`` over every predicted token of each window, ``ppl_second_half`` over the
    predictions llama-perplexity counts (positions ``L//2 .. L-2``), from one forward per window."""
    from hf_maskllm.perplexity import window_nll

    model.eval()
    out = {}
    for corpus, ids in windows.items():
        length = ids.shape[1]
        first = length // 2
        full = half = 0.0
        for row in ids:
            logits = model(input_ids=row.unsqueeze(0), use_cache=False).logits  # [1, L, V]
            full += float(window_nll(logits, row.unsqueeze(0)).double().sum())
            half += float(window_nll(logits[:, first:], row[first:].unsqueeze(0)).double().sum())
        out[corpus] = {
            "ppl": math.exp(full / (ids.shape[0] * (length - 1))),
            "ppl_second_half": math.exp(half / (ids.shape[0] * (length - first - 1))),
        }
    return out


# ---------------------------------------------------------------------------------------------- bytes
def checkpoint_bytes_per_masked_weight(folder: Path) -> float:
    """Bytes of the compressed layers' tensors (values or qvalues, scales, meta) over their dense weights."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    shapes: dict[str, tuple[str, list[int]]] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shapes[key] = (piece.get_dtype(), piece.get_shape())
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
    stored = dense = 0
    for name in modules:
        for part in ("values", "qvalues", "scales", "meta"):
            if f"{name}.{part}" in shapes:
                dtype, shape = shapes[f"{name}.{part}"]
                stored += sizes[dtype] * math.prod(shape)
        dtype, meta_shape = shapes[f"{name}.meta"]
        out = meta_shape[0]
        kept = None
        if f"{name}.values" in shapes:
            kept = shapes[f"{name}.values"][1][1]
        else:
            codes = shapes[f"{name}.qvalues"]
            kept = codes[1][1] * (2 if codes[0] == "U8" else 1)
        n, m = config["quantization_config"]["n"], config["quantization_config"]["m"]
        dense += out * kept * m // n
    return stored / dense


def float_bytes_per_masked_weight(model: torch.nn.Module, modules: list[str], element_size: int) -> float:
    """The same for float kept values of ``element_size`` bytes (format version 1), from the shapes."""
    from hf_maskllm.sparse.format import compressed_shapes

    stored = dense = 0
    for name in modules:
        out, inp = model.get_submodule(name).weight.shape
        (_, kept), (_, meta) = compressed_shapes(out, inp, 2, 4)
        stored += out * (kept * element_size + meta)
        dense += out * inp
    return stored / dense


def gguf_bytes_per_masked_weight(path: Path) -> tuple[float, list[str]]:
    """Bytes of the masked layers' tensors in a GGUF over their weights, and the types they use."""
    from gguf import GGUFReader

    stored = count = 0
    types = set()
    for tensor in GGUFReader(path).tensors:
        if tensor.name.startswith("blk.") and tensor.name.split(".")[2] in MASKED_GGUF:
            stored += int(tensor.n_bytes)
            count += int(tensor.n_elements)
            types.add(tensor.tensor_type.name)
    return stored / count, sorted(types)


# ---------------------------------------------------------------------------------------------- rows
def our_row(merged, tokenizer, windows, work: Path, values: str, group_size: int, calibration) -> dict:
    """Save ``merged`` with quantized kept values, load it as a user would, score it."""
    from transformers import AutoModelForCausalLM

    from hf_maskllm.sparse import save_compressed

    folder = work / f"{values}-g{group_size}-{'gptq' if calibration is not None else 'rtn'}"
    started = time.perf_counter()
    save_compressed(merged, folder, values=values, group_size=group_size, calibration_data=calibration)
    save_s = time.perf_counter() - started
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    kinds = sorted({type(mod).__name__ for mod in loaded.modules() if hasattr(mod, "scales")})
    started = time.perf_counter()
    ppl = score(loaded, windows)
    return {
        "ppl": ppl,
        "bytes_per_masked_weight": checkpoint_bytes_per_masked_weight(folder),
        "layer_classes": kinds,
        "save_seconds": round(save_s, 1),
        "score_seconds": round(time.perf_counter() - started, 1),
    }


def llamacpp_rows(merged, tokenizer, windows, work: Path, threads: int) -> dict:
    """F32 / Q8_0 / Q4_0 GGUFs of ``merged`` scored by llama-perplexity on the windows' text."""
    import llamacpp

    from hf_maskllm.sparse import save_compressed

    hf_dir = work / "merged-dense"
    save_compressed(merged, hf_dir, dense=True, tokenizer=tokenizer)
    f32 = llamacpp.convert(hf_dir, work / "model-F32.gguf", outtype="f32")
    files = {"F32": f32}
    for qtype in LLAMACPP_TYPES[1:]:
        files[qtype] = llamacpp.quantize(f32, work / f"model-{qtype}.gguf", qtype, threads=threads)
    texts = {}
    for corpus, ids in windows.items():
        text = tokenizer.decode(ids.reshape(-1).tolist())
        again = tokenizer(text, add_special_tokens=False)["input_ids"][: ids.numel()]
        same = sum(int(a == b) for a, b in zip(again, ids.reshape(-1).tolist(), strict=False))
        path = work / f"{corpus}.txt"
        path.write_text(text)
        texts[corpus] = (path, same / ids.numel())
    rows = {}
    for qtype, path in files.items():
        per_bytes, types = gguf_bytes_per_masked_weight(path)
        row = {"bytes_per_masked_weight": per_bytes, "gguf_types": types, "ppl": {}}
        for corpus, (text, retokenized) in texts.items():
            result = llamacpp.perplexity(path, text, n_ctx=windows[corpus].shape[1], threads=threads,
                                         chunks=windows[corpus].shape[0])  # fmt: skip
            result["retokenized_same_fraction"] = retokenized
            row["ppl"][corpus] = {"ppl_second_half": result["ppl"], "llama_perplexity": result}
        rows[f"llama.cpp {qtype}"] = row
        log(f"llama.cpp {qtype}: {json.dumps({c: v['ppl_second_half'] for c, v in row['ppl'].items()})}")
    return rows


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mask", help="a 2:4 mask folder (MaskModel.save_pretrained; `hf_maskllm learn` writes OUT/mask)"
    )
    parser.add_argument(
        "--windows", type=int, default=16, help="held-out windows per corpus (the main job: 16)"
    )
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument(
        "--calib-samples", type=int, default=32, help="GPTQ calibration windows (the main job's: 32)"
    )
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument(
        "--rows", help="comma-separated row names to run (default: all), e.g. 'int8 g32 RTN,int4 g16 GPTQ'"
    )
    parser.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp rows")
    parser.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    parser.add_argument("--work-dir", help="where checkpoints and GGUFs go (default: a temporary folder)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="quant_quality", help="results file name (<name>.md, <name>.json)")
    parser.add_argument("--render", help="only rewrite <name>.md from this <name>.json")
    args = parser.parse_args()
    if args.render:
        write(Path(args.out_dir), json.loads(Path(args.render).read_text()), args.name)
        return
    if not args.mask or not Path(args.mask).is_dir():
        parser.error(
            f"--mask {args.mask!r} is not a folder. Learn a mask first: `HF_HUB_OFFLINE=1 python -m hf_maskllm learn "
            "--output OUT` (the main job) saves it to OUT/mask; then pass --mask OUT/mask."
        )
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    wanted = None if not args.rows else [r.strip() for r in args.rows.split(",")]
    rows_to_run = [r for r in ROWS if wanted is None or r[0] in wanted]
    if wanted is not None and len(rows_to_run) != len(wanted):
        parser.error(f"--rows: unknown names; choose from {[r[0] for r in ROWS]}")

    from hf_maskllm import MaskModel
    from hf_maskllm.data import calibration_tokens, tokenize_windows
    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.perplexity import evaluate_perplexity
    from hf_maskllm.sparse import find_nm_modules

    info = run_info("benchmarks/quant_quality.py")
    started = time.perf_counter()
    model, tokenizer = load_smollm2()
    merged = MaskModel.from_pretrained(model, args.mask).merge_and_unload().eval()
    modules = find_nm_modules(merged, 2, 4)
    log(f"{len(modules)} 2:4 layers")
    windows = {
        c: tokenize_windows(f"{c}:heldout", tokenizer, args.seqlen, max_windows=args.windows) for c in CORPORA
    }
    log(f"windows: {json.dumps({c: list(w.shape) for c, w in windows.items()})}")

    results: dict[str, dict] = {}
    ref = score(merged, windows)
    checked = {
        c: evaluate_perplexity(
            merged, tokenizer, f"{c}:heldout", seqlen=args.seqlen, max_windows=args.windows
        )
        for c in CORPORA
    }
    for c in CORPORA:
        if not math.isclose(checked[c], ref[c]["ppl"], rel_tol=1e-6):
            raise RuntimeError(f"{c}: window_nll scoring {ref[c]['ppl']} != evaluate_perplexity {checked[c]}")
    results["2:4 float32"] = {
        "ppl": ref,
        "evaluate_perplexity": checked,
        "bytes_per_masked_weight": float_bytes_per_masked_weight(merged, modules, 4),
    }
    log(f"2:4 float32: {json.dumps(ref)}")
    bf16_bytes = float_bytes_per_masked_weight(merged, modules, 2)

    calibration = None
    if any(method == "gptq" for *_, method in rows_to_run):
        calibration = calibration_tokens(
            "wikipedia:train", tokenizer, num_samples=args.calib_samples, seqlen=args.calib_seqlen, seed=0
        )
    with tempfile.TemporaryDirectory(prefix="quant_quality-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, values, group_size, method in rows_to_run:
            log(f"{name}: saving, loading, scoring")
            results[name] = {
                "values": values,
                "group_size": group_size,
                "method": method,
                **our_row(merged, tokenizer, windows, work, values, group_size,
                          calibration if method == "gptq" else None),
            }  # fmt: skip
            log(f"{name}: {json.dumps(results[name]['ppl'])}")
        llama = {}
        if not args.no_llamacpp:
            import llamacpp

            llama = llamacpp_rows(merged, tokenizer, windows, work, args.threads)
            info["llama_cpp"] = llamacpp.version_info()
    meta = {
        "mask": str(args.mask),
        "windows": {c: list(w.shape) for c, w in windows.items()},
        "calibration": None
        if calibration is None
        else {"source": "wikipedia:train", "shape": list(calibration.shape), "seed": 0},
        "modules": len(modules),
        "bf16_bytes_per_masked_weight": bf16_bytes,
        "threads": args.threads,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write(
        Path(args.out_dir),
        {**info, "args": vars(args), "meta": meta, "rows": results, "llama_cpp_rows": llama},
        args.name,
    )


def targets(data: dict) -> dict:
    """The quality targets: int8 <= 1.01x the 2:4 model, the best int4 GPTQ <= 1.15x and below llama.cpp Q4_0."""
    rows, ref = data["rows"], data["rows"]["2:4 float32"]["ppl"]
    out = {}
    for c in CORPORA:
        ratio = {k: v["ppl"][c]["ppl"] / ref[c]["ppl"] for k, v in rows.items()}
        int8 = [k for k in rows if k.startswith("int8")]
        gptq = [k for k in rows if k.endswith("GPTQ")]
        entry = {"ratios": ratio}
        if int8:
            entry["int8 <= 1.01x"] = all(ratio[k] <= 1.01 for k in int8)
        if gptq:
            best = min(gptq, key=lambda k: ratio[k])
            entry["best int4 GPTQ"] = best
            entry["int4 GPTQ <= 1.15x"] = ratio[best] <= 1.15
            q4 = data.get("llama_cpp_rows", {}).get("llama.cpp Q4_0")
            if q4:
                ours = rows[best]["ppl"][c]["ppl_second_half"]
                entry["int4 GPTQ < llama.cpp Q4_0 (second half)"] = ours < q4["ppl"][c]["ppl_second_half"]
        out[c] = entry
    return out


def write(out: Path, data: dict, name: str) -> None:
    """<name>.json (everything) and <name>.md (the table)."""
    data = {**data, "targets": targets(data)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    rows, ref = data["rows"], data["rows"]["2:4 float32"]["ppl"]
    meta = data["meta"]
    lines = [
        "# Quantized kept values: perplexity of SmolLM2-135M with a learned 2:4 mask",
        "",
        *header_lines(data),
        "",
        *[f"- {k}: {v}" for k, v in meta.items()],
        "",
        'Ours: saved with `save_compressed(values=, group_size=)` and loaded with `from_pretrained`. "all": every '
        'predicted token of each window (as `hf_maskllm learn` reports); "2nd half": the last 255 predictions of '
        "each 512-token window, as llama-perplexity counts (llama.cpp rows: llama-perplexity -c 512 on the same windows' text).",
        "",
        "| row | bytes / masked weight | Wikipedia PPL (all) | x 2:4 | news PPL (all) | x 2:4 | Wikipedia (2nd half) | news (2nd half) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in rows.items():
        p = row["ppl"]
        lines.append(
            f"| {key} | {row['bytes_per_masked_weight']:.4f} | {p['wikipedia']['ppl']:.2f} | "
            f"{p['wikipedia']['ppl'] / ref['wikipedia']['ppl']:.3f} | {p['news']['ppl']:.2f} | "
            f"{p['news']['ppl'] / ref['news']['ppl']:.3f} | {p['wikipedia']['ppl_second_half']:.2f} | "
            f"{p['news']['ppl_second_half']:.2f} |"
        )
    for key, row in data.get("llama_cpp_rows", {}).items():
        p = row["ppl"]
        lines.append(
            f"| {key} ({', '.join(row['gguf_types'])}) | {row['bytes_per_masked_weight']:.4f} | | | | | "
            f"{p['wikipedia']['ppl_second_half']:.2f} | {p['news']['ppl_second_half']:.2f} |"
        )
    lines += ["", "Targets:", "", "```", json.dumps(data["targets"], indent=1), "```"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
