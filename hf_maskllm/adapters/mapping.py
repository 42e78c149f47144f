"""``get_mask_model``: wrap a model with mask adapters, initialising the logits from a prior.

Like PEFT's ``mapping.py``: the entry point that builds the :class:`MaskModel`, whose first mask starts
from the config's prior (a one-shot method on calibration data, or a saved mask for transfer learning;
``prior_init.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ConfigError
from .config import MaskConfig
from .model import MaskModel
from .save_and_load import DEFAULT_MASK_NAME

__all__ = ["get_mask_model"]


def get_mask_model(
    model: nn.Module,
    config: MaskConfig | None = None,
    calibration_data: Any = None,
    tokenizer: Any = None,
    mask_name: str = DEFAULT_MASK_NAME,
) -> MaskModel:
    """Wrap ``model`` with learnable N:M masks (PEFT's ``get_peft_model`` for MaskLLM).

    ``config.prior`` selects the initial logits: a one-shot method (``"magnitude"``; ``"wanda"``
    and ``"sparsegpt"`` need ``calibration_data``: token ids ``[S, L]``, or texts / a dataset with
    ``tokenizer``), a saved mask folder / Hub repo id (transfer learning), or a list of these (their
    prior terms add). ``mask_name`` names this first mask; add more with :meth:`MaskModel.add_mask` /
    :meth:`MaskModel.load_mask`.
    """
    config = MaskConfig() if config is None else config
    if not isinstance(config, MaskConfig):
        raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
    return MaskModel(
        model, config, mask_name=mask_name, calibration_data=calibration_data, tokenizer=tokenizer
    )
