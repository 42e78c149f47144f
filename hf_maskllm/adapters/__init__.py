"""Learnable N:M mask adapters (PEFT-style): config, layer, model, callback."""

from .callback import MaskAnnealCallback
from .config import MaskConfig
from .layer import MaskedLinear
from .mapping import get_mask_model
from .model import MaskModel

__all__ = ["MaskAnnealCallback", "MaskConfig", "MaskModel", "MaskedLinear", "get_mask_model"]
