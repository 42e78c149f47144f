"""``learn_mask``: the one mask-learning pipeline (a plain ``transformers.Trainer`` run).

The CLI's main job, the examples and the quality benchmark all call this function, so there is
one training recipe. Defaults follow the MaskLLM reference implementation: only the logits train,
AdamW betas (0.9, 0.95), weight decay 0.1 on the logits, lr 5e-4, grad clip 1.0
(:class:`~hf_maskllm.MaskTrainingArguments`), tau and kappa annealed by :class:`MaskAnnealCallback`;
the learning rate stays constant where the reference decays it to 10% with a cosine
(``learn_mask(..., **hf_maskllm.training_args.PAPER_LR_SCHEDULE)`` runs the reference's), and a step's
two sequences share one mask sample where the reference draws one per sequence
(``batch_size=1, gradient_accumulation_steps=2``).
A plain ``Trainer`` with those three pieces runs the same recipe.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch
from transformers import Trainer, default_data_collator

from .adapters.callback import MaskAnnealCallback
from .adapters.model import MaskModel
from .errors import ConfigError
from .optim import MaskAdamW, compiler_available
from .training_args import MaskTrainingArguments

__all__ = ["learn_mask"]


def learn_mask(
    mask_model: MaskModel,
    train_dataset: Any,
    max_steps: int,
    learning_rate: float = 5e-4,
    batch_size: int = 2,
    gradient_accumulation_steps: int = 1,
    output_dir: str | None = None,
    logging_steps: int = 10,
    bf16: bool | None = None,
    seed: int = 0,
    disable_tqdm: bool = False,
    compile_sampling: bool | None = None,
    callbacks: list[Any] | None = None,
    optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
    **training_args: Any,
) -> Trainer:
    """Learn the masks of ``mask_model`` on ``train_dataset`` (``input_ids`` / ``labels`` columns).

    Returns the Trainer (its ``state.log_history`` holds loss, tau, kappa, flip rate, max prob).
    ``batch_size`` sequences go through each forward, which draws one mask sample; a step sums
    ``gradient_accumulation_steps`` of them. The default, one micro-batch of two sequences, shares one
    sample between them; ``batch_size=1, gradient_accumulation_steps=2`` gives every sequence its own,
    as the reference trains, at a dearer step and no measured gain per token (docs/training.md). A
    ``batch_size`` above 2 is named as a departure from the recipe.
    The optimizer is :class:`~hf_maskllm.MaskAdamW` (betas (0.9, 0.95), weight decay 0.1 on the
    logits); ``optimizer_cls_and_kwargs`` replaces it (as in ``Trainer``; e.g. ``(torch.optim.AdamW,
    {"lr": 5e-4, "betas": (0.9, 0.95)})`` for the reference setting with fp32 logits).
    ``compile_sampling`` fuses the mask sampling with ``torch.compile`` (default: when a compiler is
    available; see ``benchmarks/train_step.py``). ``callbacks`` join the Trainer's; a
    :class:`MaskAnnealCallback` among them is used (with its settings) instead of a default one. Extra keyword arguments go to
    :class:`transformers.TrainingArguments` and override the recipe.
    """
    use_cuda = torch.cuda.is_available()
    if bf16 is None:
        bf16 = use_cuda and torch.cuda.is_bf16_supported()
    settings: dict[str, Any] = {
        "output_dir": output_dir or tempfile.mkdtemp(prefix="hf_maskllm-"),
        "max_steps": max_steps,
        "per_device_train_batch_size": batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "learning_rate": learning_rate,
        "logging_steps": logging_steps,
        "seed": seed,
        "data_seed": seed,
        "disable_tqdm": disable_tqdm,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": not use_cuda,
        "remove_unused_columns": True,
    }
    if "fp16" not in training_args:
        settings["bf16"] = bf16
    args = MaskTrainingArguments(**{**settings, **training_args})  # the caller's TrainingArguments win
    callbacks = list(callbacks or [])
    anneal = [cb for cb in callbacks if isinstance(cb, MaskAnnealCallback)]
    if len(anneal) > 1:
        raise ConfigError("callbacks holds more than one MaskAnnealCallback; pass one.")
    if anneal:  # the caller's own, with its settings (check_recipe, log_mask_stats, compile_sampling)
        theirs = anneal[0].compile_sampling
        if compile_sampling is not None and theirs != compile_sampling:
            raise ConfigError(
                f"compile_sampling={compile_sampling} but the MaskAnnealCallback in callbacks has "
                f"compile_sampling={theirs}; pass it to MaskAnnealCallback(compile_sampling=...) alone."
            )
        compile_sampling = theirs
    if compile_sampling and not compiler_available():
        warnings.warn(
            "No C++ compiler found: torch.compile cannot fuse mask sampling on CPU; using eager.",
            stacklevel=2,
        )
        compile_sampling = False
    if not anneal:
        callbacks.insert(0, MaskAnnealCallback(compile_sampling=compile_sampling))
    if optimizer_cls_and_kwargs is None:
        optimizer_kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2)}
        optimizer_kwargs["eps"] = args.adam_epsilon
        if compile_sampling is not None:  # the optimizer's update compiles when the sampling does
            optimizer_kwargs["compile"] = compile_sampling
        optimizer_cls_and_kwargs = (MaskAdamW, optimizer_kwargs)
    trainer = Trainer(
        model=mask_model,
        args=args,
        train_dataset=train_dataset,
        data_collator=default_data_collator,
        callbacks=callbacks,
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
    )
    previous = mask_model.schedule.compiled_sampling
    try:
        trainer.train()  # MaskAnnealCallback puts the model in eval mode at the end
    finally:  # the callback restores it at the end of training, but not when training raises
        mask_model.set_compiled_sampling(previous)
    return trainer
