"""The training schedule of a model's masks: one object the model owns and its masked layers read.

:class:`MaskSchedule` holds everything that changes how the masked layers run during training: the
Gumbel temperature ``tau``, the logit scale ``kappa``, straight-through sampling, the sparse weight
regulariser's weight and divisor, whether the sampling is compiled or recomputed in the backward
pass, the precision of the unmasked model's pass that the distillation objective compares with, and
whether the masks are bypassed (that pass). A :class:`~hf_maskllm.MaskModel` creates one and hands the
same object to each of its :class:`~hf_maskllm.MaskedLinear` layers.

The annealing policy is one function, :func:`annealed_values`: tau, kappa and the regulariser's weight
from a mask config and the training progress. :meth:`MaskSchedule.set_progress` applies it; it is what
:class:`~hf_maskllm.MaskAnnealCallback` calls every step (``MaskModel.set_schedule_progress`` in a custom
loop). The schedule holds settings only: what a training forward computes (the regulariser's and the
distillation terms' values) is kept by the model (``MaskModel.last_losses``).

The values that change every step reach the layers' forward as 0-d tensors (:meth:`MaskSchedule.tensor`),
updated in place whenever the schedule is set, and whether the regulariser runs as a flag that changes only
when its weight reaches or leaves 0 (:attr:`MaskSchedule.regularising`): ``torch.compile`` of a model then
compiles once, not again for every new tau.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from .config import MaskConfig

__all__ = ["MaskSchedule", "annealed_values", "schedule_value"]

# The fields that change every step in a run, which the layers' forward reads as tensors (MaskSchedule.tensor).
_STEP_VALUES = ("tau", "kappa", "sparse_reg_weight")


def schedule_value(start: float, end: float, progress: float, kind: str = "linear") -> float:
    """Value at ``progress`` in [0, 1] (clamped) going from ``start`` to ``end``.

    ``linear``: straight line (the paper). ``cosine``: half cosine, slow at both ends.
    ``exponential``: geometric interpolation ``start * (end / start) ** progress``.
    """
    t = min(max(float(progress), 0.0), 1.0)
    if kind == "linear":
        return start + (end - start) * t
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    if kind == "exponential":
        return start * (end / start) ** t
    raise ConfigError(f"Unknown schedule {kind!r}; use 'linear', 'cosine' or 'exponential'.")


def annealed_values(config: MaskConfig, progress: float) -> dict[str, float]:
    """``tau``, ``kappa`` and ``sparse_reg_weight`` of ``config``'s schedule at ``progress``
    (``global_step / max_steps``): ``tau`` and ``kappa`` follow ``config.tau_schedule`` /
    ``config.kappa_schedule`` from start to end, the regulariser's weight is ``sparse_reg * (1 - progress)``
    (the paper's linear decay to 0). The one place the annealing policy lives."""
    return {
        "tau": schedule_value(config.tau[0], config.tau[1], progress, config.tau_schedule),
        "kappa": schedule_value(config.kappa[0], config.kappa[1], progress, config.kappa_schedule),
        "sparse_reg_weight": config.sparse_reg * max(0.0, 1.0 - progress),
    }


@dataclass
class MaskSchedule:
    """What the masked layers of one model read while training.

    Attributes:
        tau: Gumbel-softmax temperature.
        kappa: Logit scale: the sampled distribution is ``softmax(kappa * logits)``.
        hard: Straight-through hard samples instead of soft ones.
        sparse_reg_weight: ``lambda * (1 - t/T)``, the sparse weight regulariser's current weight.
        reg_divisor: Divides the regulariser when the Trainer normalises the loss over an accumulated
            batch (``num_items_in_batch``): the gradient accumulation steps times the processes whose
            losses it sums.
        compiled_sampling: Run the fused sampling passes through ``torch.compile``.
        recompute_sampling: Regenerate each layer's sample in the backward pass instead of keeping its
            probabilities; ``None``: keep on CPU, recompute on GPUs.
        teacher_bf16: Run the unmasked model's pass (the distillation target) under bfloat16 autocast;
            ``None``: when the model computes in float32, no autocast is active and the device multiplies
            bfloat16 natively (CUDA; CPUs with AVX512-BF16 or AMX).
        masks_disabled: Every masked layer runs its base layer alone, as if unwrapped (the unmasked
            model's pass; ``MaskModel.disable_masks``), like PEFT's ``disable_adapters``.
        progress: The training progress the annealed values were last computed at
            (:meth:`set_progress`); ``None`` until then.
        driven: Whether a callback or training loop has set tau and kappa (a model training without one
            warns once).

    Each of ``tau``, ``kappa`` and ``sparse_reg_weight`` also has a 0-d tensor that follows it
    (:meth:`tensor`), what the masked layers and the model compute with.
    """

    tau: float = 2.0
    kappa: float = 100.0
    hard: bool = False
    sparse_reg_weight: float = 0.0
    reg_divisor: int = 1
    compiled_sampling: bool = False
    recompute_sampling: bool | None = None
    teacher_bf16: bool | None = None
    masks_disabled: bool = False
    progress: float | None = None
    driven: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in _STEP_VALUES:
            tensors = self.__dict__.setdefault("_tensors", {})
            if name in tensors:
                tensors[name].fill_(float(value))  # in place: compiled code holding it sees the new value
            else:
                tensors[name] = torch.tensor(float(value), dtype=torch.float64, device="cpu")
            if name == "sparse_reg_weight":
                super().__setattr__("_regularising", float(value) > 0)

    def tensor(self, name: str) -> torch.Tensor:
        """``tau``, ``kappa`` or ``sparse_reg_weight`` as a 0-d float64 CPU tensor, one per field, updated in
        place whenever the field is set.

        What the training forward computes with: compiled code takes it as an input, so a new value reuses
        the compiled code (a Python float is compiled in as a constant, and every new value compiles again).
        A CPU scalar joins operations on any device as a Python number does (no copy to the device, the
        same kernels), in the precision of a Python float: the results are those the float would give.
        """
        if name not in _STEP_VALUES:
            raise ConfigError(f"MaskSchedule keeps tensors of {list(_STEP_VALUES)}, not {name!r}.")
        return self._tensors[name]

    @property
    def regularising(self) -> bool:
        """Whether the sparse weight regulariser is on (``sparse_reg_weight > 0``): a flag, so compiled code
        checks it without reading the weight, which changes every step."""
        return self._regularising

    def update(self, **values: Any) -> None:
        """Set several fields at once (unknown names are refused); plain Python values, no tensors."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(f"MaskSchedule has no field {unknown}; fields: {sorted(fields)}.")
        for name, value in values.items():
            setattr(self, name, value)

    def set_progress(self, config: MaskConfig, progress: float) -> None:
        """Set tau, kappa and the regulariser's weight to ``config``'s schedule at ``progress``
        (:func:`annealed_values`)."""
        self.update(**annealed_values(config, progress), progress=float(progress), driven=True)
