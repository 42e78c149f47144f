"""Cost of a masked training step on SmolLM2-135M-Instruct against a frozen dense forward + backward.

The dense baseline is what mask learning must at least pay: forward + backward to the inputs with
every weight frozen. The masked step (the defaults: bf16 logits, fused sampling, MaskAdamW) adds
sampling the 2:4 masks of 26.5 M groups, the weight gradient of every masked linear (one more
matmul per linear: about 1.4x by itself), the logits' gradient, and the optimizer step. Each
configuration runs in its own process (so its peak RSS is its own): median seconds of ``--repeats``
steps after two warm-up steps (compilation), ratio to dense at the same token count, peak RSS.

Run: HF_HUB_OFFLINE=1 python benchmarks/train_step.py [--shapes 2x256,4x512 --repeats 3 --bf16 --device cuda]
GPU machine (no SmolLM2 file there): add ``--model llama-1b`` (Llama-3.2-1B shape, random weights:
the step's cost does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

MODES = {
    "dense": "dense, frozen (backward to the inputs)",
    "masked": "masked 2:4, fused + compiled sampling, MaskAdamW step",
    "masked-eager": "masked 2:4, fused eager sampling, MaskAdamW step",
}


LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
)  # fmt: skip


def load_model(name: str):
    """SmolLM2-135M-Instruct (the embedded real model) or a random Llama-3.2-1B-shaped model."""
    if name == "smollm2":
        from hf_maskllm.embedded import load_smollm2

        return load_smollm2()[0]
    if name == "llama-1b":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**LLAMA_1B))
    raise SystemExit(f"unknown --model {name!r}; use smollm2 or llama-1b")


def child(mode: str, batch: int, seqlen: int, repeats: int, bf16: bool, device: str, model_name: str) -> dict:
    from hf_maskllm import MaskAdamW, MaskConfig, get_mask_model
    from hf_maskllm.optim import training_state_bytes

    model = load_model(model_name)
    model.to(device).train()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(
        0, model.config.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    state_bytes = None
    if mode == "dense":

        def step() -> None:
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            with autocast:
                loss = model(inputs_embeds=embeds, labels=ids).loss
            loss.backward()

    else:
        mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
        mask_model.train()
        mask_model.sparse_reg_weight = 1e-5
        mask_model.set_compiled_sampling(mode == "masked")
        optimizer = MaskAdamW(mask_model.parameters(), lr=5e-4)

        def step() -> None:
            with autocast:
                loss = mask_model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()
    step()  # warm-up, compilation
    sync()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        runs.append(time.perf_counter() - start)
    if mode != "dense":
        sizes = training_state_bytes(mask_model, optimizer)
        masked = sum(layer.out_features * layer.in_features for layer in mask_model.masked_layers().values())
        state_bytes = sum(sizes.values()) / masked
    return {
        "seconds": statistics.median(runs),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.device(device).type == "cuda"
        else None,
        "state_bytes_per_weight": state_bytes,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="2x256,4x512", help="batch x seqlen per step, comma separated")
    parser.add_argument("--modes", default="dense,masked,masked-eager")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast for both (default: float32 compute)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default="smollm2", help="smollm2 (real, embedded) or llama-1b (random)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        batch, seqlen = (int(v) for v in args.shapes.split("x"))
        print(json.dumps(child(args.child, batch, seqlen, args.repeats, args.bf16, args.device, args.model)))
        return
    rows = []
    for shape in args.shapes.split(","):
        batch, seqlen = (int(v) for v in shape.split("x"))
        for mode in args.modes.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--shapes",
                shape,
                "--repeats",
                str(args.repeats),
            ]
            cmd += ["--bf16"] if args.bf16 else []
            cmd += ["--device", args.device, "--model", args.model]
            out = (
                subprocess.run(cmd, capture_output=True, text=True, check=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            rows.append((batch * seqlen, mode, json.loads(out)))
            print(shape, mode, rows[-1][2], flush=True)
    where = args.device if args.device != "cpu" else f"{rows[0][2]['threads']} CPU threads"
    title = {"smollm2": "SmolLM2-135M-Instruct", "llama-1b": "Llama-3.2-1B shape (random weights)"}[
        args.model
    ]
    print(f"\n{title}, {'bf16 autocast' if args.bf16 else 'float32'}, {where}")
    print("| tokens / step | step | median s | vs dense | peak RSS | peak GPU | training state |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for tokens, mode, r in rows:
        dense = next(x for t, m, x in rows if t == tokens and m == "dense")["seconds"]
        state = f"{r['state_bytes_per_weight']:.2f} B / masked weight" if r["state_bytes_per_weight"] else ""
        gpu = f"{r['peak_gpu_gib']:.2f} GiB" if r.get("peak_gpu_gib") is not None else ""
        print(
            f"| {tokens} | {MODES[mode]} | {r['seconds']:.2f} | {r['seconds'] / dense:.2f}x | "
            f"{r['peak_rss_gib']:.2f} GiB | {gpu} | {state} |"
        )


if __name__ == "__main__":
    main()
