"""Which GPUs fit mask learning on Llama-3.2-1B, Llama-3-8B and Llama-3-70B: arithmetic, not a GPU run.

    HF_HUB_OFFLINE=1 python benchmarks/capacity.py [--activation-gb 6,8,14]

Each model is built from its published dimensions on the ``meta`` device (no weights, no download);
its parameters are counted, and its masked weights are those hf_maskllm's default ``MaskConfig``
selects (``find_targets`` with ``target_modules="all-linear"``: every Linear but the output
embedding, i.e. every q, k, v, o, gate, up and down projection of the decoder blocks).

Memory = frozen weights (bf16, 2 bytes per parameter) + training state (masked weights x bytes per
masked weight) + activations, for three settings:

- ``default``: the measured total of ``benchmarks/results/training_state.json`` (logits, gradients,
  ``MaskAdamW``, ``MaskAnnealCallback``);
- ``group``: the same with ``MaskAdamW(second_moment="group")``, whose one float32 per group of 4
  weights (1 byte per weight) replaces one byte per logit (1.5 per weight): default - 0.5;
- ``reference``: float32 logits with ``torch.optim.AdamW``, as NVlabs/MaskLLM: 6 + 6 + 12 = 24.

FSDP divides weights and training state by the number of GPUs; activations do not divide and are
an allowance given on the command line (an assumption, not a measurement). Writes
``benchmarks/results/capacity.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from run_info import header_lines, run_info
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_maskllm import MaskConfig
from hf_maskllm.adapters.targets import find_targets

RESULTS = Path(__file__).resolve().parent / "results"
COMMON = {"num_key_value_heads": 8, "vocab_size": 128256}
MODELS = {
    "Llama-3.2-1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "tie_word_embeddings": True},
    "Llama-3-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "tie_word_embeddings": False},
    "Llama-3-70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "tie_word_embeddings": False},
}  # fmt: skip
# fp32 logits (1.5 per 2:4 weight, 4 bytes each), their gradients, torch AdamW's two fp32 states per logit
REFERENCE = {"logits": 6.0, "grads": 6.0, "optimizer": 12.0}
GPUS_GB = (24, 40, 80, 141)
SHARDS = (1, 2, 4, 8, 16, 32)
GB = 1e9


def count(dims: dict) -> dict:
    """Parameters, masked layers and masked weights of a model built on the ``meta`` device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, **dims}))
    config = MaskConfig()
    targets = find_targets(model, config.target_modules, config.exclude_modules, config.m, config.strict)
    modules = dict(model.named_modules())
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "masked_layers": len(targets),
        "masked_weights": sum(modules[name].weight.numel() for name in targets),
        "unmasked_linears": [
            n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n not in targets
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--activation-gb",
        default="6,8,14",
        help="activation allowance per GPU in GB, one per model (1B, 8B, 70B) or one for all",
    )
    parser.add_argument("--out", default=str(RESULTS / "capacity"))
    args = parser.parse_args()
    allowance = [float(x) for x in args.activation_gb.split(",")]
    allowance = dict(zip(MODELS, allowance * len(MODELS) if len(allowance) == 1 else allowance, strict=True))
    info = run_info("benchmarks/capacity.py")

    measured = json.loads((RESULTS / "training_state.json").read_text())["per_masked_weight"]
    per_weight = {
        "default": measured["total"],
        "group": measured["total"] - 0.5,
        "reference": sum(REFERENCE.values()),
    }
    models = {}
    for name, dims in MODELS.items():
        row = {"config": {**COMMON, **dims}, **count(dims), "activation_gb": allowance[name]}
        row["frozen_weights_gb"] = 2 * row["parameters"] / GB
        # what FSDP gathers while one decoder layer runs: its bf16 weights, logits and their gradients
        layer = row["masked_weights"] / dims["num_hidden_layers"]
        row["gathered_layer_gb"] = layer * (2 + measured["params"] + measured["grads"]) / GB
        row["state_gb"] = {s: row["masked_weights"] * b / GB for s, b in per_weight.items()}
        row["total_gb"] = {s: row["frozen_weights_gb"] + st for s, st in row["state_gb"].items()}
        row["per_gpu_gb"] = {s: {str(n): t / n for n in SHARDS} for s, t in row["total_gb"].items()}
        row["fits"] = {}
        for s, total in row["total_gb"].items():
            row["fits"][s] = {}
            for gpu in GPUS_GB:
                n = next((n for n in SHARDS if total / n + allowance[name] <= gpu), None)
                each = None if n is None else total / n + allowance[name]
                row["fits"][s][str(gpu)] = {"gpus": n, "per_gpu_gb": each}
        models[name] = row

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(
        json.dumps(
            {
                **info,
                "args": vars(args),
                "bytes_per_masked_weight": per_weight,
                "training_state": measured,
                "gpus_gb": GPUS_GB,
                "shards": SHARDS,
                "models": models,
            },
            indent=2,
        )  # fmt: skip
        + "\n"
    )
    settings = {
        "default": f"default ({per_weight['default']:.2f} B)",
        "group": f'`second_moment="group"` ({per_weight["group"]:.2f} B)',
        "reference": f"reference ({per_weight['reference']:.0f} B)",
    }
    lines = [
        "# Capacity: which GPUs fit mask learning on Llama-3 models (arithmetic)",
        "",
        *header_lines(info),
        "",
        "Arithmetic on counted parameters and measured bytes per masked weight; nothing here was run on a "
        "GPU. Parameters and masked weights are counted on each model built from its published dimensions "
        "on the `meta` device; masked weights are those hf_maskllm's default `MaskConfig` selects "
        '(`find_targets`, `target_modules="all-linear"`: every q, k, v, o, gate, up and down projection; '
        f"left dense: {', '.join(sorted({n for r in models.values() for n in r['unmasked_linears']}))}).",
        "",
        "Bytes per masked 2:4 weight held across steps: "
        f"default {per_weight['default']:.2f} (measured by `benchmarks/training_state.py`, "
        "`training_state.json`: " + ", ".join(f"{k} {v:.2f}" for k, v in measured.items() if v) + "); "
        f'`second_moment="group"` {per_weight["group"]:.2f} (the default less 0.5: one float32 per group of '
        "4 weights, 1 byte per weight, instead of one 8-bit second moment per logit, 1.5 per weight; not "
        f"measured here); reference {per_weight['reference']:.0f} (float32 logits with torch AdamW, as "
        "NVlabs/MaskLLM: logits 6, gradients 6, AdamW 12, the accounting of "
        "`hf_maskllm.memory.training_state_bytes`). Frozen weights: bf16, 2 bytes per parameter. GB = 1e9 bytes.",
        "",
        "| model | parameters | masked weights | frozen bf16 weights | "
        + " | ".join(f"state, {label}" for label in settings.values())
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(settings),
    ]
    for name, r in models.items():
        lines.append(
            f"| {name} | {r['parameters'] / 1e9:.2f} B | {r['masked_weights'] / 1e9:.2f} B | "
            f"{r['frozen_weights_gb']:.1f} GB | "
            + " | ".join(f"{r['state_gb'][s]:,.1f} GB" for s in settings)
            + " |"
        )
    lines += [
        "",
        "Weights + training state per GPU under FSDP (both sharded), without activations, GB:",
        "",
        "| model | setting | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in SHARDS) + " |",
        "|---|---|" + "---:|" * len(SHARDS),
    ]
    for name, r in models.items():
        for s, label in settings.items():
            cells = " | ".join(f"{r['per_gpu_gb'][s][str(n)]:,.1f}" for n in SHARDS)
            lines.append(f"| {name} | {label} | {cells} |")
    lines += [
        "",
        "Fewest GPUs (of 1, 2, 4, ..., 32) on which weights + training state per GPU + an activation "
        "allowance fit the GPU's nominal memory (the CUDA context and allocator fragmentation are not "
        "counted). The allowance is an assumption, not a measurement: "
        + ", ".join(f"{a:g} GB for {n}" for n, a in allowance.items())
        + f" (`--activation-gb {args.activation_gb}`). Under FSDP the layer being computed is also held "
        "whole (its bf16 weights, logits and their gradients, default settings: "
        + ", ".join(f"{r['gathered_layer_gb']:.1f} GB for one layer of {n}" for n, r in models.items())
        + "); it is not counted separately, the allowance has to cover it. Cells: GPUs (GB used on each).",
        "",
        "| model | setting | " + " | ".join(f"{g} GB GPUs" for g in GPUS_GB) + " |",
        "|---|---|" + "---|" * len(GPUS_GB),
    ]
    for name, r in models.items():
        for s, label in settings.items():
            cells = [r["fits"][s][str(g)] for g in GPUS_GB]
            text = [f"{c['gpus']} ({c['per_gpu_gb']:.0f})" if c["gpus"] else f"> {SHARDS[-1]}" for c in cells]
            lines.append(f"| {name} | {label} | " + " | ".join(text) + " |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
