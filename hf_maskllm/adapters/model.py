"""``MaskModel``: a transformers model with named N:M masks over its linear layers (PEFT's multi-adapter API).

The wrapper holds the transformers model as ``base_model``, swaps each targeted layer for a
:class:`MaskedLinear` in place (``wrapping.py``) and forwards every other attribute. The masked layers
own the tensors of every named mask; the model owns what is per mask (``named_masks.py``) and the
training schedule every layer reads (``schedule.py``). Priors: ``prior_init.py``; saving and loading:
``save_and_load.py``; merging: ``merge.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, MaskLLMError
from .card import merged_card_fields
from .config import MaskConfig
from .layer import MaskedLinear, collect_regulariser
from .mask_source import open_mask_source, source_targets
from .merge import merge_layers, merged_view
from .named_masks import NamedMasksMixin
from .objective import (
    IGNORE_INDEX,
    LOSS_ARGUMENTS,
    apply_objective,
    check_causal_lm,
    fused_lm_loss,
    fuses_logit_kl,
    predicted_positions,
    teacher_pass,
)
from .prior_init import apply_prior_rule
from .save_and_load import DEFAULT_MASK_NAME, check_mask_name, save_masks
from .schedule import MaskSchedule
from .targets import check_full_precision, find_targets
from .wrapping import wrap_layers

__all__ = ["MaskModel"]


class _ForwardWithBaseSignature:
    """``MaskModel.forward``, bound, with the signature of the base model's ``forward``: the Trainer keeps
    only the dataset columns that the model's forward names (``Trainer._remove_unused_columns``)."""

    def __get__(self, instance: MaskModel | None, owner: type) -> Callable[..., Any]:
        if instance is None:
            return owner._forward
        bound = functools.partial(owner._forward, instance)
        bound.__signature__ = instance._forward_signature()
        bound.__doc__ = owner._forward.__doc__
        return bound


class MaskModel(NamedMasksMixin, nn.Module):
    """A transformers model whose targeted linears carry learnable N:M masks, one or more, by name.

    The first mask is named ``"default"`` (``mask_name`` changes it) and starts from ``config.prior``
    (``calibration_data`` / ``tokenizer`` for the data-driven ones, as in
    :func:`~hf_maskllm.get_mask_model`). ``state_dict()`` holds the masks (logits and packed hard masks),
    not the frozen weights of the base model, so Trainer checkpoints stay small and resume exactly.
    """

    def __init__(
        self,
        model: nn.Module,
        config: MaskConfig,
        targets: list[str] | None = None,
        mask_name: str = DEFAULT_MASK_NAME,
        calibration_data: Any = None,
        tokenizer: Any = None,
    ) -> None:
        check_mask_name(mask_name)
        with self._wrapping(model, config, targets):
            self.add_mask(mask_name, config, calibration_data, tokenizer)
            self.set_mask(mask_name)

    @contextlib.contextmanager
    def _wrapping(self, model: nn.Module, config: MaskConfig, targets: list[str] | None) -> Iterator[None]:
        """:meth:`_wrap`; when the first mask then fails to build, ``model`` gets its own layers and its
        parameters' ``requires_grad`` back before the error propagates."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        self._wrap(model, config, targets)
        try:
            yield
        except BaseException:
            for name in self.masked_names:
                model.set_submodule(name, model.get_submodule(name).base_layer)
            for p in trainable:
                p.requires_grad_(True)
            raise

    def _wrap(self, model: nn.Module, config: MaskConfig, targets: list[str] | None) -> None:
        """Wrap the targeted layers of ``model`` (frozen) in mask-less :class:`MaskedLinear` layers."""
        nn.Module.__init__(self)
        if isinstance(model, MaskModel) or any(isinstance(mod, MaskedLinear) for mod in model.modules()):
            raise MaskLLMError(
                "This model already carries mask adapters; pass the plain transformers model, or add another mask "
                "to its MaskModel with add_mask / load_mask."
            )
        if not isinstance(config, MaskConfig):
            raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
        config.validate()
        self.base_model = model
        self.schedule = MaskSchedule()
        self.last_losses: dict[str, torch.Tensor] = {}
        self._merged = False
        self._warned_unscheduled = False
        self._warned_dropout = False
        self._init_named_masks()
        names = (
            targets
            if targets is not None
            else find_targets(model, config.target_modules, config.exclude_modules, config.m, config.strict)
        )
        check_full_precision(model, names)
        for p in model.parameters():
            p.requires_grad_(False)
        wrap_layers(model, names, config.n, config.m, self.schedule)
        self.masked_names = list(names)

    # ------------------------------------------------------------------ plumbing
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_model", "_modules", "_parameters", "_buffers", "_mask_info"):
                raise
            return getattr(self._modules["base_model"], name)

    def _forward_signature(self) -> inspect.Signature:
        signature = self.__dict__.get("_signature")
        if signature is None:
            signature = self.__dict__["_signature"] = inspect.signature(self.base_model.forward)
        return signature

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the base model with the active mask; in training the sparse weight regulariser and the
        distillation terms join the gradient of ``loss`` while its value stays the language-model loss (their
        values are ``outputs.sparse_reg_loss`` / ``outputs.<term>_loss``, and :attr:`last_losses`). Nothing
        in the model changes during the call: the unmasked pass bypasses the masks by a flag the layers
        read, and the loss is computed here, not by a replaced ``loss_function``."""
        schedule = self.schedule
        track = self.training and schedule.regularising
        if self.training and not schedule.driven and not self._warned_unscheduled and torch.is_grad_enabled():
            if any(layer.mask_logits.requires_grad for layer in self.masked_layers().values()):
                self._warned_unscheduled = True
                warnings.warn(
                    "The masks are training without MaskAnnealCallback: tau stays at its start value "
                    f"({schedule.tau}), kappa at {schedule.kappa}, there is no sparse weight regulariser and no "
                    "mask statistics. Add callbacks=[MaskAnnealCallback()] to the Trainer (hf_maskllm.learn.learn_mask "
                    "does), or call set_schedule_progress(step / max_steps) in a custom training loop.",
                    stacklevel=2,
                )
        config = self.mask_config
        objective = (
            self.training
            and torch.is_grad_enabled()
            and (config.lm_weight != 1.0 or config.distills)
            and self.mask_info().trainable  # a frozen mask under fine-tuning: the caller's loss, untouched
        )
        if not track and not objective:
            return self.base_model(*args, **kwargs)
        scaled_for_accumulation = kwargs.get("num_items_in_batch") is not None
        teacher = None
        if objective:
            check_causal_lm(self.base_model)
            if kwargs.get("labels") is None:
                raise ConfigError(
                    "This mask trains on an objective other than the language-model loss alone (lm_weight, "
                    "distill_logits, distill_hidden; for a causal LM the default distils the unmasked model), "
                    "which needs `labels` in the batch. Pass labels (a causal LM collator does), or, to train on "
                    "a loss of your own, MaskConfig(distill_logits=0.0)."
                )
            if config.distill_hidden > 0:
                kwargs = {**kwargs, "output_hidden_states": True}
            if config.distills:
                self._warn_if_dropout()
                teacher = teacher_pass(
                    self.base_model, self.disable_masks(), args, kwargs, bf16=schedule.teacher_bf16
                )
        # with the logit KL in the language-model loss's pass over the logits where the model's loss allows:
        # the model runs without the loss arguments and the loss is computed here from its logits
        fuse = objective and fuses_logit_kl(self.base_model, teacher, config)
        forward_kwargs = {k: v for k, v in kwargs.items() if k not in LOSS_ARGUMENTS} if fuse else kwargs
        with collect_regulariser() as regs:
            outputs = self.base_model(*args, **forward_kwargs)
        fused = None
        if fuse:
            outputs, fused = fused_lm_loss(outputs, teacher, config, kwargs)
        losses: dict[str, torch.Tensor] = {}
        if objective and getattr(outputs, "loss", None) is not None:
            valid = predicted_positions(
                kwargs["labels"], kwargs.get("shift_labels"), kwargs.get("ignore_index", IGNORE_INDEX)
            )  # the positions the language-model loss counts
            terms = apply_objective(config, outputs, teacher, valid, kwargs.get("num_items_in_batch"), fused)
            losses.update((f"{name}_loss", value) for name, value in terms.items())
        if not track:
            self.last_losses = losses  # logged by MaskAnnealCallback
            return outputs
        if regs and getattr(outputs, "loss", None) is not None:
            trainable = any(layer.mask_logits.requires_grad for layer in self.masked_layers().values())
            if torch.is_grad_enabled() and trainable and any(not r.requires_grad for r in regs):
                warnings.warn(
                    "The sparse weight regulariser gets no gradient in some masked layers: they ran without "
                    "autograd (reentrant activation checkpointing?). Use non-reentrant checkpointing "
                    "(activation_checkpointing_kwargs={'use_reentrant': False}, gradient_checkpointing_kwargs in "
                    "older transformers; the default) or MaskConfig(sparse_reg=0).",
                    stacklevel=2,
                )
            # -lambda * (1 - t/T) * sum ||W * mask||^2 (the paper's sparse weight regulariser). When the Trainer
            # normalises the loss over the accumulated batch (num_items_in_batch) it no longer divides by the
            # accumulation steps (and multiplies by the process count): the schedule's divisor undoes both.
            divisor = schedule.reg_divisor if scaled_for_accumulation else 1
            total = sum(r.to(outputs.loss.device) for r in regs)  # layers may sit on several devices
            # the weight as a tensor (compiled code reads its current value); in the regulariser's dtype, as a
            # Python float would be
            term = -schedule.tensor("sparse_reg_weight").to(total.dtype) * total
            # term - term.detach() is zero in value and carries the term's gradient: the logged loss is
            # the language-model loss, the logits' gradient includes the regulariser.
            outputs.loss = outputs.loss + (term - term.detach()).to(outputs.loss.dtype) / divisor
            outputs["sparse_reg_loss"] = term.detach()
            losses = {"sparse_reg_loss": outputs["sparse_reg_loss"], **losses}
        self.last_losses = losses  # logged by MaskAnnealCallback
        return outputs

    forward = _ForwardWithBaseSignature()

    def _warn_if_dropout(self) -> None:
        """Once: the unmasked pass runs in the model's mode (nothing is switched during a step), so dropout
        that is on in training reaches the distillation target too."""
        if self._warned_dropout:
            return
        self._warned_dropout = True
        active = sorted(
            {
                type(m).__name__
                for m in self.base_model.modules()
                if isinstance(m, nn.Dropout) and m.p > 0 and m.training
            }
        )
        if active:
            warnings.warn(
                f"The model has dropout ({', '.join(active)} with p > 0) and distils its unmasked pass, which runs "
                "in the model's training mode: the distillation target gets dropout too. For a deterministic "
                "target, set every dropout probability to 0 before training (for m in model.modules(): "
                "if isinstance(m, torch.nn.Dropout): m.p = 0.0), or MaskConfig(distill_logits=0.0) for the "
                "language-model loss alone.",
                stacklevel=3,
            )

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

    def set_schedule_progress(self, progress: float) -> None:
        """Set tau, kappa and the regulariser's weight to the active mask's schedule at ``progress``
        (``step / max_steps``; ``MaskAnnealCallback`` does it every step, a custom training loop calls it
        itself; :func:`~hf_maskllm.adapters.schedule.annealed_values`)."""
        self.schedule.set_progress(self.mask_config, progress)

    def set_schedule_values(self, tau: float, kappa: float, sparse_reg_weight: float | None = None) -> None:
        """Set the Gumbel temperature, the logit scale and (optionally) the regulariser's current weight
        to values of your own (:meth:`set_schedule_progress` sets those of the config's schedule)."""
        values: dict[str, Any] = {"tau": float(tau), "kappa": float(kappa), "driven": True}
        if sparse_reg_weight is not None:
            values["sparse_reg_weight"] = float(sparse_reg_weight)
        self.schedule.update(**values)

    def set_compiled_sampling(self, enabled: bool) -> bool:
        """Run this model's fused mask sampling through ``torch.compile``; returns the previous setting.

        Per model (two models in one process keep their own setting). ``MaskAnnealCallback`` turns it
        on for a training run when a compiler is present and restores it at the end.
        """
        previous = self.schedule.compiled_sampling
        self.schedule.update(compiled_sampling=bool(enabled))
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
        previous = self.schedule.recompute_sampling
        self.schedule.update(recompute_sampling=None if recompute is None else bool(recompute))
        return previous

    def set_teacher_bf16(self, enabled: bool | None) -> bool | None:
        """Whether the unmasked model's pass, which the distillation objective compares with, runs under
        bfloat16 autocast; returns the previous setting.

        ``None`` (the default): when the model computes in float32, no autocast is active and the device
        multiplies bfloat16 natively (CUDA; CPUs with AVX512-BF16 or AMX), where the pass takes about half
        the time and the masks learn as well (docs/training.md has the measurements). ``True`` asks for it
        anywhere; ``False`` runs the pass as the model computes. Under an active autocast the pass always
        follows that autocast.
        """
        previous = self.schedule.teacher_bf16
        self.schedule.update(teacher_bf16=None if enabled is None else bool(enabled))
        return previous

    @contextlib.contextmanager
    def disable_masks(self) -> Iterator[None]:
        """Context in which the model runs dense: every masked layer runs its base layer alone.

        A flag the layers read in ``forward`` (the schedule's ``masks_disabled``, as PEFT's
        ``disable_adapters``): no module is swapped or changes mode, so hooks, ``torch.compile``, DDP and
        FSDP see the same model with and without masks."""
        self._check_not_merged()
        previous = self.schedule.masks_disabled
        self.schedule.update(masks_disabled=True)
        try:
            yield
        finally:
            self.schedule.update(masks_disabled=previous)

    # ------------------------------------------------------------------ state
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The masks' tensors (every mask's logits, packed hard masks), row-major; not the frozen weights of
        the base model (a Trainer checkpoint then holds what training changes). The layers may store the
        active logits candidate-major; safetensors writes contiguous tensors only."""
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
        owned = tuple(
            f"{prefix}base_model.{name}.{part}."
            for name in self.masked_names
            for part in ("logits", "packed_masks")
        )
        for key in [k for k in full if k.startswith(prefix)]:
            if not key.startswith(owned):
                del full[key]
            elif not keep_vars:
                full[key] = full[key].contiguous()
        return full

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable, all)`` parameter counts, like PEFT."""
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
            f" || active mask: {self.active_mask!r} of {len(self.list_masks())}"
        )

    # ------------------------------------------------------------------ prior
    @torch.no_grad()
    def apply_prior(
        self, masks: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]], strength: float | None = None
    ) -> None:
        """Apply the prior rule to the active mask's logits for N:M masks (``[out, in]`` bool per layer name).

        ``logits += alpha * std(logits) * (overlap(candidate, mask) - n/2)`` (the paper's prior rule); the
        hard mask then equals the prior exactly (``prior_init.prior_logits``). A list of such dicts is a
        combined prior: the terms add, and where the masks disagree learning decides.
        """
        cfg = self.mask_config
        alpha = cfg.prior_strength if strength is None else float(strength)
        layers = self.masked_layers()
        shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
        current = {name: layer.mask_logits for name, layer in layers.items()}
        logits = apply_prior_rule(current, masks, shapes, cfg.n, cfg.m, alpha, cfg.init_std)
        for name, layer in layers.items():
            layer.mask_logits.copy_(logits[name])

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
        format: str = "hf_maskllm",
        **kwargs: Any,
    ) -> None:
        """Save every mask (or ``selected_masks``): config, packed hard masks, optional logits, model card.

        The mask named ``"default"`` goes into ``save_directory`` itself, every other one into
        ``save_directory/<mask name>`` (PEFT's layout). ``merged=True`` instead writes the sparse model
        with the active mask as a compressed N:M checkpoint (``dense=True``: a plain transformers
        checkpoint with zeros) that ``from_pretrained`` loads; ``values="int8"`` / ``"int4"``,
        ``group_size`` and ``calibration_data`` (passed on to ``hf_maskllm.sparse.save_compressed``) store
        its kept values quantized. ``state_dict``: the active mask's logits
        keyed as ``state_dict()`` keys them, used instead of the layers' own; under FSDP, where each
        process holds a shard of them, the full state dict that ``accelerator.get_state_dict(model)``
        gathers on every process (the main process then saves). ``format="npz"`` writes each mask as the
        MaskLLM reference implementation's ``mask_compressed.npz`` (hard masks only; its evaluation script
        applies it, and :meth:`from_pretrained` reads it back).
        """
        if merged:
            if state_dict is not None or selected_masks is not None or format != "hf_maskllm":
                raise ConfigError(
                    "state_dict, selected_masks and format apply to mask saves only; a merged checkpoint holds the active "
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
                    model_card=merged_card_fields(self.mask_config, self.training_summary, self.active_mask),
                    **kwargs,
                )
            return
        if kwargs:
            raise ConfigError(f"Unexpected arguments for a mask save: {sorted(kwargs)}.")
        self._check_not_merged()
        save_masks(self, save_directory, selected_masks, save_logits, state_dict, format)

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
        config: MaskConfig | None = None,
    ) -> MaskModel:
        """Attach a saved mask (folder or Hub repo id) to ``model`` as ``mask_name``; restores exactly the
        saved hard masks. Add more masks with :meth:`load_mask`.

        The wrapped layers of the saved config, then :meth:`load_mask` and :meth:`set_mask`. With saved
        logits those are restored too (to resume or transfer); otherwise logits are initialised from the
        hard mask with the prior rule. ``is_trainable=False`` freezes the logits, puts the model in eval
        mode, and holds the mask packed whenever another one is active.

        ``name_or_path`` may also be the MaskLLM reference implementation's ``mask_compressed.npz`` or
        PATCH's ``mask.npz`` (the file, a folder or a Hub repo holding it), which carry no config:
        ``config`` (default ``MaskConfig()``; for ``mask.npz``, the N:M its ``__meta__`` names) says its N:M
        and which layers it must cover (``exclude_modules``: the layers to leave dense; layers a
        ``mask.npz`` does not mask stay dense, with a warning naming them).
        """
        check_mask_name(mask_name)
        found = open_mask_source(
            name_or_path,
            revision,
            subfolder,
            config,
            getattr(getattr(model, "config", None), "_name_or_path", None),
        )
        config = found.config
        targets = source_targets(model, found)
        mask_model = cls.__new__(cls)
        with mask_model._wrapping(model, config, targets):
            mask_model._check_not_a_named_subfolder(name_or_path, mask_name, subfolder)
            mask_model._load_mask(found, mask_name, is_trainable, None, None, keep_logits, True)
            mask_model.set_mask(mask_name)
        if not is_trainable:
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
