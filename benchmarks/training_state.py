"""Training-state memory of a real mask-learning run on SmolLM2-135M, everything held across steps counted.

A short ``learn_mask`` run with the defaults (bf16 logits, ``MaskAdamW``, ``MaskAnnealCallback``
with its statistics), then ``hf_maskllm.memory.training_state_bytes`` with the Trainer's callbacks:
logits, their gradients, the optimizer state, the callback's state and cached masks, per masked weight.

Run: HF_HUB_OFFLINE=1 python benchmarks/training_state.py [--steps 2 --seqlen 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from run_info import header_lines, run_info

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.data import causal_lm_dataset
from hf_maskllm.embedded import load_smollm2
from hf_maskllm.learn import learn_mask
from hf_maskllm.memory import training_state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
    train = causal_lm_dataset("wikipedia:train", tokenizer, seqlen=args.seqlen, max_samples=4 * args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = learn_mask(mask_model, train, max_steps=args.steps, output_dir=tmp, disable_tqdm=True)
    sizes = training_state_bytes(mask_model, trainer.optimizer, trainer.callback_handler.callbacks)
    masked = sum(layer.out_features * layer.in_features for layer in mask_model.masked_layers().values())
    per_weight = {k: v / masked for k, v in sizes.items()}
    setup = {
        "model": f"SmolLM2-135M-Instruct (embedded), 2:4 on all 210 linears: {masked:,} masked weights",
        "settings": "defaults: bf16 logits, MaskAdamW (8-bit second moment per logit), MaskAnnealCallback with statistics",
    }
    info = run_info("benchmarks/training_state.py")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_state.json").write_text(
        json.dumps(
            {
                **info,
                "args": vars(args),
                **setup,
                "masked_weights": masked,
                "bytes": sizes,
                "per_masked_weight": per_weight,
            },
            indent=2,
        )
        + "\n"
    )
    lines = [
        "# Training state held across steps, per masked weight",
        "",
        *header_lines(info),
        "",
        *[f"- {k}: {v}" for k, v in setup.items()],
        "",
        "| " + " | ".join(per_weight) + " |",
        "|" + "---:|" * len(per_weight),
        "| " + " | ".join(f"{v:.2f}" for v in per_weight.values()) + " |",
    ]
    (out / "training_state.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
