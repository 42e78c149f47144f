"""Named masks of a :class:`~hf_maskllm.MaskModel`: PEFT's multi-adapter API, and each mask's state.

:class:`NamedMasksMixin` gives ``MaskModel`` ``add_mask`` / ``load_mask`` / ``set_mask`` / ``delete_mask`` /
``list_masks`` / ``active_mask``. The tensors of every mask belong to the masked layers
(:class:`~hf_maskllm.MaskedLinear`: logits as parameters, packed hard masks as buffers); the mixin keeps
what is per mask rather than per layer: its config, training summary and whether it trains. Every mask
covers the same layers with the same N:M; the base weights exist once. A mask is in one of three states
(for 2:4: ``C(4, 2) = 6`` logits per group of 4 weights):

- ``"active"``: the forward uses its logits and, when the mask is trainable, they are the only
  parameters with ``requires_grad``. ``C / m`` logits per weight (2:4 in bf16: 3 bytes per weight).
- ``"logits"``: inactive, its logits held with ``requires_grad=False`` (trainable masks, and masks
  loaded with ``keep_logits=True``); the same ``C / m`` logits per weight. Activating it flips
  ``requires_grad`` only.
- ``"packed"``: inactive and not trainable; only its hard mask, as candidate indices packed in
  base ``C`` (``packing.py``: 0.647 bit per weight for 2:4). Activating it decodes the hard mask
  into one-hot logits.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, MaskFileError, MaskLLMError
from ..modules import dense_weight_view, is_conv1d
from ..patterns import candidate_patterns
from .config import MaskConfig
from .mask_source import MaskSource, holds_mask, open_mask_source, read_mask, warn_other_base_model
from .objective import is_causal_lm
from .prior_init import TORCH_DTYPES, initial_logits, prior_masks, wanda_order_norms
from .save_and_load import DEFAULT_MASK_NAME, check_mask_name, logits_from_saved
from .targets import find_targets
from .wrapping import unwrapped

__all__ = ["MaskState", "NamedMask", "NamedMasksMixin"]


@dataclass
class MaskState:
    """Where a mask stands: ``state`` (``"active"``, ``"logits"`` or ``"packed"``), its bytes in memory
    (its logits, or its packed hard mask) and those bytes per masked weight in bits."""

    state: str
    nbytes: int
    bits_per_weight: float


@dataclass(frozen=True)
class NamedMask:
    """What is kept per mask besides its tensors: its config, whether it trains, whether its logits stay
    while inactive (``keep_logits``; otherwise a non-trainable mask keeps only its packed hard mask),
    and its training summary."""

    config: MaskConfig
    trainable: bool
    keep_logits: bool = False
    summary: dict[str, Any] = field(default_factory=dict)


class NamedMasksMixin:
    """PEFT's multi-adapter API for masks (``add_adapter`` / ``set_adapter`` / ...), mixed into ``MaskModel``.

    Uses the host's ``masked_layers()``, ``masked_names``, ``base_model`` and ``schedule``; call
    :meth:`_init_named_masks` from the host's ``__init__``.
    """

    def _init_named_masks(self) -> None:
        self._mask_info: dict[str, NamedMask] = {}
        self._active: str | None = None

    # ------------------------------------------------------------------ reading
    @property
    def active_mask(self) -> str:
        """Name of the mask the forward uses (and the only one that trains)."""
        return self._active

    @property
    def mask_config(self) -> MaskConfig:
        """The active mask's config."""
        return self._mask_info[self._active].config

    @property
    def mask_configs(self) -> dict[str, MaskConfig]:
        """``{mask name: config}`` of every mask (PEFT's ``peft_config``)."""
        return {name: mask.config for name, mask in self._mask_info.items()}

    def mask_info(self, mask_name: str | None = None) -> NamedMask:
        """Config, trainability and training summary of a mask (default: the active one)."""
        return self._mask_info[self._known(mask_name)]

    @property
    def training_summary(self) -> dict[str, Any]:
        """The active mask's training summary (saved with it; ``update`` it to add entries)."""
        return self._mask_info[self._active].summary

    @training_summary.setter
    def training_summary(self, value: dict[str, Any]) -> None:
        info = self._mask_info[self._active]
        self._mask_info[self._active] = dataclasses.replace(info, summary=dict(value))

    def list_masks(self) -> list[str]:
        """Names of every mask, in the order they were added."""
        return list(self._mask_info)

    def mask_state(self, mask_name: str | None = None) -> MaskState:
        """Where a mask stands (``"active"``, ``"logits"`` or ``"packed"``) and its bytes in memory."""
        name = self._known(mask_name)
        layers = self.masked_layers().values()
        weights = sum(layer.in_features * layer.out_features for layer in layers)
        if name == self._active:
            state, tensors = "active", [layer.mask_logits for layer in layers]
        elif all(layer.has_logits(name) for layer in layers):
            state, tensors = "logits", [layer.get_logits(name) for layer in layers]
        else:
            state, tensors = "packed", [layer.get_packed(name) for layer in layers]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return MaskState(state, nbytes, 8 * nbytes / max(weights, 1))

    @torch.no_grad()
    def hard_indices(self, mask_name: str | None = None) -> dict[str, torch.Tensor]:
        """Candidate index (argmax) of every group of every masked layer (of the active mask by default)."""
        name = self._known(mask_name)
        return {layer_name: layer.hard_indices(name) for layer_name, layer in self.masked_layers().items()}

    @torch.no_grad()
    def hard_masks(self, mask_name: str | None = None) -> dict[str, torch.Tensor]:
        """The exact N:M bool mask ``[out, in]`` of every masked layer (of the active mask by default)."""
        name = self._known(mask_name)
        layers = self.masked_layers()
        if name == self._active:
            return {layer_name: layer.hard_mask().clone() for layer_name, layer in layers.items()}
        cfg = self._mask_info[name].config
        cand = candidate_patterns(cfg.n, cfg.m, dtype=torch.bool)
        return {
            layer_name: cand[layer.hard_indices(name).cpu().long()].reshape(
                layer.out_features, layer.in_features
            )
            for layer_name, layer in layers.items()
        }

    # ------------------------------------------------------------------ adding
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

        ``config`` is not changed: the mask keeps a resolved copy (``mask_configs[mask_name]``), with the
        defaults left to the model (``distill_logits``, ``wanda_strength``, ``base_model_name_or_path``)
        filled in; that copy is saved with the mask.
        """
        self._check_new_name(mask_name)
        if not isinstance(config, MaskConfig):
            raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
        config.validate()
        config = copy.deepcopy(config)  # the resolved copy: the caller's object stays as written
        self._check_compatible(mask_name, config, "MaskConfig")
        layers = self.masked_layers()
        with unwrapped(self.base_model, layers) as model:
            if self._mask_info:  # the first mask defines the layers
                targets = find_targets(
                    model, config.target_modules, config.exclude_modules, config.m, config.strict
                )
                self._check_same_layers(mask_name, targets, "its target_modules / exclude_modules")
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = _name_or_path(model)
            config.resolve_objective(is_causal_lm(model))
            config.resolve_wanda_strength(calibration_data is not None)
            priors = prior_masks(model, config, self.masked_names, calibration_data, tokenizer)
            norms = None
            if config.wanda_strength:
                norms = wanda_order_norms(model, config, self.masked_names, calibration_data, tokenizer)
        shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
        devices = {name: layer.base_layer.weight.device for name, layer in layers.items()}
        wanda = None
        if norms is not None:
            wanda = {
                name: (dense_weight_view(layer.base_layer), norms[name]) for name, layer in layers.items()
            }
        logits = initial_logits(config, shapes, devices, priors, wanda)
        for name, layer in layers.items():
            layer.add_mask(mask_name, logits=logits[name])
        self._mask_info[mask_name] = NamedMask(config, trainable=True)

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
        switching to it only flips ``requires_grad``. ``subfolder``: a mask saved in a subfolder of the repo.
        """
        self._load_mask(name_or_path, mask_name, is_trainable, revision, subfolder, keep_logits, False)

    def _load_mask(
        self,
        name_or_path: str | os.PathLike | MaskSource,
        mask_name: str,
        is_trainable: bool,
        revision: str | None,
        subfolder: str | None,
        keep_logits: bool,
        with_logits: bool,
        reference_config: MaskConfig | None = None,
    ) -> None:
        """``load_mask``; ``with_logits``: hold the logits (saved, or rebuilt from the hard masks) whatever
        ``is_trainable`` and ``keep_logits`` say, as ``from_pretrained`` does for the mask it activates.
        ``reference_config``: the config of a file that carries none (NVlabs' ``mask_compressed.npz``,
        PATCH's ``mask.npz``; default: the active mask's, without its prior). ``name_or_path`` may be a
        :class:`MaskSource` already opened (``from_pretrained``)."""
        self._check_new_name(mask_name)
        layers = self.masked_layers()
        shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
        if isinstance(name_or_path, MaskSource):
            source = name_or_path
        else:
            self._check_not_a_named_subfolder(name_or_path, mask_name, subfolder)
            default = reference_config or MaskConfig.from_dict({**self.mask_config.to_dict(), "prior": None})
            source = open_mask_source(name_or_path, revision, subfolder, default=default)
        config = source.config
        if source.format == "hf_maskllm":  # a config saved before a model filled it in
            config.resolve_objective(is_causal_lm(self.base_model))
        what = (
            f"the mask in {source.path}"
            if source.format == "hf_maskllm"
            else f"the MaskConfig for {source.path}"
        )
        self._check_compatible(mask_name, config, what)
        warn_other_base_model(source, _name_or_path(self.base_model), stacklevel=4)
        transposed = {name for name, layer in layers.items() if is_conv1d(layer.base_layer)}
        model_layers = {name for name, _ in self.base_model.named_modules()}
        weights = {name: dense_weight_view(layer.base_layer) for name, layer in layers.items()}
        try:
            saved = read_mask(source, shapes, transposed, model_layers, weights)
        except MaskFileError as e:
            raise MaskFileError(f"Mask {mask_name!r}: {e}") from e
        logits = None
        if is_trainable or keep_logits or with_logits:
            load_config = MaskConfig.from_dict({**config.to_dict(), "prior": None})
            devices = {name: layer.base_layer.weight.device for name, layer in layers.items()}
            logits = logits_from_saved(saved, initial_logits(load_config, shapes, devices))
        for name, layer in layers.items():
            layer.add_mask(
                mask_name,
                logits=None if logits is None else logits[name],
                packed=None if is_trainable else saved.packed[name],
            )
        self._mask_info[mask_name] = NamedMask(config, is_trainable, keep_logits, dict(saved.summary))

    # ------------------------------------------------------------------ switching
    def set_mask(self, mask_name: str) -> None:
        """Make ``mask_name`` the active mask: the forward uses it, and it alone trains (when trainable).

        No weight is copied; a packed mask is decoded first. Switch before a Trainer, DDP or FSDP wraps
        the model: they hold the parameters that train.
        """
        name = self._known(mask_name)
        new = self._mask_info[name]
        old = self._active
        dtype = TORCH_DTYPES[new.config.logits_dtype]
        for layer in self.masked_layers().values():
            layer.set_mask(name, trainable=new.trainable, logits_dtype=dtype)
            if old is not None and old != name and self._packs_when_inactive(old):
                layer.drop_logits(old)
        if old != name:
            cfg = new.config
            self.schedule.update(tau=float(cfg.tau[0]), kappa=float(cfg.kappa[0]), hard=bool(cfg.hard))
        self._active = name

    def delete_mask(self, mask_name: str) -> None:
        """Remove an inactive mask (the active one is refused: switch first)."""
        name = self._known(mask_name)
        if name == self._active:
            raise MaskLLMError(
                f"Mask {name!r} is the active mask and cannot be deleted; activate another one with "
                f"set_mask (masks: {self.list_masks()}), then delete it."
            )
        for layer in self.masked_layers().values():
            layer.delete_mask(name)
        del self._mask_info[name]

    def _packs_when_inactive(self, mask_name: str) -> bool:
        """True when deactivating ``mask_name`` drops its logits (its packed hard mask stays)."""
        info = self._mask_info[mask_name]
        return not info.trainable and not info.keep_logits

    # ------------------------------------------------------------------ checks
    def _known(self, mask_name: str | None) -> str:
        name = self._active if mask_name is None else mask_name
        if name not in self._mask_info:
            raise MaskLLMError(
                f"No mask named {name!r}; this model holds {self.list_masks()}. Add it with add_mask or "
                "load_mask first."
            )
        return name

    def _check_new_name(self, mask_name: str) -> None:
        self.masked_layers()  # refuses a merged model
        check_mask_name(mask_name)
        if mask_name in self._mask_info:
            raise MaskLLMError(
                f"A mask named {mask_name!r} exists already (masks: {self.list_masks()}); pick another name, or "
                "delete_mask it first."
            )

    def _check_compatible(self, mask_name: str, config: MaskConfig, what: str) -> None:
        layer = next(iter(self.masked_layers().values()))
        if (config.n, config.m) != (layer.n, layer.m):
            raise MaskLLMError(
                f"Mask {mask_name!r}: {what} is {config.n}:{config.m} but this MaskModel's masks are "
                f"{layer.n}:{layer.m}; every mask of one MaskModel shares the N:M of its layers. Use a "
                f"{layer.n}:{layer.m} mask, or wrap the base model in a separate MaskModel."
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

    @staticmethod
    def _check_not_a_named_subfolder(
        name_or_path: str | os.PathLike, mask_name: str, subfolder: str | None
    ) -> None:
        """Refuse ``mask_name="code"`` on a folder whose ``code/`` subfolder holds a mask saved under that name:
        the folder's own (default) mask would load under the name of another mask."""
        if subfolder is not None or mask_name == DEFAULT_MASK_NAME:
            return
        root = Path(name_or_path).expanduser()
        if holds_mask(root) and holds_mask(root / mask_name):
            raise MaskFileError(
                f"{str(root)!r} holds its default mask at the top and a mask saved as {mask_name!r} in "
                f"{str(root / mask_name)!r}; mask_name={mask_name!r} alone would load the default mask under that "
                f"name. Pass subfolder={mask_name!r} to load the mask saved as {mask_name!r}, or give the default "
                "mask another name."
            )


def _name_or_path(model: nn.Module) -> str | None:
    """The name or path a transformers model was loaded from, if it records one."""
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None
