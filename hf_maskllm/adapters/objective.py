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
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..errors import ConfigError
from .config import MaskConfig

__all__ = [
    "apply_objective",
    "check_causal_lm",
    "hidden_distillation",
    "is_causal_lm",
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


# Logits per chunk of the KL: bounds its float32 temporaries (and those its backward recomputes) to 64 MiB
# each, whatever the vocabulary; a whole batch's would be several of the logits' own size.
KL_CHUNK_ELEMENTS = 1 << 24


def _kl_sum(
    student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``KL(teacher || student)`` at ``temperature`` summed over the ``valid`` rows of ``[rows, vocab]``."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    return torch.where(valid, kl, 0.0).sum()


def logit_distillation(
    student: torch.Tensor,
    teacher: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` of the next-token distributions at temperature ``T``, summed over
    ``valid`` positions (``[batch, seq]``) and divided like the language-model loss; float32.

    Computed in chunks of rows, each recomputed in the backward pass (activation checkpointing): the
    extra memory is one chunk's, not several copies of the batch's logits."""
    s = student.flatten(0, -2)
    t = teacher.flatten(0, -2)
    v = valid.flatten().to(s.device)
    rows = max(1, KL_CHUNK_ELEMENTS // s.shape[-1])
    total = torch.zeros((), dtype=torch.float32, device=s.device)
    for start in range(0, s.shape[0], rows):
        part = (
            s[start : start + rows],
            t[start : start + rows].to(s.device),
            v[start : start + rows],
            temperature,
        )
        if s.requires_grad:
            total = total + torch.utils.checkpoint.checkpoint(_kl_sum, *part, use_reentrant=False)
        else:
            total = total + _kl_sum(*part)
    return total * temperature**2 / _divisor(valid, num_items_in_batch)


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
    for hs, ht in zip(student, teacher, strict=True):  # blocks may sit on several devices
        where = valid.to(hs.device)
        hs, ht = hs[where].float(), ht[valid.to(ht.device)].float().to(hs.device)
        block = ((hs - ht).square().sum(-1) / ht.square().sum(-1).clamp_min(1e-12)).sum()
        total = total + block.to(total.device)
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
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False  # no key-value cache for a single pass
    with dense, _eval_mode(model):
        return model(*args, **kwargs)


@functools.cache
def _is_causal_lm(cls: type) -> bool:
    """A transformers causal-LM class (the Auto mapping's), or one named like them (remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return cls.__name__.endswith("ForCausalLM") or cls.__name__ in set(
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    )


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal language model (the distillation objective's domain)."""
    return _is_causal_lm(type(model))


def check_causal_lm(model: nn.Module) -> None:
    """Refuse an objective other than the language-model loss for a model that is not a causal LM: the
    terms compare next-token predictions at the positions whose next label counts."""
    name = type(model).__name__
    if not _is_causal_lm(type(model)):
        raise ConfigError(
            f"lm_weight / distill_logits / distill_hidden define an objective for causal language models; "
            f"{name} is not one. Leave them at their defaults (for such a model: the language-model loss alone)."
        )


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
    by. Returns each term per predicted token of this batch (weight included, detached), also added to
    ``outputs`` as ``<name>_loss``: a value that does not depend on gradient accumulation or the number
    of processes, as the logged ``loss`` does not."""
    terms = objective_terms(config, outputs, teacher, labels, num_items_in_batch)
    lm = outputs.loss
    total = config.lm_weight * lm + sum(term.to(lm.device) for term in terms.values())
    outputs.loss = lm.detach() + (total - total.detach())
    per_token = 1.0
    if num_items_in_batch is not None:  # the terms were divided by the whole accumulated batch's count
        count = predicted_positions(labels).sum().clamp_min(1)
        per_token = (
            num_items_in_batch.to(count.device) / count
            if torch.is_tensor(num_items_in_batch)
            else (num_items_in_batch / count)
        )
    logged = {name: (term.detach() * per_token) for name, term in terms.items()}
    for name, value in logged.items():
        outputs[f"{name}_loss"] = value
    return logged
