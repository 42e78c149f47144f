"""``MaskModel``: inject mask adapters, save / load / push, merge.

Layout follows PEFT: the wrapper holds the transformers model as ``base_model``, swaps each
targeted layer for a :class:`MaskedLinear` in place, and forwards every other attribute.
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
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, MaskFileError, MaskLLMError, NMViolationError, TargetError
from ..modules import dense_weight_view, is_conv1d
from ..patterns import candidate_patterns, mask_to_indices
from ..serialization import atomic_folder, atomic_write, resolve_folder
from .card import mask_model_card
from .config import CONFIG_NAME, MaskConfig
from .layer import MaskedLinear
from .mask_file import (
    LOGITS_NAME,
    MASKS_NAME,
    load_mask_config,
    read_logits,
    read_masks,
    write_logits,
    write_masks,
)
from .packing import bits_per_weight
from .targets import find_targets

__all__ = ["MaskModel"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _split_name(name: str) -> tuple[str, str]:
    parent, _, child = name.rpartition(".")
    return parent, child


class MaskModel(nn.Module):
    """A transformers model whose targeted linears carry learnable N:M masks.

    Only ``mask_logits`` are trainable. ``state_dict()`` holds just those logits (the frozen
    weights belong to the base model), so Trainer checkpoints stay small and resume exactly.
    """

    def __init__(self, model: nn.Module, config: MaskConfig, targets: list[str] | None = None) -> None:
        super().__init__()
        if isinstance(model, MaskModel) or any(isinstance(mod, MaskedLinear) for mod in model.modules()):
            raise MaskLLMError("This model already carries mask adapters; pass the plain transformers model.")
        config.validate()
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = (
                getattr(getattr(model, "config", None), "_name_or_path", None) or None
            )
        self.base_model = model
        self.mask_config = config
        self.training_summary: dict[str, Any] = {}
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
        generator = torch.Generator().manual_seed(config.seed)
        dtype = _DTYPES[config.logits_dtype]
        candidates = config.num_candidates
        for name in names:
            parent_name, child_name = _split_name(name)
            parent = model.get_submodule(parent_name)
            base = getattr(parent, child_name)
            out_f, in_f = dense_weight_view(base).shape
            logits = torch.randn(out_f * in_f // config.m, candidates, generator=generator) * config.init_std
            setattr(parent, child_name, MaskedLinear(base, config.n, config.m, logits.to(dtype)))
        self.masked_names = list(names)
        self.set_schedule_values(config.tau[0], config.kappa[0])
        # Trainer keeps only dataset columns named in forward's signature: show the base model's.
        self._install_forward_signature()

    # ------------------------------------------------------------------ plumbing
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_model", "_modules", "_parameters", "_buffers"):
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
        """Run the base model; in training add the sparse weight regulariser to ``loss``."""
        track = self.training and self.sparse_reg_weight > 0
        layers = list(self.masked_layers().values())
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
                    "(activation_checkpointing_kwargs={'use_reentrant': False}, transformers' default) or "
                    "MaskConfig(sparse_reg=0).",
                    stacklevel=2,
                )
            if regs:
                # -lambda * (1 - t/T) * sum ||W * mask||^2 (REFERENCE section 1). When the Trainer normalises the
                # loss over the accumulated batch (num_items_in_batch) it no longer divides by the
                # accumulation steps (and multiplies by the process count), so the callback sets the divisor.
                divisor = self.grad_accum_steps if scaled_for_accumulation else 1
                total = sum(r.to(outputs.loss.device) for r in regs)  # layers may sit on several devices
                term = -self.sparse_reg_weight * total
                self.last_sparse_reg_term = term.detach()  # logged by MaskAnnealCallback as sparse_reg_loss
                outputs.loss = outputs.loss + term.to(outputs.loss.dtype) / divisor
            for layer in layers:
                layer.last_sparse_reg = None
        return outputs

    forward = _forward

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``base_model.generate`` with the current masks (hard masks in eval mode)."""
        return self.base_model.generate(*args, **kwargs)

    def get_base_model(self) -> nn.Module:
        """The wrapped transformers model (with MaskedLinear layers inside)."""
        return self.base_model

    def masked_layers(self) -> dict[str, MaskedLinear]:
        """``{name in the base model: MaskedLinear}`` for every masked layer."""
        self._check_not_merged()
        return {name: self.base_model.get_submodule(name) for name in self.masked_names}

    def set_schedule_values(self, tau: float, kappa: float) -> None:
        """Set the Gumbel temperature and logit scale of every masked layer."""
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
        """Only the trainable mask logits (what a Trainer checkpoint needs to resume)."""
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key in [k for k in full if k.startswith(prefix) and not k.endswith(".mask_logits")]:
            del full[key]
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
        )

    @torch.no_grad()
    def hard_masks(self) -> dict[str, torch.Tensor]:
        """The exact N:M bool mask ``[out, in]`` of every masked layer."""
        return {name: layer.hard_mask().clone() for name, layer in self.masked_layers().items()}

    @torch.no_grad()
    def hard_indices(self) -> dict[str, torch.Tensor]:
        """Candidate index (argmax) of every group of every masked layer."""
        return {name: layer.mask_logits.argmax(dim=-1) for name, layer in self.masked_layers().items()}

    # ------------------------------------------------------------------ prior
    @torch.no_grad()
    def apply_prior(self, masks: dict[str, torch.Tensor], strength: float | None = None) -> None:
        """Initialise logits from N:M masks (``[out, in]`` bool per layer name).

        ``logits += alpha * std(logits) * (overlap(candidate, mask) - n/2)`` (REFERENCE section 1).
        The prior's candidate then leads every group; where the random init noise would still beat
        it (a few percent of groups at alpha = 3), its logit is raised just above the group's maximum,
        so the initial hard mask equals the prior exactly.
        """
        cfg = self.mask_config
        alpha = cfg.prior_strength if strength is None else float(strength)
        layers = self.masked_layers()
        unknown = sorted(set(masks) - set(layers))
        missing = sorted(set(layers) - set(masks))
        if unknown or missing:
            raise MaskFileError(
                f"Prior masks do not match the masked layers: missing {missing[:3]}, unknown {unknown[:3]}. "
                "A prior must cover exactly the layers selected by target_modules."
            )
        for name, layer in layers.items():
            mask = masks[name].to(layer.mask_logits.device)
            if tuple(mask.shape) != (layer.out_features, layer.in_features):
                raise MaskFileError(
                    f"Prior mask for {name} has shape {tuple(mask.shape)}, the layer is "
                    f"{(layer.out_features, layer.in_features)} ([out, in])."
                )
            prior_idx = mask_to_indices(mask.bool(), cfg.n, cfg.m)  # validates exact N:M
            logits = layer.mask_logits.float()
            cand = candidate_patterns(cfg.n, cfg.m, device=logits.device)
            overlap = mask.reshape(-1, cfg.m).float() @ cand.t()  # [G, C]
            std = logits.std() if logits.numel() > 1 else logits.new_tensor(cfg.init_std)
            logits += alpha * std * (overlap - cfg.n / 2)
            lead = logits.gather(1, prior_idx[:, None]).squeeze(1)
            best = logits.max(dim=1).values
            losers = logits.argmax(dim=1) != prior_idx
            margin = max(float(std) * 1e-3, 1e-6)
            logits[losers, prior_idx[losers]] = torch.maximum(lead[losers], best[losers]) + margin
            logits = logits.to(layer.mask_logits.dtype)
            # Rounding to bf16 / fp16 can tie or reorder close logits: lift those prior logits to the next
            # representable value above their group's maximum.
            losers = logits.argmax(dim=1) != prior_idx
            if bool(losers.any()):
                best = logits[losers].max(dim=1).values
                logits[losers, prior_idx[losers]] = torch.nextafter(best, torch.full_like(best, float("inf")))
            layer.mask_logits.copy_(logits)

    # ------------------------------------------------------------------ save / load / share
    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        save_logits: bool = False,
        merged: bool = False,
        dense: bool = False,
        tokenizer: Any = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        """Save the mask (config, packed hard masks, optional logits, model card) to a folder.

        ``merged=True`` instead writes the sparse model itself as a compressed N:M checkpoint
        (``dense=True``: a plain transformers checkpoint with zeros) that ``from_pretrained`` loads.
        ``state_dict``: save these logits (keyed as ``state_dict()`` keys them) instead of the layers' own;
        under FSDP, where each process holds a shard of them, the full state dict that
        ``accelerator.get_state_dict(model)`` gathers on every process (the main process then saves).
        """
        if merged:
            if state_dict is not None:
                raise ConfigError(
                    "state_dict applies to mask saves only; for a merged checkpoint, load the saved mask into an "
                    "unsharded model (MaskModel.from_pretrained) and save that."
                )
            from ..sparse.checkpoint import save_compressed

            with self._merged_view() as model:
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
        layers = self.masked_layers()
        shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
        if state_dict is None:
            logits = {name: layer.mask_logits.detach() for name, layer in layers.items()}
            self._refuse_sharded(logits)
        else:
            logits = self._logits_from_state_dict(state_dict)
        for name, tensor in logits.items():
            if not bool(torch.isfinite(tensor).all()):
                raise MaskLLMError(
                    f"Logits of {name} contain NaN or inf (training diverged); refusing to save a corrupt mask. "
                    "Resume from an earlier checkpoint with a lower learning rate."
                )
        if state_dict is None:
            indices = {name: idx.cpu() for name, idx in self.hard_indices().items()}
        else:
            indices = {name: tensor.argmax(dim=-1) for name, tensor in logits.items()}
        # The whole folder is built beside the target and swapped in at once: a crash leaves the previous
        # save intact, and stale logits of an earlier save never sit beside the new masks.
        with atomic_folder(save_directory, drop=lambda name: name == LOGITS_NAME, last=CONFIG_NAME) as folder:
            # write_masks verifies the N:M invariant (one candidate index in [0, C) per group) first.
            write_masks(
                folder / MASKS_NAME,
                indices,
                shapes,
                self.mask_config.n,
                self.mask_config.m,
                self.training_summary,
            )
            if save_logits:
                write_logits(folder / LOGITS_NAME, {name: tensor.cpu() for name, tensor in logits.items()})
            self.mask_config.save_pretrained(folder)
            with atomic_write(folder / "README.md", "w") as f:
                f.write(mask_model_card(**self._card_fields()))

    @staticmethod
    def _refuse_sharded(logits: dict[str, torch.Tensor]) -> None:
        if any(isinstance(tensor, DTensor) for tensor in logits.values()):
            raise MaskLLMError(
                "The mask logits are sharded across processes (FSDP): gather them on every process with "
                "`state_dict = trainer.accelerator.get_state_dict(trainer.model)`, then save on the main process "
                "with `mask_model.save_pretrained(folder, state_dict=state_dict)`."
            )

    def _logits_from_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every masked layer's full logits (CPU) out of a state dict keyed like ``state_dict()``."""
        logits = {}
        for name, layer in self.masked_layers().items():
            key = f"base_model.{name}.mask_logits"
            tensor = state_dict.get(key)
            if tensor is None:
                raise ConfigError(
                    f"state_dict lacks {key}: pass the full state dict of this MaskModel (on the main process, "
                    "what accelerator.get_state_dict(model) returns under FSDP)."
                )
            self._refuse_sharded({name: tensor})
            if tuple(tensor.shape) != tuple(layer.mask_logits.shape):
                raise ConfigError(
                    f"state_dict[{key!r}] has shape {tuple(tensor.shape)}, the layer's logits "
                    f"{tuple(layer.mask_logits.shape)}: pass the full (gathered) state dict, not one shard."
                )
            logits[name] = tensor.detach().cpu()
        return logits

    def _card_fields(self) -> dict[str, Any]:
        cfg = self.mask_config
        layers = self.masked_layers()
        return {
            "base_model": cfg.base_model_name_or_path,
            "n": cfg.n,
            "m": cfg.m,
            "num_layers": len(layers),
            "num_weights": sum(layer.in_features * layer.out_features for layer in layers.values()),
            "bits_per_weight": bits_per_weight(cfg.n, cfg.m),
            "targets": cfg.target_modules,
            "prior": cfg.prior,
            "summary": dict(self.training_summary),
        }

    def _merged_card_fields(self) -> dict[str, Any]:
        cfg = self.mask_config
        fields: dict[str, Any] = {}
        if cfg.base_model_name_or_path:
            fields["base_model"] = cfg.base_model_name_or_path
        fields["how the mask was learned"] = (
            f"MaskLLM (hf_maskllm): learnable {cfg.n}:{cfg.m} masks sampled with Gumbel softmax, weights frozen; "
            f"prior: {cfg.prior or 'none'}"
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
        """Save to a temporary folder and upload it to the Hub repo ``repo_id``; returns the commit URL.

        The save (and its N:M verification) completes before the repo is created; the upload is one commit.
        """
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
    ) -> MaskModel:
        """Attach a saved mask (folder or Hub repo id) to ``model``; restores exactly the saved hard masks.

        With saved logits those are restored too (to resume or transfer); otherwise logits are
        initialised from the hard mask with the prior rule. ``is_trainable=False`` freezes the
        logits and puts the model in eval mode.
        """
        folder = resolve_folder(
            name_or_path,
            [CONFIG_NAME, MASKS_NAME],
            [LOGITS_NAME, "README.md"],
            MaskFileError,
            "mask folder",
            revision,
        )
        config = load_mask_config(folder)
        if not -(2**63) <= config.seed < 2**64:  # torch.Generator.manual_seed's range
            raise MaskFileError(
                f"{folder / CONFIG_NAME}: seed={config.seed} is outside [-2**63, 2**64); the file is corrupt. "
                "Fix the field or save the mask again."
            )
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
        indices, summary = read_masks(folder / MASKS_NAME, shapes, config.n, config.m)
        mask_model = cls(model, load_config, targets)
        mask_model.mask_config.prior = config.prior
        mask_model.training_summary = summary
        if (folder / LOGITS_NAME).is_file():
            groups_c = {name: (s[0] * s[1] // config.m, config.num_candidates) for name, s in shapes.items()}
            logits = read_logits(folder / LOGITS_NAME, groups_c)
            with torch.no_grad():
                for name, layer in mask_model.masked_layers().items():
                    layer.mask_logits.copy_(logits[name].to(layer.mask_logits.dtype))
            restored = mask_model.hard_indices()
            if any(not torch.equal(restored[k].cpu(), indices[k]) for k in indices):
                raise MaskFileError(
                    f"{folder}: the saved logits disagree with the saved hard masks; the folder is corrupt. Save the "
                    f"mask again, or delete {LOGITS_NAME} to load the hard masks alone."
                )
        else:
            cand = candidate_patterns(config.n, config.m, dtype=torch.bool)
            masks = {name: cand[idx].reshape(shapes[name]) for name, idx in indices.items()}
            mask_model.apply_prior(masks, strength=max(config.prior_strength, 1.0))
            # Verify after reading: the model now holds exactly the saved (N:M) hard masks.
            restored = mask_model.hard_indices()
            layers = mask_model.masked_layers()
            if any(
                not bool(torch.isfinite(layers[k].mask_logits).all())
                or not torch.equal(restored[k].cpu(), indices[k])
                for k in indices
            ):
                raise MaskFileError(
                    f"{folder / CONFIG_NAME}: rebuilding logits from the saved hard masks with init_std="
                    f"{config.init_std}, prior_strength={config.prior_strength}, logits_dtype={config.logits_dtype} "
                    "overflows; the config is corrupt. Fix these fields or save the mask again."
                )
        if not is_trainable:
            for layer in mask_model.masked_layers().values():
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

    @contextlib.contextmanager
    def _merged_view(self) -> Iterator[nn.Module]:
        """Temporarily put plain layers with ``W * hard_mask`` in place of the masked layers."""
        layers = self.masked_layers()
        originals = {}
        try:
            for name, layer in layers.items():
                parent_name, child_name = _split_name(name)
                base = layer.base_layer
                originals[name] = base.weight.data
                masked = dense_weight_view(base) * layer.hard_mask().to(base.weight.dtype)  # [out, in]
                base.weight.data = masked.t().contiguous() if is_conv1d(base) else masked
                setattr(self.base_model.get_submodule(parent_name), child_name, base)
            yield self.base_model
        finally:
            for name, layer in layers.items():
                parent_name, child_name = _split_name(name)
                if name in originals:
                    layer.base_layer.weight.data = originals[name]
                setattr(self.base_model.get_submodule(parent_name), child_name, layer)

    def merge_and_unload(self) -> nn.Module:
        """Write ``W * hard_mask`` into every masked layer and return the plain transformers model.

        Every hard mask is verified to keep at most ``n`` of each ``m`` inputs before any weight is written.
        """
        layers = self.masked_layers()
        n, m = self.mask_config.n, self.mask_config.m
        for name, layer in layers.items():
            kept = layer.hard_mask().reshape(-1, m).sum(dim=1)
            if bool((kept > n).any()):
                raise NMViolationError(
                    f"The hard mask of {name} keeps more than {n} of {m} weights in {int((kept > n).sum())} groups; "
                    "refusing to merge a mask that is not N:M. Its logits are corrupt: reload the mask."
                )
        for name, layer in layers.items():
            parent_name, child_name = _split_name(name)
            setattr(self.base_model.get_submodule(parent_name), child_name, layer.merge())
        self._merged = True
        return self.base_model
