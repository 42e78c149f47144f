"""A model of real size on one machine: a Llama-3.2-1B-shaped checkpoint with random bf16 weights.

Nothing is downloaded: the config is Llama-3.2-1B's shape (16 layers, hidden 2048, MLP 8192, 32 heads,
8 KV heads, vocabulary 128,256, tied embeddings), the weights are seeded random bf16, saved in shards.
Each step runs in its own process, so its peak resident memory is its own:

- ``build``: the dense checkpoint and a saved magnitude 2:4 mask for it (setup, not measured);
- ``merge_checkpoint``: apply the saved mask to the dense checkpoint on disk and write the compressed 2:4
  checkpoint, one shard at a time (``hf_maskllm.merge_checkpoint``);
- ``apply_save``: the same in memory: load the dense model, ``MaskModel.from_pretrained`` with the mask,
  ``save_pretrained(merged=True)``;
- ``load_generate``: load the compressed checkpoint (``from_pretrained``) and generate tokens;
- ``learn``: a few mask-learning steps (bf16 logits, ``learn_mask``'s recipe) on random token ids.

Peak RSS is compared with the dense bf16 checkpoint's bytes, and for mask learning with the frozen
weights plus the training state the docs claim (bytes per masked weight) before activations.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/real_size.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPE = {  # Llama-3.2-1B
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
TINY = {**SHAPE, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 4096}


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def step_build(work: Path, shape: dict) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_maskllm import MaskConfig, get_mask_model

    torch.manual_seed(0)
    config = LlamaConfig(**shape, torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(work / "dense", max_shard_size="500MB")
    parameters = sum(p.numel() for p in model.parameters())  # before the mask logits join them
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
    mask_model.save_pretrained(work / "mask")
    return {
        "parameters": parameters,
        "masked_weights": sum(
            layer.out_features * layer.in_features for layer in mask_model.masked_layers().values()
        ),
        "dense_checkpoint_bytes": sum(p.stat().st_size for p in (work / "dense").glob("*.safetensors")),
        "mask_folder_bytes": _folder_bytes(work / "mask"),
    }


def _compressed_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def step_merge_checkpoint(work: Path, shape: dict) -> dict:
    from hf_maskllm import merge_checkpoint

    merge_checkpoint(
        work / "dense", work / "mask", work / "compressed", max_shard_size="500MB", progress=False
    )
    return {"compressed_checkpoint_bytes": _compressed_bytes(work / "compressed")}


def step_apply_save(work: Path, shape: dict) -> dict:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hf_maskllm import MaskModel

    model = AutoModelForCausalLM.from_pretrained(work / "dense", dtype=torch.bfloat16)
    mask_model = MaskModel.from_pretrained(model, work / "mask")
    out = work / "compressed_in_memory"
    mask_model.save_pretrained(out, merged=True, max_shard_size="500MB")
    del model, mask_model
    streamed = {}  # key -> file of what merge_checkpoint wrote
    for file in (work / "compressed").glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            streamed.update(dict.fromkeys(f.keys(), file))
    keys, identical = set(), True  # compared one tensor at a time
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                keys.add(key)
                if key not in streamed:
                    identical = False
                    continue
                with safe_open(str(streamed[key]), framework="pt") as g:
                    identical &= torch.equal(f.get_tensor(key), g.get_tensor(key))
    return {
        "compressed_checkpoint_bytes": _compressed_bytes(out),
        "same_tensors_as_merge_checkpoint": bool(identical and keys == set(streamed)),
    }


def step_load_generate(work: Path, shape: dict, new_tokens: int = 8) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import hf_maskllm  # noqa: F401  (registers the compressed format)

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(work / "compressed").eval()
    load_seconds = time.perf_counter() - start
    ids = torch.randint(0, shape["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return {
        "load_seconds": load_seconds,
        "generated": out.shape[1] - ids.shape[1],
        "generate_tok_s": new_tokens / seconds,
    }


def step_learn(work: Path, shape: dict, steps: int = 3, seqlen: int = 128) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.learn import learn_mask
    from hf_maskllm.memory import training_state_bytes

    model = AutoModelForCausalLM.from_pretrained(work / "dense", dtype=torch.bfloat16)
    mask_model = get_mask_model(model, MaskConfig(prior=str(work / "mask")))
    ids = torch.randint(0, shape["vocab_size"], (steps, seqlen), generator=torch.Generator().manual_seed(2))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    start = time.perf_counter()
    trainer = learn_mask(mask_model, data, max_steps=steps, batch_size=1, gradient_accumulation_steps=1, output_dir=str(work / "learn"),
                         logging_steps=1, disable_tqdm=True, save_strategy="no")  # fmt: skip
    seconds = time.perf_counter() - start
    state = training_state_bytes(mask_model, trainer.optimizer, trainer.callback_handler.callbacks)
    return {"steps": steps, "seqlen": seqlen, "seconds": seconds, "training_state_bytes": state}


STEPS = {
    "build": step_build,
    "merge_checkpoint": step_merge_checkpoint,
    "apply_save": step_apply_save,
    "load_generate": step_load_generate,
    "learn": step_learn,
}


def child(step: str, work: Path, tiny: bool, steps: dict | None = None) -> None:
    """Run one step (of ``steps``, default this script's) and print its result with its peak memory."""
    sys.path.insert(0, str(Path(__file__).parent))
    from run_info import rss_bytes, rss_peak_bytes

    import hf_maskllm  # noqa: F401  (imports counted in the baseline)

    baseline = rss_bytes()
    start = time.perf_counter()
    out = (steps or STEPS)[step](work, TINY if tiny else SHAPE)
    out.update(
        wall_seconds=time.perf_counter() - start, rss_baseline_bytes=baseline, rss_peak_bytes=rss_peak_bytes()
    )
    print("RESULT " + json.dumps(out, default=str), flush=True)


def run_step(step: str, work: Path, tiny: bool, script: str = __file__) -> dict:
    """Run ``script --child step`` in a process of its own and return the step's result."""
    print(f"{step} ...", flush=True)
    cmd = [sys.executable, script, "--child", step, "--work", str(work)] + (["--tiny"] if tiny else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"step {step} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    result = json.loads(lines[-1][len("RESULT ") :])
    print(f"{step}: {result}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/real_size", help="where the checkpoints are written")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same kind (a quick check)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "real_size"))
    args = p.parse_args()
    work = Path(args.work)
    if args.child:
        child(args.child, work, args.tiny)
        return
    work.mkdir(parents=True, exist_ok=True)
    results = {step: run_step(step, work, args.tiny) for step in STEPS}
    sys.path.insert(0, str(Path(__file__).parent))
    from run_info import header_lines, run_info

    build = results["build"]
    dense = build["dense_checkpoint_bytes"]
    for r in results.values():  # the step's own memory: its peak above what the imports hold
        r["rss_peak_above_baseline_bytes"] = r["rss_peak_bytes"] - r["rss_baseline_bytes"]
    ratios = {
        "merge_checkpoint_peak_rss_vs_dense_checkpoint": results["merge_checkpoint"][
            "rss_peak_above_baseline_bytes"
        ]
        / dense,
        "apply_save_peak_rss_vs_dense_checkpoint": results["apply_save"]["rss_peak_above_baseline_bytes"]
        / dense,
        "load_generate_peak_rss_vs_dense_checkpoint": results["load_generate"][
            "rss_peak_above_baseline_bytes"
        ]
        / dense,
        "compressed_vs_dense_checkpoint": results["merge_checkpoint"]["compressed_checkpoint_bytes"] / dense,
    }
    learn = results["learn"]
    state = learn["training_state_bytes"]
    per_weight = state["total"] / build["masked_weights"] if isinstance(state, dict) else None
    expected = dense + (per_weight or 0) * build["masked_weights"]
    ratios["learn_peak_rss_vs_weights_plus_state"] = learn["rss_peak_above_baseline_bytes"] / expected
    info = run_info("benchmarks/real_size.py")
    payload = {**info, "shape": TINY if args.tiny else SHAPE, "results": results, "ratios": ratios,
               "training_state_bytes_per_masked_weight": per_weight}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    gib = 2**30
    lines = [
        "# A Llama-3.2-1B-shaped model (random bf16 weights) on one machine",
        "",
        *header_lines(info),
        "",
        f"{build['parameters']:,} parameters, {build['masked_weights']:,} masked (2:4, every decoder linear); "
        f"dense bf16 checkpoint {dense / gib:.2f} GiB, saved mask {build['mask_folder_bytes'] / 2**20:.1f} MiB. "
        "Each step in its own process; the step's memory is its peak RSS above what the process held "
        f"after its imports ({results['apply_save']['rss_baseline_bytes'] / gib:.2f} GiB).",
        "",
        "| step | wall time | peak RSS | the step's memory | / dense checkpoint |",
        "|---|---:|---:|---:|---:|",
    ]
    for step in ("merge_checkpoint", "apply_save", "load_generate", "learn"):
        r = results[step]
        own = r["rss_peak_above_baseline_bytes"]
        lines.append(
            f"| {step} | {r['wall_seconds']:.1f} s | {r['rss_peak_bytes'] / gib:.2f} GiB | {own / gib:.2f} GiB | "
            f"{own / dense:.2f}x |"
        )
    lines += [
        "",
        f"- compressed checkpoint: {results['merge_checkpoint']['compressed_checkpoint_bytes'] / gib:.2f} GiB "
        f"({ratios['compressed_vs_dense_checkpoint']:.3f}x the dense one); merge_checkpoint (streamed, shard by "
        "shard) and apply_save (the model in memory: MaskModel.from_pretrained, save_pretrained(merged=True)) "
        "wrote the same tensors: "
        f"{'yes' if results['apply_save']['same_tensors_as_merge_checkpoint'] else 'NO'}",
        f"- load: {results['load_generate']['load_seconds']:.1f} s; generation: "
        f"{results['load_generate']['generate_tok_s']:.2f} tokens/s (greedy, batch 1)",
        f"- mask learning: {learn['steps']} steps x 1 x {learn['seqlen']} tokens in {learn['seconds']:.1f} s "
        f"(compilation included); training state {per_weight:.2f} bytes per masked weight; the step's memory "
        f"{ratios['learn_peak_rss_vs_weights_plus_state']:.2f}x the frozen weights plus that state "
        "(the rest: activations, compiled code, the data)",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
