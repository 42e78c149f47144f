"""Learnable N:M mask adapters (PEFT-style): config, layer, model with named masks, schedule, callback."""

from .callback import MaskAnnealCallback
from .config import MaskConfig
from .layer import MaskedLinear
from .mapping import get_mask_model
from .model import MaskModel
from .named_masks import MaskState
from .schedule import MaskSchedule

__all__ = [
    "MaskAnnealCallback",
    "MaskConfig",
    "MaskModel",
    "MaskSchedule",
    "MaskState",
    "MaskedLinear",
    "get_mask_model",
]
