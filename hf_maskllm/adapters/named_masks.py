"""Named masks of a :class:`~hf_maskllm.MaskModel`: PEFT's multi-adapter API, and each mask's state.

:class:`NamedMasksMixin` gives ``MaskModel`` ``add_mask`` / ``load_mask`` / ``set_mask`` / ``delete_mask`` /
``list_masks`` / ``active_mask``; :class:`NamedMask` holds one mask's config and tensors. Every mask covers the same layers with the same N:M; the base weights exist once. A mask is in one of
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

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, MaskFileError, MaskLLMError
from ..patterns import candidate_patterns, num_candidates
from .config import CONFIG_NAME, MaskConfig
from .layer import MaskedLinear
from .mask_file import LOGITS_NAME, MASKS_NAME
from .packing import unpack_indices
from .prior_init import hard_logits, prior_logits, prior_masks, random_logits
from .targets import find_targets
from .wrapping import unwrapped

__all__ = ["DEFAULT_MASK_NAME", "MaskState", "NamedMask", "NamedMasksMixin", "check_mask_name"]

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


class NamedMasksMixin:
    """PEFT's multi-adapter API for masks (``add_adapter`` / ``set_adapter`` / ...), mixed into ``MaskModel``.

    Expects ``_masks`` (``{name: NamedMask}``), ``_active``, ``masked_names``, ``base_model``,
    ``masked_layers()`` and ``_check_not_merged()`` from the model.
    """

    @property
    def active_mask(self) -> str:
        """Name of the mask the forward uses (and the only one that trains)."""
        return self._active

    @property
    def mask_config(self) -> MaskConfig:
        """The active mask's config."""
        return self._masks[self._active].config

    @property
    def mask_configs(self) -> dict[str, MaskConfig]:
        """``{mask name: config}`` of every mask (PEFT's ``peft_config``)."""
        return {name: mask.config for name, mask in self._masks.items()}

    @property
    def training_summary(self) -> dict[str, Any]:
        """The active mask's training summary (saved with it)."""
        return self._masks[self._active].summary

    @training_summary.setter
    def training_summary(self, value: dict[str, Any]) -> None:
        self._masks[self._active].summary = dict(value)

    def list_masks(self) -> list[str]:
        """Names of every mask, in the order they were added."""
        return list(self._masks)

    def add_mask(
        self,
        mask_name: str,
        config: MaskConfig,
        calibration_data: Any = None,
        tokenizer: Any = None,
    ) -> None:
        """Add a new trainable mask over the same layers, initialised from ``config.prior``; not activated.

        ``config.prior`` works as in :func:`~hf_maskllm.get_mask_model`: a one-shot method (calibrated on
        the dense base model with ``calibration_data``), or a saved mask folder / Hub repo id (transfer
        learning). Activate it with :meth:`set_mask` before training it.
        """
        self._check_new_name(mask_name)
        if not isinstance(config, MaskConfig):
            raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
        config.validate()
        self._check_compatible(mask_name, config, "MaskConfig")
        layers = self.masked_layers()
        with unwrapped(self.base_model, layers) as model:
            targets = find_targets(
                model, config.target_modules, config.exclude_modules, config.m, config.strict
            )
            self._check_same_layers(mask_name, targets, "its target_modules / exclude_modules")
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = self.mask_configs[self._active].base_model_name_or_path
            masks = prior_masks(model, config, self.masked_names, calibration_data, tokenizer)
        shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
        devices = {name: layer.mask_logits.device for name, layer in layers.items()}
        logits = random_logits(config, shapes, devices)
        if masks is not None:
            for name in logits:
                layer_masks = [source[name].to(devices[name]) for source in masks]
                logits[name] = prior_logits(
                    logits[name], layer_masks, config.n, config.m, config.prior_strength, config.init_std,
                )  # fmt: skip
        self._masks[mask_name] = NamedMask(
            config,
            trainable=True,
            logits={k: nn.Parameter(v, requires_grad=False) for k, v in logits.items()},
        )

    def load_mask(
        self,
        name_or_path: str | os.PathLike,
        mask_name: str,
        is_trainable: bool = False,
        revision: str | None = None,
        subfolder: str | None = None,
        keep_logits: bool = False,
    ) -> None:
        """Load a saved mask (folder or Hub repo id) under ``mask_name``, beside the others; not activated.

        ``is_trainable=False`` holds it as a packed hard mask while inactive (0.647 bit per weight for
        2:4) and decodes it on :meth:`set_mask`; ``keep_logits=True`` keeps its logits instead, so that
        switching to it only moves references. ``subfolder``: a mask saved in a subfolder of the repo.
        """
        from .save_and_load import logits_from_saved, read_config, read_saved_mask, resolve_mask_folder

        self._check_new_name(mask_name)
        folder = resolve_mask_folder(name_or_path, revision, subfolder)
        config = read_config(folder)
        self._check_compatible(mask_name, config, f"the mask in {folder}")
        layers = self.masked_layers()
        shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
        try:
            saved = read_saved_mask(folder, config, shapes)
        except MaskFileError as e:
            raise MaskFileError(f"Mask {mask_name!r}: {e}") from None
        mask = NamedMask(config, trainable=is_trainable, summary=saved.summary, keep_logits=keep_logits)
        if is_trainable or keep_logits:
            load_config = MaskConfig.from_dict({**config.to_dict(), "prior": None})
            devices = {name: layer.mask_logits.device for name, layer in layers.items()}
            logits = logits_from_saved(saved, random_logits(load_config, shapes, devices))
            mask.logits = {k: nn.Parameter(v, requires_grad=False) for k, v in logits.items()}
        if not is_trainable:
            mask.packed = saved.packed
        self._masks[mask_name] = mask

    def set_mask(self, mask_name: str) -> None:
        """Make ``mask_name`` the active mask: the forward uses it, and it alone trains (when trainable).

        Moves parameter references only (no weight is copied); a packed mask is decoded first. Switch
        before a Trainer, DDP or FSDP wraps the model: they hold the active parameters.
        """
        self._check_not_merged()
        if mask_name not in self._masks:
            raise MaskLLMError(
                f"No mask named {mask_name!r}; this model holds {self.list_masks()}. Add it with add_mask or "
                "load_mask first."
            )
        layers = self.masked_layers()
        new = self._masks[mask_name]
        if mask_name == self._active:
            for layer in layers.values():
                layer.mask_logits.requires_grad_(new.trainable)
            return
        logits = new.logits if new.logits is not None else self._decode(new, layers)
        old = self._masks[self._active]
        # A packed mask drops its decoded logits; their memory may be reused by the next logits, so the hard
        # masks the layers cached for them are dropped too. Logits kept aside stay alive: their cache entries
        # (keyed on the logits' storage) cannot match another mask's.
        drop = old.packs_when_inactive
        old.logits = None if drop else {name: layer.mask_logits for name, layer in layers.items()}
        cfg = new.config
        schedule = (float(cfg.tau[0]), float(cfg.kappa[0]), cfg.hard)
        for name, layer in layers.items():
            layer.mask_logits.requires_grad_(False)
            param = logits[name]
            if param.device != layer.mask_logits.device:  # the model moved while this mask was aside
                param = nn.Parameter(param.detach().to(layer.mask_logits.device), requires_grad=False)
            layer.mask_logits = param
            if layer.candidate_major_logits:  # the layout the layer was set to (set_candidate_major_logits)
                layer.set_logits_layout(True)
            param.requires_grad_(new.trainable)
            if (layer.tau, layer.kappa, layer.hard) != schedule:  # (nn.Module.__setattr__ is slow)
                layer.tau, layer.kappa, layer.hard = schedule
            if drop:
                layer.train(layer.training)  # drops the cached hard mask
        new.logits = {name: layer.mask_logits for name, layer in layers.items()}
        self._active = mask_name

    def delete_mask(self, mask_name: str) -> None:
        """Remove an inactive mask (the active one is refused: switch first)."""
        if mask_name not in self._masks:
            raise MaskLLMError(f"No mask named {mask_name!r}; this model holds {self.list_masks()}.")
        if mask_name == self._active:
            raise MaskLLMError(
                f"Mask {mask_name!r} is the active mask and cannot be deleted; activate another one with "
                f"set_mask (masks: {self.list_masks()}), then delete it."
            )
        del self._masks[mask_name]

    def mask_state(self, mask_name: str | None = None) -> MaskState:
        """Where a mask stands (``"active"``, ``"logits"`` or ``"packed"``) and its bytes in memory."""
        name = self._active if mask_name is None else mask_name
        if name not in self._masks:
            raise MaskLLMError(f"No mask named {name!r}; this model holds {self.list_masks()}.")
        mask = self._masks[name]
        layers = self.masked_layers()
        weights = sum(layer.in_features * layer.out_features for layer in layers.values())
        if name == self._active:
            state, tensors = "active", [layer.mask_logits for layer in layers.values()]
        elif mask.logits is not None:
            state, tensors = "logits", list(mask.logits.values())
        else:
            state, tensors = "packed", list(mask.packed.values())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return MaskState(state, nbytes, 8 * nbytes / max(weights, 1))

    def _check_new_name(self, mask_name: str) -> None:
        self._check_not_merged()
        check_mask_name(mask_name)
        if mask_name in self._masks:
            raise MaskLLMError(
                f"A mask named {mask_name!r} exists already (masks: {self.list_masks()}); pick another name, or "
                "delete_mask it first."
            )

    def _check_compatible(self, mask_name: str, config: MaskConfig, what: str) -> None:
        ours = self.mask_config
        if (config.n, config.m) != (ours.n, ours.m):
            raise MaskLLMError(
                f"Mask {mask_name!r}: {what} is {config.n}:{config.m} but this MaskModel's masks are "
                f"{ours.n}:{ours.m}; every mask of one MaskModel shares the N:M of its layers. Use a "
                f"{ours.n}:{ours.m} mask, or wrap the base model in a separate MaskModel."
            )

    def _check_same_layers(self, mask_name: str, targets: list[str], what: str) -> None:
        if targets != self.masked_names:
            missing = sorted(set(self.masked_names) - set(targets))
            extra = sorted(set(targets) - set(self.masked_names))
            raise MaskLLMError(
                f"Mask {mask_name!r}: {what} select other layers than this MaskModel's masks (missing "
                f"{missing[:3]}, extra {extra[:3]}); every mask of one MaskModel covers the same layers. Use the "
                f"active mask's target_modules ({self.mask_config.target_modules!r})."
            )

    def _decode(self, mask: NamedMask, layers: dict[str, MaskedLinear]) -> dict[str, torch.Tensor]:
        """One-hot logits of a packed mask's hard mask, on each layer's device."""
        cfg = mask.config
        c = num_candidates(cfg.n, cfg.m)
        dtype = next(iter(layers.values())).mask_logits.dtype
        out = {}
        for name, layer in layers.items():
            idx = unpack_indices(mask.packed[name], layer.out_features * layer.in_features // cfg.m, c)
            out[name] = nn.Parameter(
                hard_logits(idx, c, dtype, layer.mask_logits.device), requires_grad=False
            )
        return out

    @torch.no_grad()
    def hard_masks(self, mask_name: str | None = None) -> dict[str, torch.Tensor]:
        """The exact N:M bool mask ``[out, in]`` of every masked layer (of the active mask by default)."""
        if mask_name is None or mask_name == self._active:
            return {name: layer.hard_mask().clone() for name, layer in self.masked_layers().items()}
        cfg = self._masks[mask_name].config
        cand = candidate_patterns(cfg.n, cfg.m, dtype=torch.bool)
        layers = self.masked_layers()
        return {
            name: cand[idx].reshape(layers[name].out_features, layers[name].in_features)
            for name, idx in self.hard_indices(mask_name).items()
        }

    @torch.no_grad()
    def hard_indices(self, mask_name: str | None = None) -> dict[str, torch.Tensor]:
        """Candidate index (argmax) of every group of every masked layer (of the active mask by default)."""
        layers = self.masked_layers()
        if mask_name is None or mask_name == self._active:
            return {name: layer.mask_logits.argmax(dim=-1) for name, layer in layers.items()}
        if mask_name not in self._masks:
            raise MaskLLMError(f"No mask named {mask_name!r}; this model holds {self.list_masks()}.")
        mask = self._masks[mask_name]
        if mask.logits is not None:
            return {name: t.argmax(dim=-1).cpu() for name, t in mask.logits.items()}
        c = num_candidates(mask.config.n, mask.config.m)
        return {
            name: unpack_indices(
                mask.packed[name], layer.out_features * layer.in_features // mask.config.m, c
            )
            for name, layer in layers.items()
        }
