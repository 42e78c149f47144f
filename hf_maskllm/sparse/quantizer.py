"""Teach ``from_pretrained`` the ``hf_maskllm_nm`` checkpoints (registered on ``import hf_maskllm.sparse``).

Loading: the quantizer swaps every listed module for a :class:`SparseLinear` on the meta device
before weights are read, transformers fills their ``values`` / ``meta`` buffers straight from
the safetensors files (no dense copy), then every module is validated.

Without hf_maskllm: ``config.json`` carries ``transformers_weights`` set to :data:`LOAD_MARKER`,
which plain transformers rejects with a ``ValueError`` that quotes it ("... import hf_maskllm
..."). This quantizer removes the marker before transformers resolves the weight files.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils import logging
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import CheckpointError
from ..modules import dense_weight_view, is_conv1d
from ..patterns import check_nm_args
from .format import FORMAT_VERSION, validate
from .linear import SparseLinear

__all__ = ["LOAD_MARKER", "QUANT_METHOD", "NMSparseConfig", "NMSparseHfQuantizer"]

logger = logging.get_logger(__name__)

QUANT_METHOD = "hf_maskllm_nm"
LOAD_MARKER = (
    "hf_maskllm-nm-compressed: this checkpoint stores N:M-compressed weights. "
    "Run `pip install hf_maskllm` and `import hf_maskllm` before from_pretrained to load it"
)


class NMSparseConfig(QuantizationConfigMixin):
    """``quantization_config`` of a compressed N:M checkpoint.

    Args:
        n, m: the N:M pattern (n kept of every m consecutive inputs).
        modules: names (as in ``model.named_modules()``) of the compressed layers.
        format_version: version of :mod:`hf_maskllm.sparse.format` that wrote the tensors.
    """

    def __init__(
        self,
        n: int = 2,
        m: int = 4,
        modules: list[str] | None = None,
        format_version: int = FORMAT_VERSION,
        **kwargs,
    ) -> None:
        self.quant_method = QUANT_METHOD
        if not isinstance(format_version, int) or format_version < 1:
            raise CheckpointError(
                f"quantization_config.format_version must be a positive int, got {format_version!r}."
            )
        if format_version > FORMAT_VERSION:
            raise CheckpointError(
                f"This checkpoint uses compressed N:M format version {format_version}, but this hf_maskllm reads "
                f"up to version {FORMAT_VERSION}. Upgrade hf_maskllm (`pip install -U hf_maskllm`)."
            )
        check_nm_args(n, m)
        if not isinstance(modules, list) or not modules or not all(isinstance(x, str) for x in modules):
            raise CheckpointError("quantization_config.modules must be a non-empty list of module names.")
        self.format_version, self.n, self.m, self.modules = format_version, n, m, list(modules)
        kwargs.pop("quant_method", None)
        for key, value in kwargs.items():  # keep extra informative fields (hf_maskllm_version, ...)
            setattr(self, key, value)


class NMSparseHfQuantizer(HfQuantizer):
    """Loads ``hf_maskllm_nm`` checkpoints into :class:`SparseLinear` modules."""

    requires_calibration = True  # only pre-compressed checkpoints; there is no on-the-fly quantization
    quantization_config: NMSparseConfig

    def _drop_marker(self, config: Any) -> Any:
        if getattr(config, "transformers_weights", None) == LOAD_MARKER:
            delattr(config, "transformers_weights")
        return config

    # Called with the model config before the weight files are resolved: `update_attn_implementation`
    # in transformers >= 5.2x, `update_tp_plan` / `update_ep_plan` in earlier 5.x releases.
    def update_attn_implementation(self, config: Any) -> Any:
        return self._drop_marker(config)

    def update_tp_plan(self, config: Any) -> Any:
        return self._drop_marker(config)

    def update_ep_plan(self, config: Any) -> Any:
        return self._drop_marker(config)

    def _check_checkpoint_keys(self, checkpoint_files: list[str] | None, model: torch.nn.Module) -> None:
        """Every listed module must have its ``values``, ``meta`` (and ``bias``) in the files (headers only).

        transformers would otherwise fill a missing tensor with uninitialised memory and only warn.
        """
        if not checkpoint_files:
            return
        from safetensors import safe_open

        keys: set[str] = set()
        for file in checkpoint_files:
            if str(file).endswith(".safetensors"):
                with safe_open(str(file), framework="pt") as f:
                    keys.update(f.keys())
        if not keys:
            return
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        missing = []
        for name in self.quantization_config.modules:
            parts = ["values", "meta"]
            for local in (name, name.removeprefix(prefix)):
                try:
                    if getattr(model.get_submodule(local), "bias", None) is not None:
                        parts.append("bias")
                    break
                except AttributeError:
                    continue
            missing += [f"{name}.{part}" for part in parts if f"{name}.{part}" not in keys]
        if missing:
            raise CheckpointError(
                f"The compressed checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}; the files are "
                "incomplete or corrupt. Download or save the checkpoint again."
            )

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        cfg = self.quantization_config
        self._check_checkpoint_keys(kwargs.get("checkpoint_files"), model)
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        for name in cfg.modules:
            local = name
            try:
                module = model.get_submodule(local)
            except AttributeError:
                # A checkpoint saved from a *ForCausalLM loaded as its base model: drop the prefix.
                local = name.removeprefix(prefix)
                try:
                    module = model.get_submodule(local)
                except AttributeError:
                    raise CheckpointError(
                        f"quantization_config lists module {name!r}, which this {type(model).__name__} lacks; "
                        "load the checkpoint with the model class it was saved from (e.g. AutoModelForCausalLM)."
                    ) from None
            if not isinstance(module, torch.nn.Linear) and not is_conv1d(module):
                raise CheckpointError(
                    f"quantization_config lists module {name!r}, a {type(module).__name__} in this model, not an "
                    "nn.Linear / Conv1D; the checkpoint belongs to another architecture."
                )
            out_features, in_features = dense_weight_view(module).shape
            dtype = module.weight.dtype
            parent_name, _, child = local.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device("meta"):
                sparse = SparseLinear(
                    in_features, out_features, cfg.n, cfg.m, module.bias is not None, dtype=dtype
                )
            setattr(parent, child, sparse)
        return model

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        cfg = self.quantization_config
        for name, module in model.named_modules():
            if isinstance(module, SparseLinear):
                validate(
                    module.values, module.meta, cfg.n, cfg.m, module.in_features, module.out_features, name
                )
                if not bool(torch.isfinite(module.values).all()):
                    raise CheckpointError(
                        f"{name}.values holds NaN or inf; the checkpoint is corrupt. Save or download it again."
                    )
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        # transformers' save path cannot write the plain-transformers guard into config.json.
        logger.warning(
            "A compressed N:M model is saved with `hf_maskllm.sparse.save_compressed(model, directory)`, "
            "not model.save_pretrained."
        )
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register the config and quantizer with transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(NMSparseConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(NMSparseHfQuantizer)


register()
