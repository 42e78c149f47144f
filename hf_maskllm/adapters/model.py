"""``MaskModel``: a transformers model with named N:M masks over its linear layers (PEFT's multi-adapter API).

The wrapper holds the transformers model as ``base_model``, swaps each targeted layer for a
:class:`MaskedLinear` in place (``wrapping.py``) and forwards every other attribute. It holds one or
more named masks over the same layers (``named_masks.py``: the API and the states of a mask); the active one's logits are the layers'
``mask_logits``. Priors: ``prior_init.py``; saving and loading: ``save_and_load.py``; merging: ``merge.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, MaskFileError, MaskLLMError, TargetError
from ..modules import dense_weight_view
from .config import MaskConfig
from .layer import MaskedLinear
from .merge import merge_layers, merged_view
from .named_masks import DEFAULT_MASK_NAME, NamedMask, NamedMasksMixin, check_mask_name
from .prior_init import prior_logits, random_logits
from .save_and_load import (
    logits_from_saved,
    read_config,
    read_saved_mask,
    resolve_mask_folder,
    save_masks,
)
from .targets import find_targets
from .wrapping import wrap_layers

__all__ = ["MaskModel"]


class MaskModel(NamedMasksMixin, nn.Module):
    """A transformers model whose targeted linears carry learnable N:M masks, one or more, by name.

    The first mask is named ``"default"`` (``mask_name`` changes it). Only the active mask's logits
    are parameters of the model: ``state_dict()`` holds just those (the frozen weights belong to the
    base model, inactive masks are held aside), so Trainer checkpoints stay small and resume exactly.
    """

    def __init__(
        self,
        model: nn.Module,
        config: MaskConfig,
        targets: list[str] | None = None,
        mask_name: str = DEFAULT_MASK_NAME,
    ) -> None:
        super().__init__()
        if isinstance(model, MaskModel) or any(isinstance(mod, MaskedLinear) for mod in model.modules()):
            raise MaskLLMError(
                "This model already carries mask adapters; pass the plain transformers model, or add another mask "
                "to its MaskModel with add_mask / load_mask."
            )
        check_mask_name(mask_name)
        config.validate()
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = (
                getattr(getattr(model, "config", None), "_name_or_path", None) or None
            )
        self.base_model = model
        self.sparse_reg_weight = 0.0  # lambda * (1 - t/T); set by MaskAnnealCallback
        self.grad_accum_steps = 1  # divisor of the regulariser, set by MaskAnnealCallback (see forward)
        self.last_sparse_reg_term: torch.Tensor | None = None
        self._merged = False
        names = (
            targets
            if targets is not None
            else find_targets(model, config.target_modules, config.exclude_modules, config.m, config.strict)
        )
        for p in model.parameters():
            p.requires_grad_(False)
        shapes = {name: tuple(dense_weight_view(model.get_submodule(name)).shape) for name in names}
        wrap_layers(model, random_logits(config, shapes), config.n, config.m)
        self.masked_names = list(names)
        layers = self.masked_layers()
        self._masks: dict[str, NamedMask] = {
            mask_name: NamedMask(config, trainable=True, logits={k: v.mask_logits for k, v in layers.items()})
        }
        self._active = mask_name
        self._apply_schedule(config.tau[0], config.kappa[0])
        self._schedule_driven = False  # set by set_schedule_values (MaskAnnealCallback calls it every step)
        self._warned_unscheduled = False
        # Trainer keeps only dataset columns named in forward's signature: show the base model's.
        self._install_forward_signature()

    # ------------------------------------------------------------------ plumbing
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_model", "_modules", "_parameters", "_buffers", "_masks"):
                raise
            return getattr(self._modules["base_model"], name)

    def _install_forward_signature(self) -> None:
        base_sig = inspect.signature(self.base_model.forward)
        func = types.FunctionType(
            MaskModel._forward.__code__,
            MaskModel._forward.__globals__,
            "forward",
            None,
            MaskModel._forward.__closure__,
        )
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        func.__signature__ = base_sig.replace(parameters=[self_param, *base_sig.parameters.values()])
        func.__doc__ = MaskModel._forward.__doc__
        self.__dict__["forward"] = types.MethodType(func, self)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the base model with the active mask; in training the sparse weight regulariser joins the
        gradient of ``loss`` while its value stays the language-model loss."""
        track = self.training and self.sparse_reg_weight > 0
        layers = list(self.masked_layers().values())
        if (
            self.training
            and not self._schedule_driven
            and not self._warned_unscheduled
            and torch.is_grad_enabled()
        ):
            if any(layer.mask_logits.requires_grad for layer in layers):
                self._warned_unscheduled = True
                warnings.warn(
                    "The masks are training without MaskAnnealCallback: tau stays at its start value "
                    f"({layers[0].tau}), kappa at {layers[0].kappa}, there is no sparse weight regulariser and no mask "
                    "statistics. Add callbacks=[MaskAnnealCallback()] to the Trainer (hf_maskllm.learn.learn_mask "
                    "does), or call set_schedule_values(tau, kappa) in a custom training loop.",
                    stacklevel=2,
                )
        for layer in layers:
            layer.track_sparse_reg = track
            layer.last_sparse_reg = None
        self.last_sparse_reg_term = None
        scaled_for_accumulation = kwargs.get("num_items_in_batch") is not None
        outputs = self.base_model(*args, **kwargs)
        if track and getattr(outputs, "loss", None) is not None:
            regs = [layer.last_sparse_reg for layer in layers if layer.last_sparse_reg is not None]
            trainable = any(layer.mask_logits.requires_grad for layer in layers)
            if torch.is_grad_enabled() and trainable and any(not r.requires_grad for r in regs):
                warnings.warn(
                    "The sparse weight regulariser gets no gradient in some masked layers: they ran without "
                    "autograd (reentrant activation checkpointing?). Use non-reentrant checkpointing "
                    "(activation_checkpointing_kwargs={'use_reentrant': False}, gradient_checkpointing_kwargs in older transformers; the default) or "
                    "MaskConfig(sparse_reg=0).",
                    stacklevel=2,
                )
            if regs:
                # -lambda * (1 - t/T) * sum ||W * mask||^2 (the paper's sparse weight regulariser). When the Trainer normalises the
                # loss over the accumulated batch (num_items_in_batch) it no longer divides by the
                # accumulation steps (and multiplies by the process count), so the callback sets the divisor.
                divisor = self.grad_accum_steps if scaled_for_accumulation else 1
                total = sum(r.to(outputs.loss.device) for r in regs)  # layers may sit on several devices
                term = -self.sparse_reg_weight * total
                self.last_sparse_reg_term = term.detach()  # logged by MaskAnnealCallback as sparse_reg_loss
                # term - term.detach() is zero in value and carries the term's gradient: the logged loss is
                # the language-model loss, the logits' gradient includes the regulariser.
                outputs.loss = outputs.loss + (term - term.detach()).to(outputs.loss.dtype) / divisor
            for layer in layers:
                layer.last_sparse_reg = None
        return outputs

    forward = _forward

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``base_model.generate`` with the active mask (hard masks in eval mode)."""
        return self.base_model.generate(*args, **kwargs)

    def get_base_model(self) -> nn.Module:
        """The wrapped transformers model (with MaskedLinear layers inside)."""
        return self.base_model

    def masked_layers(self) -> dict[str, MaskedLinear]:
        """``{name in the base model: MaskedLinear}`` for every masked layer."""
        self._check_not_merged()
        return {name: self.base_model.get_submodule(name) for name in self.masked_names}

    def set_schedule_values(self, tau: float, kappa: float) -> None:
        """Set the Gumbel temperature and logit scale of every masked layer (``MaskAnnealCallback`` does
        it every step; a custom training loop calls it itself)."""
        self._apply_schedule(tau, kappa)
        self._schedule_driven = True

    def _apply_schedule(self, tau: float, kappa: float) -> None:
        for layer in self.masked_layers().values():
            layer.tau, layer.kappa, layer.hard = float(tau), float(kappa), self.mask_config.hard

    def set_compiled_sampling(self, enabled: bool) -> bool:
        """Run this model's fused mask sampling through ``torch.compile``; returns the previous setting.

        Per model (two models in one process keep their own setting). ``MaskAnnealCallback`` turns it
        on for a training run when a compiler is present and restores it at the end.
        """
        layers = list(self.masked_layers().values())
        previous = any(layer.compiled_sampling for layer in layers)
        for layer in layers:
            layer.compiled_sampling = bool(enabled)
        return previous

    def set_candidate_major_logits(self, enabled: bool) -> bool:
        """Store every masked layer's logits candidate-major or row-major; returns the previous setting.

        Candidate-major: the ``[G, C]`` parameter is backed by ``[C, G]`` storage, so the fused training
        passes read and write each candidate's column contiguously (faster on CPU; docs/design.md).
        Values, shapes, state dicts and saved files are the same either way. ``MaskAnnealCallback`` turns
        it on when the Trainer is created, unless the run uses FSDP (which shards only contiguous
        parameters). Set it before an optimizer, DDP or FSDP takes hold of the logits.
        """
        layers = list(self.masked_layers().values())
        previous = any(layer.candidate_major_logits for layer in layers)
        for layer in layers:
            layer.set_logits_layout(enabled)
        return previous

    def set_recompute_sampling(self, recompute: bool | None) -> bool | None:
        """Whether the backward pass regenerates each layer's mask sample instead of keeping its
        probabilities from the forward pass; returns the previous setting.

        Keeping costs 4 * C(m, n) / m bytes per masked weight (6 for 2:4; docs/scale.md has the measured
        peak memory of both settings),
        held from a layer's forward pass to its backward pass, and saves drawing the noise a second
        time. ``None`` (the default): keep on CPU, where that drawing is a large part of the step;
        recompute on GPUs, where memory is scarcer.
        """
        layers = list(self.masked_layers().values())
        previous = layers[0].recompute_sampling if layers else None
        for layer in layers:
            layer.recompute_sampling = None if recompute is None else bool(recompute)
        return previous

    @contextlib.contextmanager
    def disable_masks(self) -> Iterator[None]:
        """Context in which every masked layer runs dense (for comparisons)."""
        layers = self.masked_layers().values()
        for layer in layers:
            layer.masking_enabled = False
        try:
            yield
        finally:
            for layer in layers:
                layer.masking_enabled = True

    # ------------------------------------------------------------------ state
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Only the active mask's logits (what a Trainer checkpoint needs to resume), row-major
        (the layers store them candidate-major; safetensors writes contiguous tensors only)."""
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
        for key in [k for k in full if k.startswith(prefix)]:
            if key.endswith(".mask_logits"):
                if not keep_vars:
                    full[key] = full[key].contiguous()
            else:
                del full[key]
        return full

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable, all)`` parameter counts, like PEFT (inactive masks are not parameters)."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        return trainable, total

    def print_trainable_parameters(self) -> None:
        """Print trainable (mask logits) vs all parameters, like PEFT."""
        trainable, total = self.get_nb_trainable_parameters()
        masked = sum(layer.in_features * layer.out_features for layer in self.masked_layers().values())
        print(
            f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
            f" || masked weights: {masked:,} in {len(self.masked_names)} layers ({self.mask_config.n}:{self.mask_config.m})"
            f" || active mask: {self._active!r} of {len(self._masks)}"
        )

    # ------------------------------------------------------------------ prior
    @torch.no_grad()
    def apply_prior(
        self, masks: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]], strength: float | None = None
    ) -> None:
        """Initialise the active mask's logits from N:M masks (``[out, in]`` bool per layer name).

        ``logits += alpha * std(logits) * (overlap(candidate, mask) - n/2)`` (the paper's prior rule); the
        initial hard mask then equals the prior exactly (``prior_init.prior_logits``). A list of such
        dicts is a combined prior: the terms add, and where the masks disagree learning decides.
        """
        cfg = self.mask_config
        alpha = cfg.prior_strength if strength is None else float(strength)
        layers = self.masked_layers()
        sources = masks if isinstance(masks, list) else [masks]
        for source in sources:
            unknown = sorted(set(source) - set(layers))
            missing = sorted(set(layers) - set(source))
            if unknown or missing:
                raise MaskFileError(
                    f"Prior masks do not match the masked layers: missing {missing[:3]}, unknown {unknown[:3]}. "
                    "A prior must cover exactly the layers selected by target_modules."
                )
            for name, layer in layers.items():
                if tuple(source[name].shape) != (layer.out_features, layer.in_features):
                    raise MaskFileError(
                        f"Prior mask for {name} has shape {tuple(source[name].shape)}, the layer is "
                        f"{(layer.out_features, layer.in_features)} ([out, in])."
                    )
        for name, layer in layers.items():
            layer_masks = [source[name].to(layer.mask_logits.device) for source in sources]
            layer.mask_logits.copy_(
                prior_logits(layer.mask_logits, layer_masks, cfg.n, cfg.m, alpha, cfg.init_std)
            )

    # ------------------------------------------------------------------ save / load / share
    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        save_logits: bool = False,
        merged: bool = False,
        dense: bool = False,
        tokenizer: Any = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        selected_masks: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Save every mask (or ``selected_masks``): config, packed hard masks, optional logits, model card.

        The mask named ``"default"`` goes into ``save_directory`` itself, every other one into
        ``save_directory/<mask name>`` (PEFT's layout). ``merged=True`` instead writes the sparse model
        with the active mask as a compressed N:M checkpoint (``dense=True``: a plain transformers
        checkpoint with zeros) that ``from_pretrained`` loads. ``state_dict``: the active mask's logits
        keyed as ``state_dict()`` keys them, used instead of the layers' own; under FSDP, where each
        process holds a shard of them, the full state dict that ``accelerator.get_state_dict(model)``
        gathers on every process (the main process then saves).
        """
        if merged:
            if state_dict is not None or selected_masks is not None:
                raise ConfigError(
                    "state_dict and selected_masks apply to mask saves only; a merged checkpoint holds the active "
                    "mask. For a sharded model, load the saved mask into an unsharded model "
                    "(MaskModel.from_pretrained) and save that."
                )
            from ..sparse.checkpoint import save_compressed

            with merged_view(self.base_model, self.masked_layers()) as model:
                save_compressed(
                    model,
                    save_directory,
                    n=self.mask_config.n,
                    m=self.mask_config.m,
                    modules=list(self.masked_names),
                    dense=dense,
                    tokenizer=tokenizer,
                    model_card=self._merged_card_fields(),
                    **kwargs,
                )
            return
        if kwargs:
            raise ConfigError(f"Unexpected arguments for a mask save: {sorted(kwargs)}.")
        self._check_not_merged()
        save_masks(self, save_directory, selected_masks, save_logits, state_dict)

    def _merged_card_fields(self) -> dict[str, Any]:
        cfg = self.mask_config
        fields: dict[str, Any] = {}
        if cfg.base_model_name_or_path:
            fields["base_model"] = cfg.base_model_name_or_path
        if self._active != DEFAULT_MASK_NAME:
            fields["mask"] = self._active
        fields["how the mask was learned"] = (
            f"MaskLLM (hf_maskllm): learnable {cfg.n}:{cfg.m} masks sampled with Gumbel softmax, weights frozen; "
            f"prior: {' + '.join(cfg.prior_sources) or 'none'}"
        )
        fields.update({key.replace("_", " "): value for key, value in sorted(self.training_summary.items())})
        return fields

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload hf_maskllm mask",
        revision: str | None = None,
        **save_kwargs: Any,
    ) -> str:
        """Save (every mask, or ``selected_masks=[...]``) to a temporary folder and upload it to the Hub repo
        ``repo_id`` in one commit; returns the commit URL. The save (and its N:M verification) completes
        before the repo is created."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, **save_kwargs)
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo_id, folder_path=tmp, commit_message=commit_message, revision=revision
            )
        return str(getattr(info, "commit_url", info))

    @classmethod
    def from_pretrained(
        cls,
        model: nn.Module,
        name_or_path: str | os.PathLike,
        is_trainable: bool = False,
        revision: str | None = None,
        mask_name: str = DEFAULT_MASK_NAME,
        subfolder: str | None = None,
        keep_logits: bool = False,
    ) -> MaskModel:
        """Attach a saved mask (folder or Hub repo id) to ``model`` as ``mask_name``; restores exactly the
        saved hard masks. Add more masks with :meth:`load_mask`.

        With saved logits those are restored too (to resume or transfer); otherwise logits are
        initialised from the hard mask with the prior rule. ``is_trainable=False`` freezes the logits,
        puts the model in eval mode, and holds the mask packed whenever another one is active.
        """
        folder = resolve_mask_folder(name_or_path, revision, subfolder)
        config = read_config(folder)
        load_config = MaskConfig.from_dict({**config.to_dict(), "prior": None})
        try:
            targets = find_targets(
                model, config.target_modules, config.exclude_modules, config.m, strict=False
            )
        except TargetError as e:
            raise MaskFileError(
                f"mask folder {folder}: its target_modules / exclude_modules select no layer of this "
                f"{type(model).__name__} ({e}) The mask belongs to another model; load it into the model it was "
                "learned on."
            ) from None
        shapes = {name: tuple(dense_weight_view(model.get_submodule(name)).shape) for name in targets}
        saved = read_saved_mask(folder, config, shapes)
        mask_model = cls(model, load_config, targets, mask_name=mask_name)
        mask_model.mask_config.prior = config.prior
        mask_model.training_summary = saved.summary
        layers = mask_model.masked_layers()
        logits = logits_from_saved(saved, {name: layer.mask_logits for name, layer in layers.items()})
        with torch.no_grad():
            for name, layer in layers.items():
                layer.mask_logits.copy_(logits[name])
        mask = mask_model._masks[mask_name]
        mask.trainable, mask.keep_logits = is_trainable, keep_logits
        if not is_trainable:
            mask.packed = saved.packed
            for layer in layers.values():
                layer.mask_logits.requires_grad_(False)
            mask_model.eval()
        return mask_model

    # ------------------------------------------------------------------ merge
    def _check_not_merged(self) -> None:
        if self._merged:
            raise MaskLLMError(
                "merge_and_unload() was already called: the masks are merged into the returned model and this "
                "MaskModel is empty. Use the model merge_and_unload() returned."
            )

    def merge_and_unload(self, keep_mask: bool = False) -> nn.Module:
        """Write ``W * hard_mask`` of the active mask into every masked layer and return the plain model.

        Every hard mask is verified to keep at most ``n`` of each ``m`` inputs before any weight is
        written. The other masks are dropped with the wrappers. The plain layers hold zeros but not the
        mask: a later weight update (training, a LoRA merge) makes them dense again.
        ``keep_mask=True`` returns compressed, trainable ``SparseLinear`` layers instead, which stay
        exactly N:M through training, PEFT LoRA and saving (``hf_maskllm.sparse.to_sparse_layers``).
        """
        cfg = self.mask_config
        names = list(self.masked_names)
        merge_layers(self.base_model, self.masked_layers(), cfg.n, cfg.m)
        self._merged = True
        if keep_mask:
            from ..sparse.convert import to_sparse_layers

            return to_sparse_layers(self.base_model, cfg.n, cfg.m, modules=names)
        return self.base_model
