"""CPU generation from a loaded compressed 2:4 SmolLM2-135M: decode speed, prefill time and memory vs dense.

    PYTHONPATH=. python benchmarks/generate_cpu.py [--repeats 5] [--threads 1,2] [--dtypes float32,bfloat16]

The dense model is SmolLM2-135M-Instruct (``hf_maskllm.embedded.load_smollm2``) with a magnitude 2:4
mask merged into every decoder linear (zeros in the weights), saved as a plain checkpoint; the
compressed model is the same model written by ``MaskModel.save_pretrained(..., merged=True)``. Each
is loaded with ``AutoModelForCausalLM.from_pretrained`` in a fresh process, as a user loads it, so all
rows compute the same function:

- ``dense``: plain ``nn.Linear`` layers;
- ``compressed``: ``SparseLinear`` as shipped: the CPU kernels read ``values`` + ``meta`` (direct up to 8
  tokens, expand into one reused buffer + dense GEMM beyond);
- ``compressed, dense cache``: the same with ``set_dense_cache(model, True)`` (the opt-in route that
  keeps a decompressed weight per layer).

Timing (one process per instruction-set mode; rows interleaved within each repeat): decoding, batch 1,
greedy, after a 32-token prompt: tok/s = 32 / (time of ``generate`` with 33 new tokens - time with 1),
so the prompt's forward is not counted; and a 512-token prefill (one forward, the last position's
logits only, as ``generate`` does). In the ``avx2`` mode the compressed model's bfloat16 prefill
multiplies in float32 (what hf_maskllm does without AVX512-BF16, where torch's bfloat16 GEMM is slow),
the dense model's in bfloat16. Speed vs dense = median over repeats of (dense time / row time),
measured back to back. The ``avx2`` mode caps torch (``ATEN_CPU_CAPABILITY``), oneDNN
(``ONEDNN_MAX_CPU_ISA``), MKL (``MKL_ENABLE_INSTRUCTIONS``) and the hf_maskllm kernels at AVX2, for
dense and compressed alike. Memory (one process per row): bytes of the tensors held after generating
(parameters and buffers, tied tensors once, dense caches, the expansion buffer) and the process's
peak RSS (above its RSS before loading, and in all). Writes ``benchmarks/results/generate_cpu.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from run_info import header_lines, rss_bytes, rss_peak_bytes, run_info

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press. Within decades"
)
VARIANTS = ("dense", "compressed", "compressed, dense cache")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def held_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers (tied tensors once), dense caches and the CPU expansion buffer."""
    from hf_maskllm.kernels.cpu_ops import scratch_bytes
    from hf_maskllm.sparse import SparseLinear

    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for mod in model.modules():
        if isinstance(mod, SparseLinear) and mod._cache is not None:
            total += mod._cache.numel() * mod._cache.element_size()
    return total + scratch_bytes()


def load(folder: Path, variant: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    import hf_maskllm  # noqa: F401  (registers the compressed format)
    from hf_maskllm.sparse import set_dense_cache

    model = AutoModelForCausalLM.from_pretrained(
        folder / ("dense" if variant == "dense" else "sparse"), dtype=dtype
    )
    if variant == "compressed, dense cache":
        set_dense_cache(model, True)
    return model.eval()


@torch.no_grad()
def decode(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    return time.perf_counter() - start, out[:, ids.shape[1] :]


@torch.no_grad()
def prefill(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """One forward over the prompt with the last position's logits only, as ``generate`` prefills."""
    start = time.perf_counter()
    model(ids, logits_to_keep=1)
    return time.perf_counter() - start


def timing_child(args: argparse.Namespace) -> None:
    """Time every variant of every dtype at every thread count in this process (one ISA mode)."""
    from transformers import AutoTokenizer

    from hf_maskllm.kernels.cpu_extension import cpu_isa

    tokenizer = AutoTokenizer.from_pretrained(Path(args.folder) / args.dtypes.split(",")[0] / "dense")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[:, :32]
    assert ids.shape[1] == 32, ids.shape
    long_ids = torch.randint(100, 40000, (1, 512), generator=torch.Generator().manual_seed(0))
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        models = {v: load(Path(args.folder) / dtype_name, v, dtype) for v in VARIANTS}
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for model in models.values():  # warm-up: first calls, caches, buffers
                decode(model, ids, 4)
                prefill(model, long_ids)
            dec = {v: [] for v in VARIANTS}
            pre = {v: [] for v in VARIANTS}
            same = dict.fromkeys(VARIANTS, True)
            for _ in range(args.repeats):
                tokens = {}
                for v, model in models.items():
                    first, _ = decode(model, ids, 1)  # the prompt's forward and the first token
                    seconds, tokens[v] = decode(model, ids, args.new_tokens + 1)
                    same[v] = same[v] and bool(torch.equal(tokens[v], tokens["dense"]))
                    dec[v].append(seconds - first)  # the new tokens after the first: decoding alone
                    pre[v].append(prefill(model, long_ids))
            for v in VARIANTS:
                rows.append(
                    {
                        "isa_mode": args.isa_mode,
                        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "hf_maskllm_cpu_isa": cpu_isa(),
                        "dtype": dtype_name,
                        "threads": threads,
                        "model": v,
                        "decode_tok_s": args.new_tokens / statistics.median(dec[v]),
                        "decode_tok_s_all": [round(args.new_tokens / s, 2) for s in dec[v]],
                        "decode_speed_vs_dense": statistics.median(
                            d / s for d, s in zip(dec["dense"], dec[v])
                        ),
                        "decode_speed_vs_dense_min": min(d / s for d, s in zip(dec["dense"], dec[v])),
                        "prefill_512_s": statistics.median(pre[v]),
                        "prefill_speed_vs_dense": statistics.median(
                            d / s for d, s in zip(pre["dense"], pre[v])
                        ),
                        "same_tokens_as_dense": same[v],  # in every repeat
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del models
        gc.collect()
    print(json.dumps(rows))


def memory_child(args: argparse.Namespace) -> None:
    """Load one variant, generate and prefill, report what it holds and the process's peak RSS."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtypes)
    folder = Path(args.folder) / args.dtypes
    tokenizer = AutoTokenizer.from_pretrained(folder / "dense")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[:, :32]
    gc.collect()
    before = rss_bytes()
    model = load(folder, args.variant, dtype)
    decode(model, ids, args.new_tokens)
    prefill(model, torch.randint(100, 40000, (1, 512), generator=torch.Generator().manual_seed(0)))
    gc.collect()
    peak = rss_peak_bytes()
    print(
        json.dumps(
            {
                "dtype": args.dtypes,
                "model": args.variant,
                "tensor_bytes_after_generating": held_bytes(model),
                "rss_before_load": before,
                "peak_rss": peak,
                "peak_rss_above_start": peak - before,
            }
        )
    )


def child(argv: list[str], env: dict | None = None) -> list | dict:
    result = subprocess.run(
        [sys.executable, __file__, *argv],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def prepare(folder: Path, dtypes: list[str]) -> None:
    """Write the dense-with-zeros and the compressed checkpoint of each dtype."""
    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.embedded import load_smollm2

    for dtype_name in dtypes:
        torch.manual_seed(0)
        model, tokenizer = load_smollm2(dtype=getattr(torch, dtype_name))
        mask_model = get_mask_model(model, MaskConfig(n=2, m=4, prior="magnitude"))
        mask_model.save_pretrained(folder / dtype_name / "sparse", merged=True)
        dense = mask_model.merge_and_unload()
        dense.save_pretrained(folder / dtype_name / "dense")
        tokenizer.save_pretrained(folder / dtype_name / "dense")
        del model, mask_model, dense
        gc.collect()


def write(args: argparse.Namespace, info: dict, rows: list, memory: list) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({**info, "rows": rows, "memory": memory}, indent=2) + "\n")
    mib = 1 / 2**20
    dense_held = {m["dtype"]: m["tensor_bytes_after_generating"] for m in memory if m["model"] == "dense"}
    lines = [
        "# CPU generation: loaded compressed 2:4 SmolLM2-135M vs dense",
        "",
        *header_lines(info),
        "",
        f"Decoding, batch 1, greedy, after a 32-token prompt: tok/s = {args.new_tokens} / (time of `generate` with "
        f"{args.new_tokens + 1} new tokens - time with 1), the prompt's forward not counted; and one 512-token "
        f"forward (prefill); {args.repeats} repeats, rows interleaved in each; speed vs "
        "dense = median over repeats of (dense time / row time). `avx2` caps torch, oneDNN, MKL and hf_maskllm "
        "at AVX2 (dense and compressed alike; there the compressed model's bfloat16 prefill multiplies in "
        "float32, the dense model's in bfloat16); `native` lets each use the best it has.",
        "",
        "| ISA mode | dtype | threads | model | decode tok/s | decode vs dense | prefill 512 (s) | prefill vs dense | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['isa_mode']} | {r['dtype']} | {r['threads']} | {r['model']} | {r['decode_tok_s']:.1f} | "
            f"{r['decode_speed_vs_dense']:.2f}x (min {r['decode_speed_vs_dense_min']:.2f}x) | "
            f"{r['prefill_512_s']:.2f} | {r['prefill_speed_vs_dense']:.2f}x | {r['same_tokens_as_dense']} |"
        )
    lines += [
        "",
        "Memory, one process per row (native ISA, one thread): tensors held after generating and prefilling "
        "(parameters and buffers with tied tensors once, dense caches, the CPU expansion buffer), and the "
        "process's peak RSS (MiB).",
        "",
        "| dtype | model | tensors held | vs dense | peak RSS above start | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for m in memory:
        lines.append(
            f"| {m['dtype']} | {m['model']} | {m['tensor_bytes_after_generating'] * mib:.1f} | "
            f"{m['tensor_bytes_after_generating'] / dense_held[m['dtype']]:.2f}x | "
            f"{m['peak_rss_above_start'] * mib:.1f} | {m['peak_rss'] * mib:.1f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default=f"1,{os.cpu_count()}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--isa-modes", default="native,avx2", help="native and/or avx2")
    parser.add_argument("--out", default=str(RESULTS / "generate_cpu"))
    parser.add_argument("--timing-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--isa-mode", default="native", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.timing_child:
        return timing_child(args)
    if args.memory_child:
        return memory_child(args)

    info = run_info("benchmarks/generate_cpu.py")
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="generate_cpu_"))
    prepare(folder, args.dtypes.split(","))
    common = ["--folder", str(folder), "--new-tokens", str(args.new_tokens)]
    rows = []
    for mode in args.isa_modes.split(","):
        if mode not in ("native", "avx2"):
            raise SystemExit(f"--isa-modes takes native and/or avx2, got {mode!r}")
        rows += child(
            ["--timing-child", *common, "--isa-mode", mode, "--threads", args.threads, "--dtypes", args.dtypes,
             "--repeats", str(args.repeats)],
            AVX2_ENV if mode == "avx2" else None,
        )  # fmt: skip
    memory = [
        child(["--memory-child", *common, "--dtypes", dtype_name, "--variant", variant])
        for dtype_name in args.dtypes.split(",")
        for variant in VARIANTS
    ]
    info["seconds"] = round(time.perf_counter() - started, 1)
    write(args, info, rows, memory)


if __name__ == "__main__":
    main()
