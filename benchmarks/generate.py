"""Tokens/s of greedy generation, dense vs 2:4 (Triton ``nm_linear``), on Llama-shaped random models.

GPU:  PYTHONPATH=. python benchmarks/generate.py [--models 1b,8b] [--batches 1,8] [--out results/generate.md]
CPU:  TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/generate.py --dry-run   (tiny model, no timing claims)

Writes the table to ``--out`` (.md; default ``benchmarks/results/generate.md``, none for a dry run) and
every number in it to the .json beside it, headed by the command, date, machine, versions (CUDA and
Triton included) and git commit, and the GPU.

Weights are random (the real checkpoints cannot be carried to the GPU machine); every linear of the
decoder layers is magnitude-pruned to 2:4, so the dense and sparse models compute the same function.
Generation uses a static KV cache and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); the
2:4 model's linears are ``SparseLinear`` modules that call the opaque custom op ``hf_maskllm::nm_linear``.
Timed: one full ``generate`` call (128-token prompt + N new tokens) after a warm-up call that compiles.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from run_info import gpu_info, header_lines, run_info
from torch import nn

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True),
}  # fmt: skip


def build_model(name: str, dtype: torch.dtype, device: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name], max_position_embeddings=4096)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@torch.no_grad()
def prune_24_(model: nn.Module) -> int:
    """Magnitude 2:4 on every nn.Linear of the decoder layers, in place; returns how many."""
    count = 0
    for module in model.model.layers.modules():
        if isinstance(module, nn.Linear):
            w = module.weight.view(module.out_features, -1, 4)
            drop = w.abs().topk(2, dim=-1, largest=False).indices
            w.scatter_(-1, drop, 0.0)
            count += 1
    return count


def sparse_linear_class(use_package: bool = True):
    """``hf_maskllm.sparse.linear.SparseLinear`` (when present and wanted), else a minimal ``nm_linear`` module.

    ``SparseLinear`` calls the kernel on CUDA only; the dry run on CPU uses the minimal module so that the
    custom op and the interpreted kernels run inside generation too.
    """
    if use_package:
        try:
            from hf_maskllm.sparse.linear import SparseLinear

            return SparseLinear
        except ImportError:
            pass
    from hf_maskllm.kernels import nm_linear
    from hf_maskllm.sparse.format import compress

    class NMLinear(nn.Module):
        def __init__(self, values, meta, bias, in_features):
            super().__init__()
            self.register_buffer("values", values)
            self.register_buffer("meta", meta)
            self.bias, self.in_features = bias, in_features

        def forward(self, x):
            return nm_linear(x, self.values, self.meta, 2, 4, self.in_features, self.bias)

        @classmethod
        def from_dense(cls, linear, n=2, m=4):
            values, meta = compress(linear.weight.detach(), n, m)
            return cls(values, meta, linear.bias, linear.in_features)

    return NMLinear


@torch.no_grad()
def to_sparse_(model: nn.Module, use_package: bool = True) -> int:
    """Replace every nn.Linear of the decoder layers by the 2:4 sparse module (weights freed)."""
    cls = sparse_linear_class(use_package)
    count = 0
    for layer in model.model.layers:
        for parent in layer.modules():
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, child_name, cls.from_dense(child, 2, 4))
                    count += 1
    gc.collect()
    return count


def cells(row: dict) -> list[str]:
    """A row's cells in the markdown table."""
    return [
        row["model"], str(row["batch"]), str(row["linears_24"]), f"{row['dense_tok_s']:.1f}",
        f"{row['sparse_tok_s']:.1f}", f"{row['speedup']:.2f}x", f"{row['same_tokens']:.2f}",
    ]  # fmt: skip


@torch.no_grad()
def time_generate(model, batch: int, prompt_len: int, new_tokens: int, device: str, compile_: bool):
    """(seconds of one timed generate call, generated ids) after one warm-up call."""
    from transformers.generation.configuration_utils import CompileConfig

    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, cache_implementation="static", pad_token_id=0,
    )  # fmt: skip
    if compile_:
        kwargs["compile_config"] = CompileConfig(mode="reduce-overhead")
    else:
        kwargs["disable_compile"] = True
    model.generate(ids, **kwargs)  # warm-up: compile, autotune, record CUDA graphs
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, prompt_len:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="1b,8b", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="1b only, batch 1, 128 new tokens")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip what would start after this")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny model on CPU (TRITON_INTERPRET=1), eager"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the markdown table (.md), the .json beside it (default: benchmarks/results/generate.md; "
        "a dry run writes only where --out says)",
    )
    args = parser.parse_args()

    models, batches = args.models.split(","), [int(b) for b in args.batches.split(",")]
    prompt, new_tokens = args.prompt, args.new_tokens
    if args.quick:
        models, batches, new_tokens = ["1b"], [1], 128
    if args.dry_run:
        models, batches, prompt, new_tokens = ["tiny"], [1, 2], 10, 4  # batch 2 prefill: 20 tokens -> tl.dot
        device, dtype, compile_ = (
            ("cuda", torch.bfloat16, True) if torch.cuda.is_available() else ("cpu", torch.float32, False)
        )
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU; use --dry-run with TRITON_INTERPRET=1 on CPU")
        device, dtype, compile_ = "cuda", torch.bfloat16, True

    t_start = time.perf_counter()
    rows = []
    for name in models:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipping {name}: past --budget-s {args.budget_s:.0f}")
            continue
        model = build_model(name, dtype, device)
        n_pruned = prune_24_(model)
        dense = {}
        for batch in batches:
            dense[batch] = time_generate(model, batch, prompt, new_tokens, device, compile_)
            print(f"{name} dense batch {batch}: {batch * new_tokens / dense[batch][0]:.1f} tok/s", flush=True)
        to_sparse_(model, use_package=device == "cuda")
        torch._dynamo.reset()  # new modules: recompile from scratch
        if device == "cuda":
            torch.cuda.empty_cache()
        for batch in batches:
            t_sparse, ids_sparse = time_generate(model, batch, prompt, new_tokens, device, compile_)
            t_dense, ids_dense = dense[batch]
            # random weights give near-tied logits; report agreement of the first tokens, do not assert
            same = (ids_sparse == ids_dense).float().mean().item()
            rows.append({
                "model": name, "batch": batch, "linears_24": n_pruned, "dense_seconds": t_dense,
                "sparse_seconds": t_sparse, "dense_tok_s": batch * new_tokens / t_dense,
                "sparse_tok_s": batch * new_tokens / t_sparse, "speedup": t_dense / t_sparse, "same_tokens": same,
            })  # fmt: skip
            print(f"{name} 2:4 batch {batch}: " + " | ".join(cells(rows[-1])), flush=True)
        del model, dense
        gc.collect()
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()

    header = ("model", "batch", "linears 2:4", "dense tok/s", "2:4 tok/s", "speedup", "same tokens")
    gpu = gpu_info(device)
    where = gpu["name"] if device == "cuda" else "CPU (dry run, eager, no timing claims)"
    seconds = time.perf_counter() - t_start
    info = run_info("benchmarks/generate.py")
    info["versions"].update({k: v for k, v in gpu.items() if k != "name"})
    setup = {
        "device": device, "where": where, "dtype": str(dtype), "prompt_tokens": prompt, "new_tokens": new_tokens,
        "compiled": compile_, "seconds": seconds,
    }  # fmt: skip
    lines = [
        "# Greedy generation, dense vs 2:4 (Triton nm_linear), Llama-shaped random models",
        "",
        *header_lines(info),
        "",
        f"Greedy generation, {dtype}, prompt {prompt}, {new_tokens} new tokens, static cache"
        f"{' + torch.compile(reduce-overhead)' if compile_ else ''}, {where} ({seconds:.0f} s)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells(r)) + " |" for r in rows),
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    out = args.out or (None if args.dry_run else "benchmarks/results/generate.md")
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(table)
        results = {
            **info,
            **({"gpu": gpu} if device == "cuda" else {}),
            "args": vars(args),
            **setup,
            "rows": rows,
        }
        out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
