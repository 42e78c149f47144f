"""Cost of a masked training step on SmolLM2-135M-Instruct: frozen dense forward+backward vs masked (eager, compiled).

The dense baseline is what mask learning must at least pay: forward + backward to the inputs with
every weight frozen. The masked step adds sampling the 2:4 masks (26.5 M groups), the weight
gradient of every masked linear, and the logits' gradient. Prints median seconds of `--repeats`
runs after one warm-up, the ratio to dense, and the process's peak RSS after each configuration.

Run: HF_HUB_OFFLINE=1 python benchmarks/train_step.py [--batch 2 --seqlen 256 --repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.adapters.sampling import set_compiled_sampling
from hf_maskllm.embedded import load_smollm2


def timed(step, repeats: int) -> float:
    step()  # warm-up (and compile)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_smollm2()
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(
        0, model.config.vocab_size, (args.batch, args.seqlen), generator=torch.Generator().manual_seed(0)
    )

    def dense_step() -> None:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        model(inputs_embeds=embeds, labels=ids).loss.backward()

    rows = [("dense, frozen (backward to the inputs)", timed(dense_step, args.repeats), peak_rss_gib())]
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
    mask_model.train()

    def masked_step() -> None:
        mask_model(input_ids=ids, labels=ids).loss.backward()
        for p in mask_model.parameters():
            p.grad = None

    rows.append(("masked 2:4, eager sampling", timed(masked_step, args.repeats), peak_rss_gib()))
    set_compiled_sampling(True)
    rows.append(("masked 2:4, compiled sampling", timed(masked_step, args.repeats), peak_rss_gib()))
    dense = rows[0][1]
    print(
        f"SmolLM2-135M-Instruct, fp32, batch {args.batch} x {args.seqlen} tokens, {torch.get_num_threads()} threads"
    )
    print("| step | median s | vs dense | peak RSS so far |")
    print("|---|---:|---:|---:|")
    for label, seconds, rss in rows:
        print(f"| {label} | {seconds:.2f} | {seconds / dense:.2f}x | {rss:.1f} GiB |")


if __name__ == "__main__":
    main()
