"""``MaskAnnealCallback``: anneals tau and kappa, decays the regulariser, logs mask statistics.

Every step it hands ``state.global_step / state.max_steps`` to the model's schedule
(:meth:`MaskSchedule.set_progress <hf_maskllm.adapters.schedule.MaskSchedule.set_progress>`), which computes
tau, kappa and the regulariser's weight from it: a run resumed with ``resume_from_checkpoint`` continues on
exactly the same schedule. It keeps no copy of them: it logs what the schedule holds, and the losses the
model's last training forward computed (``MaskModel.last_losses``).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import MaskLLMError
from ..numerics.denormals import LN_FLOAT32_TINY
from ..numerics.fused_linear import scalar_tensor
from ..numerics.sampling import hard_indices, max_probability
from ..optim import MaskAdamW, compiler_available, local_shard
from ..patterns import candidate_patterns
from ..training_args import recipe_departures
from .model import MaskModel
from .objective import teacher_autocast

__all__ = ["MaskAnnealCallback", "find_mask_model"]

logger = logging.getLogger(__name__)


def find_mask_model(model: nn.Module | None) -> MaskModel:
    """The :class:`MaskModel` inside ``model`` (which may be wrapped by DDP, FSDP, accelerate, ...)."""
    if isinstance(model, MaskModel):
        return model
    if model is not None:
        for module in model.modules():
            if isinstance(module, MaskModel):
                return module
    raise MaskLLMError(
        "MaskAnnealCallback found no MaskModel in the Trainer's model; pass `get_mask_model(model, MaskConfig())` "
        "as Trainer(model=...)."
    )


def _warn_if_rounding_away(mask_model: MaskModel, optimizer: Any) -> None:
    """16-bit logits need stochastic rounding: with round-to-nearest most updates are lost."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
    if optimizer is None or isinstance(optimizer, MaskAdamW):
        return
    low = {str(p.dtype) for p in mask_model.parameters() if p.requires_grad and p.element_size() < 4}
    if low:
        warnings.warn(
            f"Mask logits are {', '.join(sorted(low))} but the optimizer is {type(optimizer).__name__}: updates "
            "below half a 16-bit step are rounded away. Use hf_maskllm.MaskAdamW (stochastic rounding: "
            "Trainer(optimizer_cls_and_kwargs=(MaskAdamW, {'lr': 5e-4}))) or MaskConfig(logits_dtype='float32'); "
            "docs/scale.md has the measured quality of each setting.",
            stacklevel=2,
        )


def _uses_fsdp(args: Any) -> bool:
    """Whether this Trainer run shards the model with FSDP (TrainingArguments.fsdp or accelerate's config)."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in (
        "1",
        "true",
    )


def _logs_next_step(args: Any, state: Any) -> bool:
    """Whether the Trainer will log after the next optimizer step (or it is the last one)."""
    upcoming = state.global_step + 1
    if state.max_steps and upcoming >= state.max_steps:
        return upcoming == state.max_steps
    if getattr(args, "logging_first_step", False) and upcoming == 1:
        return True
    strategy = getattr(args.logging_strategy, "value", args.logging_strategy)
    if strategy == "steps":
        every = int(getattr(state, "logging_steps", 0) or args.logging_steps)
        return every > 0 and upcoming % every == 0
    return strategy != "no"  # "epoch": not known a step ahead


def _sum_over_shards(stats: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``stats`` summed over the processes that hold other shards of ``like`` (a no-op unless sharded)."""
    if not isinstance(like, DTensor):
        return stats
    placements = [Partial() if isinstance(p, Shard) else Replicate() for p in like.placements]
    return DTensor.from_local(stats, like.device_mesh, placements).full_tensor()


def _hamming(n: int, m: int, device: torch.device) -> torch.Tensor:
    """``[C, C]``: how many of the m positions differ between two candidates."""
    cand = candidate_patterns(n, m, device=device)
    return (cand[:, None, :] != cand[None, :, :]).sum(dim=-1)


def _indices_and_flips(
    logits: torch.Tensor, previous: torch.Tensor | None, hamming: torch.Tensor, kappa: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every group's hard choice (uint8 ``[G]``, first maximum on ties, as ``argmax``), with ``previous``
    how many weights differ from it (0-d; else None), and with ``kappa`` the sum over groups of
    ``max softmax(kappa * logits)`` (0-d float32; else None), in one pass.

    Column by column so that compiled code vectorises over groups (an ``argmax`` or a softmax over a
    last dimension of 6 does not): compiled, several times faster than ``argmax`` plus a table
    lookup, and than a softmax over every group.
    """
    columns = [logits[:, c].float() for c in range(logits.shape[1])]
    best = columns[0]
    idx = torch.zeros_like(best, dtype=torch.int32)
    for c, value in enumerate(columns[1:], start=1):
        better = value > best
        best = torch.where(better, value, best)
        idx = torch.where(better, c, idx)
    flips = None
    if previous is not None:
        flips = hamming.view(-1)[previous.to(torch.int32) * logits.shape[1] + idx].sum()
    prob_sum = None
    if kappa is not None:  # the largest probability is 1 / sum_c exp(kappa * (l_c - l_max))
        shifted = [kappa * (value - best) for value in columns]  # <= 0; exp of 0 for the maximum
        terms = [  # exp never evaluated where it would be denormal (denormals.py)
            torch.where(x < LN_FLOAT32_TINY, 0.0, torch.exp(torch.clamp(x, min=LN_FLOAT32_TINY)))
            for x in shifted
        ]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        prob_sum = (1.0 / total).sum()
    return idx.to(torch.uint8), flips, prob_sum


_COMPILED: dict[str, Any] = {}


def _compiled_indices_and_flips(logits, previous, hamming, kappa=None):
    if "stats" not in _COMPILED:
        _COMPILED["stats"] = torch.compile(
            _indices_and_flips, options={"cpp.enable_tiling_heuristics": False}
        )
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    if previous is not None:
        torch._dynamo.maybe_mark_dynamic(previous, 0)
    kappa = None if kappa is None else scalar_tensor(kappa, logits.device)  # no recompile as kappa anneals
    return _COMPILED["stats"](logits, previous, hamming, kappa)


class MaskAnnealCallback(TrainerCallback, ExportableState):
    """Anneal the Gumbel temperature ``tau`` and the logit scale ``kappa`` (schedules from the MaskConfig).

    Each optimizer step, with ``t = global_step / max_steps``: ``tau(t)``, ``kappa(t)`` and the sparse
    weight regulariser ``lambda * (1 - t)``. Logged with the Trainer's logs: ``tau``, ``kappa``,
    ``mask_flip_rate`` (fraction of masked weights whose hard mask changed in the optimizer step just
    logged) and ``mask_max_prob`` (mean over groups of ``max softmax(kappa * logits)``).

    At the start of training it warns about every setting that departs from the MaskLLM recipe
    (weight decay, betas and learning rate of the logits, LR schedule, gradient clipping: see
    :class:`~hf_maskllm.MaskTrainingArguments`), and when the first step compiles it says so and
    how long it took. At the end it puts the model in eval mode: it then uses the hard masks, and
    two forwards of the same input agree.

    Args:
        log_mask_stats: Compute flip rate and max probability on logged steps (one pass over the logits
            on the step before a log, one on the logged step). Keeps each group's hard choice as one
            byte (0.25 bytes per masked 2:4 weight) across the step before each log.
        compile_sampling: Fuse the mask sampling with ``torch.compile`` during training (see
            ``numerics/fused_linear.py``); default: when a C++ compiler (CPU) or CUDA is available.
            ``False`` skips the compilation (about a minute on CPU) at some cost per step.
        check_recipe: Warn about departures from the recipe (``False`` when they are deliberate).
    """

    def __init__(
        self, log_mask_stats: bool = True, compile_sampling: bool | None = None, check_recipe: bool = True
    ) -> None:
        self.log_mask_stats = log_mask_stats
        self.compile_sampling = compile_sampling
        self.check_recipe = check_recipe
        self._first_step_start: float | None = None
        self._previous_compiled: bool | None = None
        self._compiled_stats = False
        self._hamming_table: torch.Tensor | None = None
        self.last_flip_rate: float | None = None
        self.last_max_prob: float | None = None
        self._flip_rate_to_log: float | None = None
        self._previous: dict[str, torch.Tensor] = {}  # each group's hard choice, kept for the next step
        self._held_peak = 0  # the most bytes _previous held across a step

    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "log_mask_stats": self.log_mask_stats,
                "compile_sampling": self.compile_sampling,
                "check_recipe": self.check_recipe,
            },
            "attributes": {
                "last_flip_rate": self.last_flip_rate,
                "last_max_prob": self.last_max_prob,
            },
        }

    # ------------------------------------------------------------------ schedule
    @staticmethod
    def _apply(mask_model: MaskModel, global_step: int, max_steps: int) -> None:
        mask_model.set_schedule_progress(global_step / max_steps if max_steps and max_steps > 0 else 0.0)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        # Before the Trainer builds its optimizer or wraps the model: the fast layout of the logits,
        # unless FSDP will shard them (it shards only contiguous parameters).
        if model is None or _uses_fsdp(args):
            return
        try:
            mask_model = find_mask_model(model)
        except MaskLLMError:
            return  # on_train_begin says what is missing
        mask_model.set_candidate_major_logits(True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        mask_model = find_mask_model(model)
        if getattr(args, "n_gpu", 1) > 1:
            raise MaskLLMError(
                f"The Trainer would wrap the model in nn.DataParallel over {args.n_gpu} GPUs, which MaskModel does "
                "not support. Launch one process per GPU instead (torchrun or accelerate launch: DDP / FSDP), or "
                "make one GPU visible (CUDA_VISIBLE_DEVICES=0)."
            )
        # With num_items_in_batch the Trainer neither divides the loss by the accumulation steps nor (with
        # average_tokens_across_devices) leaves it per process: it multiplies it by the process count before
        # DDP averages. The regulariser rides in that loss, so undo both to keep its weight per update fixed.
        processes = int(args.world_size) if getattr(args, "average_tokens_across_devices", False) else 1
        mask_model.schedule.update(
            reg_divisor=max(1, int(args.gradient_accumulation_steps)) * max(1, processes)
        )
        mask_model.last_losses = {}
        self._apply(mask_model, state.global_step, state.max_steps)
        self._previous, self._held_peak = {}, 0
        if self.log_mask_stats and _logs_next_step(args, state):
            self._keep(
                {
                    k: hard_indices(local_shard(layer.mask_logits))
                    for k, layer in mask_model.masked_layers().items()
                }
            )
        optimizer = kwargs.get("optimizer")
        _warn_if_rounding_away(mask_model, optimizer)
        if self.check_recipe and optimizer is not None:
            departures = recipe_departures(args, optimizer, mask_model)
            if departures:
                warnings.warn(
                    "This run departs from the MaskLLM recipe: "
                    + "; ".join(departures)
                    + ". TrainingArguments' defaults are not the recipe: use hf_maskllm.MaskTrainingArguments "
                    "(the recipe's defaults) with optimizer_cls_and_kwargs=(MaskAdamW, {'lr': args.learning_rate}), "
                    "or hf_maskllm.learn.learn_mask. If the departure is deliberate, pass "
                    "MaskAnnealCallback(check_recipe=False).",
                    stacklevel=2,
                )
        compiled = compiler_available() if self.compile_sampling is None else self.compile_sampling
        previous = mask_model.set_compiled_sampling(compiled)
        self._compiled_stats = compiled  # the flip statistic too
        if self._previous_compiled is None:  # a run that raised never reached on_train_end: keep the first
            self._previous_compiled = previous
        optimizer_compiles = bool(getattr(getattr(optimizer, "optimizer", optimizer), "compile", False))
        self._first_step_start = None
        if compiled or optimizer_compiles:
            what = " and ".join(
                (["mask sampling (MaskAnnealCallback(compile_sampling=False) skips it)"] if compiled else [])
                + (["MaskAdamW's update (MaskAdamW(compile=False) skips it)"] if optimizer_compiles else [])
            )
            logger.warning(
                "torch.compile: the first training step compiles the %s; this can take a minute.", what
            )
            self._first_step_start = time.perf_counter()
        if compiled and self.log_mask_stats:
            self._compile_statistics(mask_model)
        config = mask_model.mask_config
        teacher = teacher_autocast(mask_model.base_model, mask_model.schedule.teacher_bf16)
        # under fp16 mixed precision the Trainer's own autocast decides the pass's precision
        if config.distills and isinstance(teacher, torch.autocast) and not getattr(args, "fp16", False):
            logger.info(
                "The unmasked model's pass (the distillation target) runs under bfloat16 autocast; "
                "mask_model.set_teacher_bf16(False) runs it in float32."
            )

    @torch.no_grad()
    def _compile_statistics(self, mask_model: MaskModel) -> None:
        """Compile both variants of the statistics pass (hard choices alone, before a logged step; with
        flips and the largest probability, on it) now, with the rest of the first step's compilation."""
        layers = mask_model.masked_layers()
        if not layers:
            return
        logits = local_shard(next(iter(layers.values())).mask_logits).detach()
        if logits.shape[1] > 255:
            return
        table = self._hamming(mask_model.mask_config, logits)
        current, _, _ = _compiled_indices_and_flips(logits, None, table)
        _compiled_indices_and_flips(logits, current, table, float(mask_model.mask_config.kappa[0]))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._apply(find_mask_model(model), state.global_step, state.max_steps)

    # ------------------------------------------------------------------ statistics
    def _keep(self, choices: dict[str, torch.Tensor]) -> None:
        """Keep each group's hard choice for the next step's flip count."""
        self._previous = choices
        self._held_peak = max(self._held_peak, sum(t.numel() * t.element_size() for t in choices.values()))

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._first_step_start is not None:
            logger.warning(
                "torch.compile: the first training step took %.1f s, compilation included (later steps reuse it).",
                time.perf_counter() - self._first_step_start,
            )
            self._first_step_start = None
        if not self.log_mask_stats:
            return
        # Statistics are for the logs: computed on logged steps (and the last), flips against the hard
        # choices kept on the step before. Other steps pay nothing.
        logged = control.should_log or state.global_step >= state.max_steps
        keep = _logs_next_step(args, state)
        if not (logged or keep):
            self._previous = {}
            return
        mask_model = find_mask_model(model)
        cfg = mask_model.mask_config
        changed, total, prob_sum, groups = None, 0, None, 0
        kept: dict[str, torch.Tensor] = {}
        # Under FSDP2 each process sees its own rows of every layer's logits: sums over them, then over processes.
        sharded = None
        for name, layer in mask_model.masked_layers().items():
            local = local_shard(layer.mask_logits)
            if local is not layer.mask_logits:
                sharded = layer.mask_logits
            logits = local.detach()
            previous = self._previous.get(name) if logged else None
            if previous is not None and previous.shape[0] != logits.shape[0]:
                previous = None
            kappa = float(mask_model.schedule.kappa)
            prob = flips = None
            if self._compiled_stats and logits.shape[1] <= 255:
                current, flips, prob = _compiled_indices_and_flips(
                    logits, previous, self._hamming(cfg, logits), kappa if logged else None
                )
            else:
                current = hard_indices(logits)  # one byte per group (C <= 255)
                if previous is not None:
                    flips = self._hamming(cfg, logits)[previous.long(), current.long()].sum()
                if logged:
                    prob = max_probability(logits, kappa) * current.numel()
            if flips is not None:  # weights that changed
                changed = flips if changed is None else changed + flips
                total += current.numel() * cfg.m
            if keep:
                kept[name] = current
            if prob is not None:
                prob_sum = prob if prob_sum is None else prob_sum + prob
            groups += current.numel()
        self._previous = {}
        if keep:
            self._keep(kept)
        if not logged:
            return
        if sharded is not None:  # one all-reduce for the four sums
            zero = torch.zeros((), dtype=torch.float64, device=sharded.device)
            local = [zero + (0 if v is None else v) for v in (changed, total, prob_sum, groups)]
            changed, total, prob, groups = _sum_over_shards(torch.stack(local), sharded).tolist()
            total, groups = int(total), int(groups)
            prob_sum = None if prob_sum is None else prob
        if total:  # one host sync per statistic, not one per layer
            self.last_flip_rate = self._flip_rate_to_log = float(changed) / total
        if prob_sum is not None:
            self.last_max_prob = float(prob_sum) / max(groups, 1)

    def _hamming(self, cfg: Any, like: torch.Tensor) -> torch.Tensor:
        """The ``[C, C]`` table of differing positions, built once per run."""
        table = self._hamming_table
        if table is None or table.device != like.device or table.shape[0] != like.shape[1]:
            table = self._hamming_table = _hamming(cfg.n, cfg.m, like.device).to(torch.uint8)  # at most m
        return table

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        extra: dict[str, float] = {}
        model = kwargs.get("model")
        mask_model = find_mask_model(model) if model is not None else None
        schedule = None if mask_model is None else mask_model.schedule
        if schedule is not None and schedule.progress is not None:  # what the layers read
            extra["tau"] = round(schedule.tau, 6)
            extra["kappa"] = round(schedule.kappa, 4)
        if self._flip_rate_to_log is not None:
            extra["mask_flip_rate"] = self._flip_rate_to_log
            self._flip_rate_to_log = None
        if self.last_max_prob is not None:
            extra["mask_max_prob"] = self.last_max_prob
        if mask_model is not None and "loss" in logs:
            # The regulariser's and the distillation terms' values (last micro-batch); their gradients
            # train the logits, while `loss` stays the language-model loss that runs can be compared by.
            for name, value in mask_model.last_losses.items():
                extra[name] = float(value)
        logs.update(extra)
        # Trainer appended its record to log_history before calling callbacks: keep them consistent.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def held_bytes(self) -> int:
        """The most bytes this callback keeps from one step to the next in this run: each group's hard
        choice (kept across the step before each log) and the ``[C, C]`` table."""
        kept = max(self._held_peak, sum(t.numel() * t.element_size() for t in self._previous.values()))
        table = self._hamming_table
        return kept + (table.numel() * table.element_size() if table is not None else 0)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        mask_model = find_mask_model(model)
        mask_model.eval()  # hard masks from here on: evaluation and generation are deterministic
        if self._previous_compiled is not None:
            mask_model.set_compiled_sampling(self._previous_compiled)
            self._previous_compiled = None
        summary = dict(mask_model.training_summary)
        summary.update(
            {
                "optimizer_steps": int(state.global_step),
                "final_tau": mask_model.schedule.tau,
                "final_kappa": mask_model.schedule.kappa,
            }
        )
        if self.last_flip_rate is not None:
            summary["final_flip_rate"] = round(self.last_flip_rate, 6)
        if self.last_max_prob is not None:
            summary["final_max_prob"] = round(self.last_max_prob, 6)
        mask_model.training_summary = summary
