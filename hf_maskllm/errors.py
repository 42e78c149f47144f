"""Every error hf_maskllm raises on purpose.

Each message names the problem and how to fix it. All inherit from :class:`MaskLLMError`
(itself a ``ValueError``), so ``except hf_maskllm.MaskLLMError`` catches exactly ours.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "MaskFileError",
    "MaskLLMError",
    "NMViolationError",
    "TargetError",
]


class MaskLLMError(ValueError):
    """Base class of all hf_maskllm errors."""


class ConfigError(MaskLLMError):
    """A configuration value is invalid (names the field and the accepted values)."""


class TargetError(MaskLLMError):
    """Target modules match nothing, or match a layer that cannot be masked."""


class MaskFileError(MaskLLMError):
    """A saved mask (folder, JSON or safetensors) is missing, corrupt, or made for another model."""


class CheckpointError(MaskLLMError):
    """A compressed N:M checkpoint is missing, corrupt, or cannot be loaded here."""


class NMViolationError(MaskLLMError):
    """A weight that must be N:M sparse is not."""


class DataError(MaskLLMError):
    """Calibration / evaluation data is empty, too short, or of an unsupported kind."""
