"""``MaskTrainingArguments``: ``TrainingArguments`` whose defaults are hf_maskllm's mask-learning recipe.

A plain ``TrainingArguments`` trains the logits with weight decay 0.0, a linear LR schedule and a
learning rate of 5e-5; the MaskLLM reference trains them with weight decay 0.1, AdamW betas
(0.9, 0.95), a cosine schedule from 5e-4 down to 10% of it, gradient clipping at 1.0 and micro-batches
of one sequence (each forward draws one mask sample, so every sequence gets its own). This class
changes only those defaults (every argument can still be set), with two departures from the
reference: the learning rate stays constant at 5e-4, which learns better masks from the same tokens,
and a micro-batch holds two sequences that share one mask sample, which learns as much per token at a
cheaper step (docs/training.md). ``PAPER_LR_SCHEDULE`` holds the reference's cosine schedule and
``per_device_train_batch_size=1`` its sample per sequence. :func:`recipe_departures` lists how a run's
settings differ from the recipe (``MaskAnnealCallback`` warns with that list; the paper's schedule and
micro-batches of one sequence are not departures).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

__all__ = ["PAPER_LR_SCHEDULE", "RECIPE", "MaskTrainingArguments", "recipe_departures"]

RECIPE: dict[str, Any] = {
    "learning_rate": 5e-4,
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "lr_scheduler_type": "constant",
    "max_grad_norm": 1.0,
    "per_device_train_batch_size": 2,
}
# The MaskLLM reference's schedule: cosine decay from the peak to 10% of it. Pass these two arguments
# (``MaskTrainingArguments(**PAPER_LR_SCHEDULE)``, ``learn_mask(..., **PAPER_LR_SCHEDULE)``) to run it.
PAPER_LR_SCHEDULE: dict[str, Any] = {
    "lr_scheduler_type": "cosine_with_min_lr",
    "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
}


@dataclass
class MaskTrainingArguments(TrainingArguments):
    """``transformers.TrainingArguments`` with hf_maskllm's recipe as defaults (see the module docstring).

    Pair it with ``optimizer_cls_and_kwargs=(MaskAdamW, {"lr": args.learning_rate})`` and a
    :class:`~hf_maskllm.MaskAnnealCallback`; :func:`hf_maskllm.learn.learn_mask` does all three.
    """

    learning_rate: float = field(
        default=RECIPE["learning_rate"], metadata={"help": "Peak learning rate of the logits (recipe: 5e-4)."}
    )
    weight_decay: float = field(
        default=RECIPE["weight_decay"],
        metadata={"help": "Decoupled weight decay on the logits (recipe: 0.1)."},
    )
    adam_beta2: float = field(default=RECIPE["adam_beta2"], metadata={"help": "AdamW beta2 (recipe: 0.95)."})
    lr_scheduler_type: str = field(
        default=RECIPE["lr_scheduler_type"],
        metadata={"help": "Constant (the recipe's; the paper's: 'cosine_with_min_lr' with min_lr_rate 0.1)."},
    )
    per_device_train_batch_size: int = field(
        default=RECIPE["per_device_train_batch_size"],
        metadata={
            "help": "Sequences per micro-batch; each forward draws one mask sample (recipe: 2; the reference: 1)."
        },
    )


def _logit_groups(optimizer: Any, mask_model: Any) -> list[dict[str, Any]]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
    logits = {id(p) for p in mask_model.parameters() if p.requires_grad}
    return [g for g in getattr(inner, "param_groups", []) if any(id(p) in logits for p in g["params"])]


def recipe_departures(args: TrainingArguments, optimizer: Any, mask_model: Any) -> list[str]:
    """Each way ``args`` and ``optimizer`` differ from the recipe for ``mask_model``'s logits, in words."""
    out = []
    groups = _logit_groups(optimizer, mask_model)
    decays = sorted({float(g.get("weight_decay", 0.0)) for g in groups})
    if groups and decays != [RECIPE["weight_decay"]]:
        out.append(f"weight decay on the logits {decays} (recipe 0.1)")
    betas = sorted({tuple(g["betas"]) for g in groups if "betas" in g})
    if betas and betas != [(RECIPE["adam_beta1"], RECIPE["adam_beta2"])]:
        out.append(f"AdamW betas {betas} (recipe (0.9, 0.95))")
    peaks = sorted({float(g.get("initial_lr", g["lr"])) for g in groups})
    if peaks and peaks != [float(args.learning_rate)]:
        out.append(
            f"the optimizer's learning rate {peaks} differs from TrainingArguments.learning_rate="
            f"{args.learning_rate}, which the logs and your script may assume"
        )
    elif float(args.learning_rate) != RECIPE["learning_rate"]:
        out.append(f"learning rate {args.learning_rate} (recipe 5e-4)")
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    kwargs = args.lr_scheduler_kwargs if isinstance(args.lr_scheduler_kwargs, dict) else {}
    recognised = kind in (RECIPE["lr_scheduler_type"], "constant_with_warmup") or (
        kind == PAPER_LR_SCHEDULE["lr_scheduler_type"]
        and kwargs.get("min_lr_rate") == PAPER_LR_SCHEDULE["lr_scheduler_kwargs"]["min_lr_rate"]
    )
    if not recognised:
        out.append(
            f"LR schedule {kind!r} (recipe: lr_scheduler_type='constant'; the paper's cosine to 10%, "
            "lr_scheduler_type='cosine_with_min_lr' with lr_scheduler_kwargs={'min_lr_rate': 0.1}, is accepted too)"
        )
    warmup = float(getattr(args, "warmup_steps", 0) or 0) + float(getattr(args, "warmup_ratio", 0) or 0)
    if kind == "constant" and warmup > 0:
        out.append(
            "warm-up requested, but transformers ignores it with lr_scheduler_type='constant': "
            "use lr_scheduler_type='constant_with_warmup'"
        )
    if float(args.max_grad_norm) != RECIPE["max_grad_norm"]:
        out.append(f"gradient clipping at {args.max_grad_norm} (recipe 1.0)")
    batch = int(args.per_device_train_batch_size)
    if batch > RECIPE["per_device_train_batch_size"]:
        out.append(
            f"micro-batches of {batch} sequences share one mask sample (recipe: at most 2 per sample, "
            "per_device_train_batch_size=2; raise gradient_accumulation_steps for more tokens per step)"
        )
    return out
