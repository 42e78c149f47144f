"""``get_mask_model``: wrap a model with mask adapters, initialising the logits from a prior.

Like PEFT's ``mapping.py``: the entry point that resolves the config's prior (a one-shot method
on calibration data, or a saved mask for transfer learning; ``prior_init.py``) and builds the
:class:`MaskModel`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ConfigError
from .config import MaskConfig
from .model import MaskModel
from .named_masks import DEFAULT_MASK_NAME, check_mask_name
from .prior_init import prior_masks
from .targets import find_targets

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
    config.validate()
    check_mask_name(mask_name)
    targets = find_targets(model, config.target_modules, config.exclude_modules, config.m, config.strict)
    masks = prior_masks(model, config, targets, calibration_data, tokenizer)
    mask_model = MaskModel(model, config, targets, mask_name=mask_name)
    if masks is not None:
        mask_model.apply_prior(masks)
    return mask_model
