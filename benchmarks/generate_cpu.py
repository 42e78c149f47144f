"""CPU tokens/s of greedy generation: a loaded compressed 2:4 SmolLM2-135M vs the same model dense.

    PYTHONPATH=. python benchmarks/generate_cpu.py [--new-tokens 32] [--repeats 5] [--threads 1,2]

The dense model is SmolLM2-135M-Instruct (``hf_maskllm.embedded.load_smollm2``) with a magnitude
2:4 mask merged into every decoder linear (zeros in the weights); the compressed model is the same
model written by ``MaskModel.save_pretrained(..., merged=True)`` and read back with
``AutoModelForCausalLM.from_pretrained``, so both compute the same function. Rows:

- ``dense``: the merged dense model (plain ``nn.Linear``);
- ``compressed``: the loaded model as shipped (``SparseLinear`` with its decompressed-weight cache);
- ``compressed, no cache`` (with ``--no-cache-row``): a second instance of the compressed model
  with ``set_dense_cache(model, False)``: decompress in every call (what every CPU forward did
  before the cache).

Each repeat times one ``generate`` call per row, rows interleaved; the ratio columns are the medians
over repeats of (row / dense) measured back to back, from wall-clock tok/s and from process CPU time
per token (the CPU-time ratio is the steadier one on a shared machine: it does not count waiting for
a core). Memory: bytes of parameters and buffers
(tied tensors once), bytes of the caches after generation, and the process RSS growth at each load.
Writes ``benchmarks/results/generate_cpu.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press. Within decades"
)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tensor_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def cache_bytes(model: torch.nn.Module) -> int:
    from hf_maskllm.sparse import SparseLinear

    return sum(
        mod._cache.numel() * mod._cache.element_size()
        for mod in model.modules()
        if isinstance(mod, SparseLinear) and mod._cache is not None
    )


@torch.no_grad()
def generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """``(wall seconds, process CPU seconds, new token ids)`` of one greedy generate call."""
    start, cpu = time.perf_counter(), time.process_time()
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    return time.perf_counter() - start, time.process_time() - cpu, out[:, ids.shape[1] :]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-cache-row", action="store_true", help="also time decompress-per-call")
    parser.add_argument("--out", default=str(RESULTS / "generate_cpu"))
    args = parser.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    import hf_maskllm
    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.sparse import set_dense_cache

    torch.manual_seed(0)
    started = time.perf_counter()
    rows, memory = [], []
    tmp = Path(tempfile.mkdtemp(prefix="generate_cpu_"))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        gc.collect()
        rss0 = rss_bytes()
        dense, tokenizer = load_smollm2(dtype=dtype)
        folder = tmp / dtype_name
        mask_model = get_mask_model(dense, MaskConfig(n=2, m=4, prior="magnitude"))
        mask_model.save_pretrained(folder, merged=True)
        dense = mask_model.merge_and_unload().eval()
        del mask_model
        gc.collect()
        rss1 = rss_bytes()
        sparse = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        gc.collect()
        rss2 = rss_bytes()
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        variants = {"dense": dense, "compressed": sparse}
        if args.no_cache_row:  # a second instance: switching one model's cache off and on would rebuild it
            variants["compressed, no cache"] = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype
            ).eval()
            set_dense_cache(variants["compressed, no cache"], False)
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for model in variants.values():  # warm-up (and fills the caches)
                generate(model, ids, 4)
            times = {name: [] for name in variants}
            cpu_times = {name: [] for name in variants}
            tokens = {}
            for _ in range(args.repeats):
                for name, model in variants.items():
                    seconds, cpu_seconds, out = generate(model, ids, args.new_tokens)
                    times[name].append(seconds)
                    cpu_times[name].append(cpu_seconds)
                    tokens[name] = out
            for name in variants:
                ratios = [d / s for d, s in zip(times["dense"], times[name], strict=True)]
                cpu_ratios = [d / s for d, s in zip(cpu_times["dense"], cpu_times[name], strict=True)]
                rows.append(
                    {
                        "dtype": dtype_name,
                        "threads": threads,
                        "model": name,
                        "tok_s_median": args.new_tokens / statistics.median(times[name]),
                        "tok_s_all": [round(args.new_tokens / t, 2) for t in times[name]],
                        "ratio_vs_dense_median": statistics.median(ratios),
                        "ratio_min": min(ratios),
                        "cpu_ms_per_token_median": 1000
                        * statistics.median(cpu_times[name])
                        / args.new_tokens,
                        "cpu_ratio_vs_dense_median": statistics.median(cpu_ratios),
                        "same_tokens_as_dense": bool(torch.equal(tokens[name], tokens["dense"])),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        memory.append(
            {
                "dtype": dtype_name,
                "dense_tensor_bytes": tensor_bytes(dense),
                "compressed_tensor_bytes": tensor_bytes(sparse),
                "compressed_cache_bytes": cache_bytes(sparse),
                "rss_growth_dense_load": rss1 - rss0,
                "rss_growth_compressed_load": rss2 - rss1,
                "rss_after_generation": rss_bytes(),
            }
        )
        print(json.dumps(memory[-1]), flush=True)
        del dense, sparse, variants
        gc.collect()

    meta = {
        "command": "PYTHONPATH=. python benchmarks/generate_cpu.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.processor() or 'cpu'}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_maskllm": hf_maskllm.__version__,
        },
        "new_tokens": args.new_tokens,
        "prompt_tokens": int(ids.shape[1]),
        "repeats": args.repeats,
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({**meta, "rows": rows, "memory": memory}, indent=2) + "\n")
    mib = 1 / 2**20
    lines = [
        "# CPU generation: loaded compressed 2:4 SmolLM2-135M vs dense",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']} (shared, noisy); "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        f"Greedy `generate`, batch 1, {meta['prompt_tokens']}-token prompt, {args.new_tokens} new tokens, "
        f"{args.repeats} interleaved repeats; speed vs dense = median over repeats of (dense time / row time), "
        "from wall-clock time and from process CPU time.",
        "",
        "| dtype | threads | model | tok/s (median) | speed vs dense, wall | CPU ms / token | speed vs dense, CPU time | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['model']} | {r['tok_s_median']:.1f} | "
            f"{r['ratio_vs_dense_median']:.2f}x (min {r['ratio_min']:.2f}x) | {r['cpu_ms_per_token_median']:.0f} | "
            f"{r['cpu_ratio_vs_dense_median']:.2f}x | {r['same_tokens_as_dense']} |"
        )
    lines += [
        "",
        "Memory (MiB): parameters + buffers of each model (tied tensors once), the decompressed-weight caches "
        "of the compressed model after generating, and the process RSS growth when each model was loaded.",
        "",
        "| dtype | dense tensors | compressed tensors | + caches | RSS growth, dense load | RSS growth, compressed load |",
        "|---|---|---|---|---|---|",
    ]
    for m in memory:
        lines.append(
            f"| {m['dtype']} | {m['dense_tensor_bytes'] * mib:.1f} | {m['compressed_tensor_bytes'] * mib:.1f} | "
            f"{m['compressed_cache_bytes'] * mib:.1f} | {m['rss_growth_dense_load'] * mib:.1f} | "
            f"{m['rss_growth_compressed_load'] * mib:.1f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
