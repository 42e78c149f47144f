"""Saving the masks of a :class:`~hf_maskllm.MaskModel` to folders and reading them back.

Layout (PEFT's): ``save_pretrained(dir)`` writes the mask named ``"default"`` into ``dir`` itself and
every other mask into ``dir/<mask name>/``; each folder is a complete single-mask folder
(``mask_file.py``), so a folder written before masks had names loads unchanged, and any one mask
can be shared or loaded on its own.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, MaskFileError, MaskLLMError
from ..modules import is_conv1d
from ..numerics.sampling import hard_indices
from ..patterns import candidate_patterns, indices_to_mask
from ..serialization import atomic_folder, atomic_write
from .card import mask_model_card
from .config import CONFIG_NAME
from .layer import mask_key
from .mask_file import LOGITS_NAME, MASKS_NAME, write_logits, write_masks
from .mask_source import PATCH_NAME, SavedMask
from .packing import bits_per_weight
from .prior_init import apply_prior_rule
from .reference_file import REFERENCE_NAME, write_reference_file

__all__ = [
    "DEFAULT_MASK_NAME",
    "SAVE_FORMATS",
    "check_mask_name",
    "logits_from_saved",
    "mask_folder",
    "save_masks",
]


DEFAULT_MASK_NAME = "default"
SAVE_FORMATS = ("hf_maskllm", "npz")
_HF_MASKLLM_FILES = (CONFIG_NAME, MASKS_NAME, LOGITS_NAME, "README.md")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RESERVED = {CONFIG_NAME, MASKS_NAME, LOGITS_NAME, REFERENCE_NAME, PATCH_NAME, "README.md"}


def check_mask_name(name: object) -> str:
    """A mask name is also the subfolder it is saved in: letters, digits, ``_ . -``, not a file name of a save."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED or len(name) > 96:
        raise MaskLLMError(
            f"Invalid mask name {name!r}: use up to 96 letters, digits, '_', '.' or '-', starting with a letter or "
            f"digit (it names the subfolder the mask is saved in), not one of {sorted(_RESERVED)}."
        )
    return name


def mask_folder(save_directory: str | os.PathLike, mask_name: str) -> Path:
    """Where ``mask_name`` is saved: ``save_directory`` for ``"default"``, else its subfolder."""
    root = Path(save_directory)
    return root if mask_name == DEFAULT_MASK_NAME else root / mask_name


# ---------------------------------------------------------------------------------------------- save
# ``mask_model`` below is a MaskModel, typed as a module: model.py imports this file, not the reverse.
def save_masks(
    mask_model: nn.Module,
    save_directory: str | os.PathLike,
    selected_masks: list[str] | None,
    save_logits: bool,
    state_dict: dict[str, torch.Tensor] | None,
    format: str = "hf_maskllm",
) -> None:
    """Write each selected mask (default: all) to its folder; see the module docstring for the layout.

    ``format="npz"`` writes each folder as the MaskLLM reference's ``mask_compressed.npz`` instead (hard
    masks only), which the reference's evaluation script applies."""
    if format not in SAVE_FORMATS:
        raise ConfigError(f"format={format!r} is not one of {SAVE_FORMATS}.")
    if format == "npz" and save_logits:
        raise ConfigError(
            "format='npz' (the MaskLLM reference's mask_compressed.npz) holds hard masks only; save the logits "
            "with the default format='hf_maskllm'."
        )
    names = mask_model.list_masks() if selected_masks is None else list(selected_masks)
    unknown = [name for name in names if name not in mask_model.list_masks()]
    if unknown or not names:
        raise ConfigError(
            f"selected_masks={selected_masks!r} names no mask or unknown masks {unknown}; this model holds "
            f"{mask_model.list_masks()}."
        )
    if state_dict is not None and mask_model.active_mask not in names:
        raise ConfigError(
            f"state_dict holds the logits of the active mask {mask_model.active_mask!r}, which selected_masks "
            f"{names} leaves out; select it, or drop state_dict."
        )
    for name in names:
        _save_one(mask_model, name, mask_folder(save_directory, name), save_logits, state_dict, format)


def _save_one(
    mask_model: nn.Module,
    mask_name: str,
    folder: Path,
    save_logits: bool,
    state_dict: dict[str, torch.Tensor] | None,
    format: str,
) -> None:
    layers = mask_model.masked_layers()
    shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
    active = mask_name == mask_model.active_mask
    mask = mask_model.mask_info(mask_name)
    if active and state_dict is not None:
        logits: dict[str, torch.Tensor] | None = _logits_from_state_dict(mask_model, state_dict)
    elif all(layer.has_logits(mask_name) for layer in layers.values()):
        logits = {name: layer.get_logits(mask_name).detach() for name, layer in layers.items()}
        _refuse_sharded(logits)
    else:
        logits = None
    if logits is not None:
        for name, tensor in logits.items():
            if not bool(torch.isfinite(tensor).all()):
                raise MaskLLMError(
                    f"Logits of {name} in mask {mask_name!r} contain NaN or inf (training diverged); refusing to "
                    "save a corrupt mask. Resume from an earlier checkpoint with a lower learning rate."
                )
    if logits is not None:
        indices = {name: hard_indices(tensor).cpu() for name, tensor in logits.items()}
    else:
        indices = {name: idx.cpu() for name, idx in mask_model.hard_indices(mask_name).items()}
    if save_logits and logits is None:
        warnings.warn(
            f"Mask {mask_name!r} is held as a packed hard mask (loaded with is_trainable=False): it is saved "
            "without logits.",
            stacklevel=3,
        )
    # The whole folder is built beside the target and swapped in at once: a crash leaves the previous
    # save intact, and files of an earlier save in the other format (or stale logits) never sit beside
    # the new masks.
    config = mask.config
    if format == "npz":
        transposed = {name for name, layer in layers.items() if is_conv1d(layer.base_layer)}
        masks = (
            (name, indices_to_mask(idx, config.n, config.m, shapes[name])) for name, idx in indices.items()
        )
        stale = (*_HF_MASKLLM_FILES, PATCH_NAME)
        with atomic_folder(folder, drop=lambda name: name in stale, last=REFERENCE_NAME) as tmp:
            write_reference_file(tmp / REFERENCE_NAME, masks, transposed)
        return
    with atomic_folder(
        folder, drop=lambda name: name in (LOGITS_NAME, REFERENCE_NAME, PATCH_NAME), last=CONFIG_NAME
    ) as tmp:
        # write_masks verifies the N:M invariant (one candidate index in [0, C) per group) first.
        write_masks(tmp / MASKS_NAME, indices, shapes, mask.config.n, mask.config.m, mask.summary)
        if save_logits and logits is not None:
            write_logits(tmp / LOGITS_NAME, {name: tensor.cpu() for name, tensor in logits.items()})
        mask.config.save_pretrained(tmp)
        with atomic_write(tmp / "README.md", "w") as f:
            f.write(mask_model_card(**card_fields(mask_model, mask_name)))


def card_fields(mask_model: nn.Module, mask_name: str) -> dict[str, Any]:
    """The model card's fields for one mask."""
    mask = mask_model.mask_info(mask_name)
    cfg = mask.config
    layers = mask_model.masked_layers()
    return {
        "base_model": cfg.base_model_name_or_path,
        "n": cfg.n,
        "m": cfg.m,
        "num_layers": len(layers),
        "num_weights": sum(layer.in_features * layer.out_features for layer in layers.values()),
        "bits_per_weight": bits_per_weight(cfg.n, cfg.m),
        "targets": cfg.target_modules,
        "prior": cfg.prior,
        "summary": dict(mask.summary),
        "mask_name": mask_name,
    }


def _refuse_sharded(logits: dict[str, torch.Tensor]) -> None:
    if any(isinstance(tensor, DTensor) for tensor in logits.values()):
        raise MaskLLMError(
            "The mask logits are sharded across processes (FSDP): gather them on every process with "
            "`state_dict = trainer.accelerator.get_state_dict(trainer.model)`, then save on the main process "
            "with `mask_model.save_pretrained(folder, state_dict=state_dict)`."
        )


def _logits_from_state_dict(
    mask_model: nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every masked layer's full logits (CPU) out of a state dict keyed like ``state_dict()``."""
    logits = {}
    for name, layer in mask_model.masked_layers().items():
        key = f"base_model.{name}.logits.{mask_key(mask_model.active_mask)}"
        tensor = state_dict.get(key, state_dict.get(f"base_model.{name}.mask_logits"))
        if tensor is None:
            raise ConfigError(
                f"state_dict lacks {key}: pass the full state dict of this MaskModel (on the main process, "
                "what accelerator.get_state_dict(model) returns under FSDP)."
            )
        _refuse_sharded({name: tensor})
        if tuple(tensor.shape) != tuple(layer.mask_logits.shape):
            raise ConfigError(
                f"state_dict[{key!r}] has shape {tuple(tensor.shape)}, the layer's logits "
                f"{tuple(layer.mask_logits.shape)}: pass the full (gathered) state dict, not one shard."
            )
        logits[name] = tensor.detach().cpu()
    return logits


# ---------------------------------------------------------------------------------------------- load
@torch.no_grad()
def logits_from_saved(saved: SavedMask, init: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Logits (dtype and device of ``init``) reproducing the saved hard masks exactly.

    The saved logits when the folder has them; otherwise ``init`` (the config's random init) with the
    prior rule applied for the saved hard masks. Raises :class:`MaskFileError` when the result does not
    reproduce the saved masks (a corrupt folder).
    """
    cfg = saved.config
    if saved.logits is not None:
        out = {name: saved.logits[name].to(tensor.device, tensor.dtype) for name, tensor in init.items()}
        if any(not torch.equal(out[k].argmax(dim=-1).cpu(), saved.indices[k]) for k in saved.indices):
            raise MaskFileError(
                f"{saved.folder}: the saved logits disagree with the saved hard masks; the folder is corrupt. Save "
                f"the mask again, or delete {LOGITS_NAME} to load the hard masks alone."
            )
        return out
    cand = candidate_patterns(cfg.n, cfg.m, dtype=torch.bool)
    masks = {name: cand[saved.indices[name]].reshape(saved.shapes[name]) for name in init}
    strength = max(cfg.prior_strength, 1.0)
    out = apply_prior_rule(init, masks, saved.shapes, cfg.n, cfg.m, strength, cfg.init_std)
    # Verify after reading: the logits now give exactly the saved (N:M) hard masks.
    if any(
        not bool(torch.isfinite(out[k]).all())
        or not torch.equal(out[k].argmax(dim=-1).cpu(), saved.indices[k])
        for k in saved.indices
    ):
        raise MaskFileError(
            f"{saved.folder / CONFIG_NAME}: rebuilding logits from the saved hard masks with init_std="
            f"{cfg.init_std}, prior_strength={cfg.prior_strength}, logits_dtype={cfg.logits_dtype} "
            "overflows; the config is corrupt. Fix these fields or save the mask again."
        )
    return out
