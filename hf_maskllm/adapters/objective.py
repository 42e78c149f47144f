"""The training objective of mask learning: the language-model loss and distillation from the unmasked model.

While the masks learn, the weights are frozen, so the unmasked model is at hand for free: the same
weights run without masks (:meth:`MaskModel.disable_masks`). :func:`teacher_pass` runs it without
autograd; :func:`objective_terms` compares the masked model's outputs with it:

- ``distill_logits``: ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` per predicted token;
- ``distill_hidden``: ``||h_student - h_teacher||^2 / ||h_teacher||^2`` per token, after every decoder
  block, averaged over blocks.

Both are summed over the tokens the language-model loss counts (those whose next label is not -100)
and divided as that loss is: by ``num_items_in_batch`` when the Trainer passes it (gradient
accumulation and DDP then sum exactly as for the language-model loss), else by their count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import MaskConfig

__all__ = [
    "apply_objective",
    "hidden_distillation",
    "logit_distillation",
    "objective_terms",
    "predicted_positions",
    "teacher_pass",
]

IGNORE_INDEX = -100


def predicted_positions(labels: torch.Tensor) -> torch.Tensor:
    """``bool [batch, seq]``: the positions whose next token is a label (what the shifted causal LM loss counts)."""
    valid = torch.zeros_like(labels, dtype=torch.bool)
    valid[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return valid


def _divisor(valid: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor | float:
    if num_items_in_batch is not None:
        return (
            num_items_in_batch.to(valid.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        )
    return valid.sum().clamp_min(1)


def logit_distillation(
    student: torch.Tensor,
    teacher: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` of the next-token distributions at temperature ``T``, summed over
    ``valid`` positions (``[batch, seq]``) and divided like the language-model loss; float32."""
    s = student[valid].float() / temperature  # [tokens, vocab]
    t = teacher[valid].float() / temperature
    kl = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), reduction="sum", log_target=True)
    return kl * temperature**2 / _divisor(valid, num_items_in_batch)


def hidden_distillation(
    student: tuple[torch.Tensor, ...],
    teacher: tuple[torch.Tensor, ...],
    valid: torch.Tensor,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    """The mean over blocks of ``||h_s - h_t||^2 / ||h_t||^2`` per token, summed over ``valid`` positions
    and divided like the language-model loss. ``student`` / ``teacher``: the hidden states after every
    block (``output_hidden_states`` without the embeddings); float32."""
    total = torch.zeros((), dtype=torch.float32, device=valid.device)
    for hs, ht in zip(student, teacher, strict=True):
        hs, ht = hs[valid].float(), ht[valid].float()
        total = total + ((hs - ht).square().sum(-1) / ht.square().sum(-1).clamp_min(1e-12)).sum()
    return total / len(student) / _divisor(valid, num_items_in_batch)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout), each put back as it was."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@torch.no_grad()
def teacher_pass(
    model: nn.Module, dense: contextlib.AbstractContextManager, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The unmasked model's outputs (no autograd, eval mode) for the forward arguments; ``dense`` is the
    context in which ``model`` runs without masks. No loss is computed."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "num_items_in_batch")}
    with dense, _eval_mode(model):
        return model(*args, **kwargs)


def objective_terms(
    config: MaskConfig, outputs: Any, teacher: Any, labels: torch.Tensor, num_items_in_batch: Any
) -> dict[str, torch.Tensor]:
    """The weighted distillation terms of ``config`` (``{"distill_logits": ..., "distill_hidden": ...}``, the
    weights included), from the masked model's ``outputs`` and the unmasked ``teacher``'s."""
    valid = predicted_positions(labels)
    terms: dict[str, torch.Tensor] = {}
    if config.distill_logits > 0:
        kl = logit_distillation(
            outputs.logits, teacher.logits, valid, config.distill_temperature, num_items_in_batch
        )
        terms["distill_logits"] = config.distill_logits * kl
    if config.distill_hidden > 0:
        mse = hidden_distillation(
            outputs.hidden_states[1:], teacher.hidden_states[1:], valid, num_items_in_batch
        )
        terms["distill_hidden"] = config.distill_hidden * mse
    return terms


def apply_objective(
    config: MaskConfig, outputs: Any, teacher: Any, labels: torch.Tensor, num_items_in_batch: Any
) -> dict[str, torch.Tensor]:
    """Give ``outputs.loss`` the gradient of the whole objective (``lm_weight`` times the language-model
    loss plus the distillation terms) while its value stays the language-model loss, which runs compare
    by; add each term to ``outputs`` as ``<name>_loss``. Returns the terms, detached."""
    terms = objective_terms(config, outputs, teacher, labels, num_items_in_batch)
    lm = outputs.loss
    total = config.lm_weight * lm + sum(terms.values())
    outputs.loss = lm.detach() + (total - total.detach())
    detached = {name: term.detach() for name, term in terms.items()}
    for name, term in detached.items():
        outputs[f"{name}_loss"] = term
    return detached
