"""The training objective of mask learning: the language-model loss and distillation from the unmasked model.

While the masks learn, the weights are frozen, so the unmasked model is at hand for free: the same
weights run with the masks bypassed (:meth:`MaskModel.disable_masks`: a flag the masked layers read,
nothing swapped). :func:`teacher_pass` runs it without autograd, in bfloat16 where the device
multiplies it natively (:func:`teacher_autocast`);
:func:`objective_terms` compares the masked model's outputs with it (the logit KL in the language-model
loss's own pass over the logits where the model's loss allows: :func:`fused_lm_loss`):

- ``distill_logits``: ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` per predicted token;
- ``distill_hidden``: ``||h_student - h_teacher||^2 / ||h_teacher||^2`` per token, after every decoder
  block, averaged over blocks.

Both are summed over the tokens the language-model loss counts (those whose next label is not
``ignore_index``, -100 unless the batch says otherwise; ``shift_labels`` where the batch passes them)
and divided as that loss is: by ``num_items_in_batch`` when the Trainer passes it (gradient
accumulation and DDP then sum exactly as for the language-model loss), else by their count.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..numerics.fused_linear import native_bf16_matmul
from .config import MaskConfig

__all__ = [
    "FusedCausalLMLoss",
    "apply_objective",
    "check_causal_lm",
    "fused_lm_loss",
    "fuses_logit_kl",
    "hidden_distillation",
    "is_causal_lm",
    "logit_distillation",
    "objective_terms",
    "predicted_positions",
    "teacher_autocast",
    "teacher_pass",
]

IGNORE_INDEX = -100


def predicted_positions(
    labels: torch.Tensor, shift_labels: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``bool [batch, seq]``: the positions whose next token is a label, as transformers' causal LM loss
    counts them: ``shift_labels != ignore_index`` when the batch passes ``shift_labels`` (already shifted;
    any shape with one entry per position of ``labels``, as transformers flattens it), else ``labels``
    shifted by one."""
    if shift_labels is not None:
        if shift_labels.numel() != labels.numel():
            raise ValueError(
                f"shift_labels has {shift_labels.numel()} entries {tuple(shift_labels.shape)} but labels has "
                f"{labels.numel()} {tuple(labels.shape)}: pass one shifted label per position of labels."
            )
        return (shift_labels != ignore_index).reshape(labels.shape).to(labels.device)
    valid = torch.zeros_like(labels, dtype=torch.bool)
    valid[:, :-1] = labels[:, 1:] != ignore_index
    return valid


def _divisor(valid: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor | float:
    if num_items_in_batch is not None:
        return (
            num_items_in_batch.to(valid.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        )
    return valid.sum().clamp_min(1)


# Logits per chunk of the KL. On a CPU 2^17 float32 values (512 KiB: two rows of a 49k vocabulary, at least
# one row of any) keep a chunk's few temporaries in the core's cache, so the value and the gradient cost a
# handful of passes over the logits. On an accelerator, 2^24 (64 MiB) keeps each kernel launch busy.
KL_CHUNK_ELEMENTS = 1 << 17
KL_CHUNK_ELEMENTS_ACCELERATOR = 1 << 24


class _FusedLogitObjective(torch.autograd.Function):
    """``kl_weight * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + CE(student, targets)``
    summed over the valid rows of ``[rows, vocab]``, in float32; the gradient with respect to ``student``
    (``kl_weight * T * (q_T - p_T) + q - onehot`` per valid row) is written in the same pass,
    chunk by chunk, so the backward pass only scales it: no recomputation and no per-chunk autograd graph.
    ``targets`` (``[rows]``, -100 where not counted; None: the KL alone) also marks the valid rows then.
    Returns the weighted sum and, without gradient, the KL's and the cross-entropy's unweighted sums. The
    teacher's logits are not kept for the backward pass."""

    @staticmethod
    def forward(
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        valid: torch.Tensor,
        targets: torch.Tensor | None,
        temperature: float,
        kl_weight: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # float16 logits keep their gradient in float32 until the loss scale arrives in backward (small q - p
        # would underflow, a large scale overflow); bfloat16 has float32's range
        ctx.dtype = student.dtype
        buffer = torch.float32 if student.dtype == torch.float16 else student.dtype
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty(student.shape, dtype=buffer, device=student.device) if needs_grad else None
        kl_total = torch.zeros((), dtype=torch.float32, device=student.device)
        ce_total = torch.zeros((), dtype=torch.float32, device=student.device)
        chunk = KL_CHUNK_ELEMENTS if student.device.type == "cpu" else KL_CHUNK_ELEMENTS_ACCELERATOR
        rows = max(1, chunk // student.shape[-1])
        for start in range(0, student.shape[0], rows):
            stop = start + rows
            keep = valid[start:stop]
            s = student[start:stop].float()
            t = teacher[start:stop].to(device=student.device, dtype=torch.float32)
            log_q = torch.log_softmax(s / temperature if temperature != 1.0 else s, dim=-1)
            log_p = torch.log_softmax(t / temperature if temperature != 1.0 else t, dim=-1)
            p = log_p.exp()
            kl = torch.linalg.vecdot(p, log_p.sub_(log_q))  # sum_v p (log p - log q), per row
            kl_total += torch.where(keep, kl, 0.0).sum()
            if targets is not None:
                log_q1 = log_q if temperature == 1.0 else torch.log_softmax(s, dim=-1)
                index = torch.where(keep, targets[start:stop], 0).unsqueeze(-1)  # a bad label fails here
                ce_total -= torch.where(keep, log_q1.gather(-1, index).squeeze(-1), 0.0).sum()
            if grad is None:
                continue
            # kl_weight * T * (q_T - p_T) + (q - onehot)
            g = log_q.exp_()
            if targets is not None and temperature == 1.0:
                g.mul_(kl_weight + 1.0).sub_(p, alpha=kl_weight)
            else:
                g.sub_(p).mul_(kl_weight * temperature)
                if targets is not None:
                    g.add_(log_q1.exp_())
            if targets is not None:
                g.scatter_add_(-1, index, torch.full(index.shape, -1.0, dtype=g.dtype, device=g.device))
            g.masked_fill_(~keep.unsqueeze(-1), 0.0)
            grad[start:stop].copy_(g)
        ctx.grad = grad
        kl_total = kl_total * temperature**2
        ctx.mark_non_differentiable(kl_total, ce_total)
        total = kl_weight * kl_total if targets is None else kl_weight * kl_total + ce_total
        return total, kl_total, ce_total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_output: torch.Tensor, *unused: Any
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        # the gradient lives on ctx, not in save_for_backward (saved-tensor hooks such as CPU offloading do
        # not see it); taking it off ctx makes a second backward through the same graph fail, not reuse it
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError(
                "The logit distillation's gradient was already used: backward ran twice through the same "
                "forward (retain_graph=True is not supported for this term)."
            )
        # a float32 scale is applied as it is (one rounding of the product), not rounded to the buffer's dtype
        return grad.mul_(grad_output).to(ctx.dtype), None, None, None, None, None


def logit_distillation(
    student: torch.Tensor,
    teacher: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` of the next-token distributions at temperature ``T``, summed over
    ``valid`` positions (``[batch, seq]``) and divided like the language-model loss; float32.

    Computed in chunks of rows (sized for the cache on a CPU), the gradient with respect to ``student`` in the same pass
    (as fused cross-entropy kernels do): the extra memory is that gradient, which the backward pass needs
    anyway, and one chunk's temporaries."""
    s = (student if torch.is_grad_enabled() else student.detach()).flatten(0, -2)  # no gradient buffer then
    t = teacher.detach().flatten(0, -2)  # a target: no gradient flows to the teacher
    v = valid.flatten().to(s.device)
    total, _, _ = _FusedLogitObjective.apply(s, t, v, None, float(temperature), 1.0)
    return total / _divisor(valid, num_items_in_batch)


class FusedCausalLMLoss:
    """A causal LM's language-model loss (transformers' ``ForCausalLMLoss``: same arguments and value)
    whose gradient also carries ``distill_logits / lm_weight`` times the logit KL to ``teacher``, computed
    in the same pass over the logits: the language-model loss then costs no separate pass.
    :func:`fused_lm_loss` calls it on the masked model's logits.

    The caller scales the loss by ``lm_weight`` with the rest of the objective. After the call, ``kl``
    holds the KL (the temperature's ``T^2`` included, divided like the loss; no gradient), or None when
    the logits were not the teacher's shape (the model's own loss is returned then, the KL computed
    separately). A batch without a single label gives 0, where transformers' mean gives NaN."""

    def __init__(self, teacher_logits: torch.Tensor, config: MaskConfig) -> None:
        self.teacher = teacher_logits
        self.temperature = float(config.distill_temperature)
        self.ratio = config.distill_logits / config.lm_weight
        self.kl: torch.Tensor | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: Any = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.kl is not None or logits.shape != self.teacher.shape:
            # a second call, or not the logits the teacher's pass returned: the model's own loss
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(
                logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
            )
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(logits.device)
        valid = targets != ignore_index
        student = logits.reshape(-1, vocab_size)
        if not torch.is_grad_enabled():
            student = student.detach()
        teacher = self.teacher.detach().reshape(-1, vocab_size)
        total, kl, ce = _FusedLogitObjective.apply(
            student, teacher, valid, targets, self.temperature, self.ratio
        )
        divisor = _divisor(valid, num_items_in_batch)
        self.kl = kl / divisor
        total = total / divisor
        return ce / divisor + (total - total.detach())  # the value: the cross-entropy alone


LOSS_ARGUMENTS = ("labels", "shift_labels", "ignore_index", "num_items_in_batch")


def fuses_logit_kl(model: nn.Module, teacher: Any, config: MaskConfig) -> bool:
    """Whether the language-model loss of ``model`` is computed with the logit KL in the same pass over the
    logits (:func:`fused_lm_loss`): when the objective weighs both terms and the model's loss is
    transformers' standard causal-LM loss on the logits it returns (a transformers model class whose
    ``loss_function`` is ``ForCausalLMLoss`` and adds no router loss to it). Otherwise the model computes
    its own loss and the KL is computed separately."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return (
        config.distill_logits > 0
        and config.lm_weight > 0
        and getattr(teacher, "logits", None) is not None
        and getattr(model, "loss_function", None) is ForCausalLMLoss
        and getattr(type(model).forward, "__module__", "").startswith("transformers.")
        and not getattr(getattr(model, "config", None), "output_router_logits", False)
    )


def fused_lm_loss(
    outputs: Any, teacher: Any, config: MaskConfig, kwargs: dict[str, Any]
) -> tuple[Any, FusedCausalLMLoss]:
    """``outputs`` (of a forward without the loss arguments) with the ``loss`` the model would have
    computed from the batch's ``kwargs`` (labels, ``num_items_in_batch``, ...), computed by
    :class:`FusedCausalLMLoss` with the logit KL to ``teacher`` in its gradient; and that loss function
    (its ``kl``). The model is not changed: its ``loss_function`` stays as it is."""
    fused = FusedCausalLMLoss(teacher.logits, config)
    logits = outputs.logits
    loss = fused(
        logits=logits,
        labels=kwargs["labels"],
        vocab_size=logits.shape[-1],
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        ignore_index=kwargs.get("ignore_index", IGNORE_INDEX),
        shift_labels=kwargs.get("shift_labels"),
    )
    fused.teacher = None  # the teacher's logits are not kept past the loss
    # the loss first, as the model's own output holds it
    fields = {name: value for name, value in outputs.items() if name != "loss"}
    return type(outputs)(loss=loss, **fields), fused


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


def teacher_autocast(model: nn.Module, bf16: bool | None = None) -> contextlib.AbstractContextManager:
    """The autocast context of the unmasked model's pass: bfloat16 when ``bf16`` is True or, with ``bf16=None``,
    when ``model`` computes in float32 and its device multiplies bfloat16 natively; none under an active
    autocast (the pass follows it) or otherwise."""
    param = next(model.parameters(), None)
    if param is None:
        return contextlib.nullcontext()
    device = param.device
    if torch.is_autocast_enabled(device.type) or bf16 is False:
        return contextlib.nullcontext()
    if bf16 is None and not (param.dtype == torch.float32 and native_bf16_matmul(device)):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@torch.no_grad()
def teacher_pass(
    model: nn.Module,
    dense: contextlib.AbstractContextManager,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    bf16: bool | None = None,
) -> Any:
    """The unmasked model's outputs (no autograd) for the forward arguments; ``dense`` is the context in
    which ``model`` runs without masks (the layers bypass them: no module is swapped, and every module
    keeps its mode, so dropout applies as in the masked pass); ``bf16`` as :func:`teacher_autocast`
    takes it. No loss is computed."""
    kwargs = {k: v for k, v in kwargs.items() if k not in LOSS_ARGUMENTS}  # no loss is computed
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False  # no key-value cache for a single pass
    with dense, teacher_autocast(model, bf16):
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
    config: MaskConfig,
    outputs: Any,
    teacher: Any,
    valid: torch.Tensor,
    num_items_in_batch: Any,
    logits: bool = True,
) -> dict[str, torch.Tensor]:
    """The weighted distillation terms of ``config`` (``{"distill_logits": ..., "distill_hidden": ...}``, the
    weights included), from the masked model's ``outputs`` and the unmasked ``teacher``'s over the
    :func:`predicted_positions` ``valid``; ``logits=False`` leaves the logit KL out."""
    terms: dict[str, torch.Tensor] = {}
    if config.distill_logits > 0 and logits:
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
    config: MaskConfig,
    outputs: Any,
    teacher: Any,
    valid: torch.Tensor,
    num_items_in_batch: Any,
    fused: FusedCausalLMLoss | None = None,
) -> dict[str, torch.Tensor]:
    """Give ``outputs.loss`` the gradient of the whole objective (``lm_weight`` times the language-model
    loss plus the distillation terms) while its value stays the language-model loss, which runs compare
    by. ``fused``: the loss function that computed ``outputs.loss`` with the logit KL's gradient in it
    (:func:`fused_lm_loss`). Returns each term per predicted token of this batch (weight included,
    detached), also added to ``outputs`` as ``<name>_loss``: a value that does not depend on gradient
    accumulation or the number of processes, as the logged ``loss`` does not."""
    in_loss = fused is not None and fused.kl is not None
    terms = objective_terms(config, outputs, teacher, valid, num_items_in_batch, logits=not in_loss)
    lm = outputs.loss
    total = config.lm_weight * lm + sum(term.to(lm.device) for term in terms.values())
    outputs.loss = lm.detach() + (total - total.detach())
    if in_loss:
        terms = {"distill_logits": config.distill_logits * fused.kl, **terms}
    per_token = 1.0
    if num_items_in_batch is not None:  # the terms were divided by the whole accumulated batch's count
        count = valid.sum().clamp_min(1)
        per_token = (
            num_items_in_batch.to(count.device) / count
            if torch.is_tensor(num_items_in_batch)
            else (num_items_in_batch / count)
        )
    logged = {name: (term.detach() * per_token) for name, term in terms.items()}
    for name, value in logged.items():
        outputs[f"{name}_loss"] = value
    return logged
