"""One named mask of a :class:`~hf_maskllm.MaskModel`: its config, its state in memory, and what that costs.

Every mask covers the same layers with the same N:M; the base weights exist once. A mask is in one of
three states (for 2:4: ``C(4, 2) = 6`` logits per group of 4 weights):

- ``"active"``: its logits are the ``mask_logits`` parameters of the masked layers; the forward uses
  them and, when the mask is trainable, they are the only parameters with ``requires_grad``.
  ``C / m`` logits per weight (2:4 in bf16: 3 bytes per weight).
- ``"logits"``: inactive, its logits held aside with ``requires_grad=False`` (trainable masks, and
  masks loaded with ``keep_logits=True``); the same ``C / m`` logits per weight. Activating it
  moves parameter references only.
- ``"packed"``: inactive and not trainable; only its hard mask, as candidate indices packed in
  base ``C`` (``packing.py``: 0.647 bit per weight for 2:4). Activating it decodes the hard mask
  into one-hot logits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import MaskLLMError
from .config import CONFIG_NAME, MaskConfig
from .mask_file import LOGITS_NAME, MASKS_NAME

__all__ = ["DEFAULT_MASK_NAME", "MaskState", "NamedMask", "check_mask_name"]

DEFAULT_MASK_NAME = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RESERVED = {CONFIG_NAME, MASKS_NAME, LOGITS_NAME, "README.md"}


def check_mask_name(name: object) -> str:
    """A mask name is also the subfolder it is saved in: letters, digits, ``_ . -``, not a file name of a save."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED or len(name) > 96:
        raise MaskLLMError(
            f"Invalid mask name {name!r}: use up to 96 letters, digits, '_', '.' or '-', starting with a letter or "
            f"digit (it names the subfolder the mask is saved in), not one of {sorted(_RESERVED)}."
        )
    return name


@dataclass
class MaskState:
    """Where a mask stands: ``state`` (``"active"``, ``"logits"`` or ``"packed"``), its bytes in memory
    (its logits, or its packed hard mask) and those bytes per masked weight in bits."""

    state: str
    nbytes: int
    bits_per_weight: float


@dataclass
class NamedMask:
    """A mask's config and tensors. ``logits``: ``{layer: [G, C] Parameter}`` (the layers' own parameters
    while active); ``packed``: ``{layer: uint8}`` packed candidate indices, kept for non-trainable masks."""

    config: MaskConfig
    trainable: bool
    logits: dict[str, torch.Tensor] | None = None
    packed: dict[str, torch.Tensor] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    keep_logits: bool = False

    @property
    def packs_when_inactive(self) -> bool:
        """True when deactivating drops the logits (the packed hard mask stays)."""
        return not self.trainable and not self.keep_logits and self.packed is not None
