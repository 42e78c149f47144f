"""``get_mask_model``: wrap a model with mask adapters, initialising the logits from a prior.

Like PEFT's ``mapping.py``: the entry point that resolves the config's prior (a one-shot method
on calibration data, or a saved mask for transfer learning) and builds the :class:`MaskModel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, MaskFileError
from ..modules import dense_weight_view
from ..patterns import candidate_patterns
from ..serialization import resolve_folder
from .config import CONFIG_NAME, MaskConfig
from .mask_file import MASKS_NAME, load_mask_config, read_masks
from .model import MaskModel
from .targets import find_targets

__all__ = ["get_mask_model"]


def get_mask_model(
    model: nn.Module,
    config: MaskConfig | None = None,
    calibration_data: Any = None,
    tokenizer: Any = None,
) -> MaskModel:
    """Wrap ``model`` with learnable N:M masks (PEFT's ``get_peft_model`` for MaskLLM).

    ``config.prior`` selects the initial logits: a one-shot method (``"magnitude"``; ``"wanda"``
    and ``"sparsegpt"`` need ``calibration_data``: token ids ``[S, L]``, or texts / a dataset with
    ``tokenizer``), or a saved mask folder / Hub repo id (transfer learning).
    """
    config = MaskConfig() if config is None else config
    if not isinstance(config, MaskConfig):
        raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
    config.validate()
    targets = find_targets(model, config.target_modules, config.exclude_modules, config.m, config.strict)
    config.check_prior_source()
    prior_masks: dict[str, torch.Tensor] | None = None
    if config.prior_is_method:
        from ..priors import compute_prior_masks

        tokens = _calibration_tokens(config, calibration_data, tokenizer)
        prior_masks = compute_prior_masks(
            model, config.prior, config.n, config.m, targets, calibration=tokens
        )
    elif config.prior is not None:
        prior_masks = _saved_mask_prior(model, config, targets)
    mask_model = MaskModel(model, config, targets)
    if prior_masks is not None:
        mask_model.apply_prior(prior_masks)
    return mask_model


def _calibration_tokens(config: MaskConfig, data: Any, tokenizer: Any) -> torch.Tensor | None:
    if config.prior == "magnitude":
        return None
    if data is None:
        raise ConfigError(
            f"prior={config.prior!r} needs calibration data: pass calibration_data= (token ids [S, L], or texts / a "
            "dataset together with tokenizer=), or use prior='magnitude'."
        )
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.dtype not in (torch.int64, torch.int32):
            raise ConfigError(
                f"calibration_data tensors must be integer token ids [S, L], got {tuple(data.shape)} {data.dtype}."
            )
        return data.long()
    if tokenizer is None:
        raise ConfigError("calibration_data given as text needs tokenizer= to turn it into tokens.")
    from ..data import calibration_tokens

    return calibration_tokens(
        data,
        tokenizer,
        num_samples=config.calibration_samples,
        seqlen=config.calibration_seqlen,
        seed=config.seed,
    )


def _saved_mask_prior(model: nn.Module, config: MaskConfig, targets: list[str]) -> dict[str, torch.Tensor]:
    """Hard masks of a saved mask (folder or repo id) to use as a prior: the transfer-learning path."""
    folder = resolve_folder(
        config.prior, [CONFIG_NAME, MASKS_NAME], ["README.md"], MaskFileError, "prior mask folder"
    )
    saved = load_mask_config(folder)
    if (saved.n, saved.m) != (config.n, config.m):
        raise MaskFileError(
            f"Prior mask {config.prior!r} is {saved.n}:{saved.m} but the config asks for {config.n}:{config.m}; "
            "use the same N:M."
        )
    shapes = {name: tuple(dense_weight_view(model.get_submodule(name)).shape) for name in targets}
    indices, _ = read_masks(folder / MASKS_NAME, shapes, config.n, config.m)
    cand = candidate_patterns(config.n, config.m, dtype=torch.bool)
    return {name: cand[idx].reshape(shapes[name]) for name, idx in indices.items()}
