"""Learnable N:M mask adapters (PEFT-style): config, layer, model with named masks, schedule, callback,
and the streaming merge of a saved mask into a checkpoint on disk."""

from .callback import MaskAnnealCallback
from .config import MaskConfig
from .layer import MaskedLinear
from .mapping import get_mask_model
from .merge_checkpoint import merge_checkpoint
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
    "merge_checkpoint",
]
