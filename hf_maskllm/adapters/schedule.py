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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .config import MaskConfig

__all__ = ["MaskSchedule", "annealed_values", "schedule_value"]


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
