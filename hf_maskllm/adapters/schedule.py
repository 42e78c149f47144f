"""The training schedule of a model's masks: one object the model owns and its masked layers read.

:class:`MaskSchedule` holds everything that changes how the masked layers run during training: the
Gumbel temperature ``tau``, the logit scale ``kappa``, straight-through sampling, the sparse weight
regulariser's weight and divisor, whether the sampling is compiled or recomputed in the backward
pass, and the precision of the unmasked model's pass that the distillation objective compares with. A
:class:`~hf_maskllm.MaskModel` creates one and hands the same object to each of its
:class:`~hf_maskllm.MaskedLinear` layers; :class:`~hf_maskllm.MaskAnnealCallback` (or a custom loop,
through ``MaskModel.set_schedule_values``) updates it once per step with :meth:`MaskSchedule.update`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["MaskSchedule", "schedule_value"]


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
        driven: Whether a callback or training loop has set the schedule (a model training without
            one warns once).
        last_reg_loss: The regulariser's value (weight included) in the last training forward that
            computed it, detached; what ``MaskAnnealCallback`` logs as ``sparse_reg_loss``.
        last_objective_terms: The distillation terms (weights included) of the last training forward,
            detached, by name; ``MaskAnnealCallback`` logs each as ``<name>_loss``.
    """

    tau: float = 2.0
    kappa: float = 100.0
    hard: bool = False
    sparse_reg_weight: float = 0.0
    reg_divisor: int = 1
    compiled_sampling: bool = False
    recompute_sampling: bool | None = None
    teacher_bf16: bool | None = None
    driven: bool = False
    last_reg_loss: torch.Tensor | None = None
    last_objective_terms: dict[str, torch.Tensor] | None = None

    def update(self, **values: Any) -> None:
        """Set several fields at once (unknown names are refused); plain Python values, no tensors."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(f"MaskSchedule has no field {unknown}; fields: {sorted(fields)}.")
        for name, value in values.items():
            setattr(self, name, value)
