"""Teach ``from_pretrained`` the ``hf_maskllm_nm`` checkpoints (registered on ``import hf_maskllm.sparse``).

Loading: the quantizer first verifies the weight files (safetensors only, every tensor's CRC-32,
every tensor the model needs present with its shape), swaps every listed module for a
:class:`SparseLinear` on the meta device, transformers fills their ``values`` / ``meta`` buffers
straight from the safetensors files (no dense copy), then every module is validated (N:M positions,
finite values) and the CPU weights leave the file mapping for huge pages (:mod:`.huge_pages`).

Without hf_maskllm: ``config.json`` carries ``transformers_weights`` set to
:data:`~hf_maskllm.sparse.format.LOAD_MARKER`, which plain transformers rejects with a ``ValueError``
that quotes it ("... import hf_maskllm ..."). This quantizer removes the marker before transformers
resolves the weight files.
"""

from __future__ import annotations

import re
from pathlib import Path
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

from ..errors import CheckpointError, ConfigError
from ..modules import dense_weight_view, is_conv1d
from ..patterns import check_nm_args
from ..serialization import verify_safetensors
from .checkpoint import bind_save_pretrained, unbind_save_pretrained
from .format import (
    CHECKSUM_KEY,
    QUANT_METHOD,
    QUANTIZED_FORMAT_VERSION,
    VALUE_TYPES,
    check_group_size,
    validate,
    validate_quantized,
    value_bits,
)
from .huge_pages import to_huge_pages
from .int8_embedding import (
    EMBEDDING_TYPES,
    Int8Embedding,
    Int8Linear,
    dequantize_embeddings,
    to_int8_embeddings,
    validate_rows,
)
from .linear import SparseLinear, to_dense_layers
from .quantized_linear import QuantizedSparseLinear, quantized_layer_names

__all__ = ["NMSparseConfig", "NMSparseHfQuantizer", "register"]

logger = logging.get_logger(__name__)

_FIX = "config.json is corrupt or was edited; download or save the checkpoint again (save_compressed)."


class NMSparseConfig(QuantizationConfigMixin):
    """``quantization_config`` of a compressed N:M checkpoint.

    Args:
        n, m: the N:M pattern (n kept of every m consecutive inputs).
        modules: names (as in ``model.named_modules()``) of the compressed layers.
        format_version: version of :mod:`hf_maskllm.sparse.format` that wrote the tensors: 1 (float
            kept values) or 2 (int8 / int4 kept values).
        values: version 2 only: ``"int8"`` or ``"int4"``, the value type of every compressed layer.
        group_size: version 2 only: kept values per float16 scale.
        embedding: version 2 only, optional: ``"int8"``, the output embedding (and the input embedding
            tied to it) stored as int8 rows with one float16 scale per row. A version-2 config declares
            ``values``, ``embedding`` or both.
    """

    def __init__(
        self,
        n: int = 2,
        m: int = 4,
        modules: list[str] | None = None,
        format_version: int = 1,
        **kwargs,
    ) -> None:
        self.quant_method = QUANT_METHOD
        if isinstance(format_version, bool) or not isinstance(format_version, int) or format_version < 1:
            raise CheckpointError(
                f"quantization_config.format_version must be a positive int, got {format_version!r}; {_FIX}"
            )
        if format_version > QUANTIZED_FORMAT_VERSION:
            raise CheckpointError(
                f"This checkpoint uses compressed N:M format version {format_version} (config.json "
                "quantization_config.format_version), but this hf_maskllm reads "
                f"up to version {QUANTIZED_FORMAT_VERSION}. Upgrade hf_maskllm (`pip install -U hf_maskllm`)."
            )
        values, group_size = kwargs.pop("values", None), kwargs.pop("group_size", None)
        embedding = kwargs.pop("embedding", None)
        if format_version < QUANTIZED_FORMAT_VERSION and (
            values is not None or group_size is not None or embedding is not None
        ):
            raise CheckpointError(
                f"quantization_config declares values={values!r} / group_size={group_size!r} / embedding={embedding!r}, "
                f"which only format version {QUANTIZED_FORMAT_VERSION} has, but its format_version is {format_version}; {_FIX}"
            )
        if embedding is not None:
            if embedding not in EMBEDDING_TYPES:
                raise CheckpointError(
                    f"quantization_config.embedding must be one of {list(EMBEDDING_TYPES)}, got {embedding!r}; {_FIX}"
                )
            self.embedding = embedding
        if format_version >= QUANTIZED_FORMAT_VERSION and (
            values is not None or group_size is not None or embedding is None
        ):
            if values not in VALUE_TYPES:
                raise CheckpointError(
                    f"quantization_config.values must be one of {list(VALUE_TYPES)} in format version "
                    f"{format_version}, got {values!r}; {_FIX}"
                )
            if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
                raise CheckpointError(
                    f"quantization_config.group_size must be a positive int in format version {format_version}, "
                    f"got {group_size!r}; {_FIX}"
                )
            self.values, self.group_size = values, group_size
        try:
            check_nm_args(n, m)
        except ConfigError as e:
            raise CheckpointError(f"quantization_config: {e} {_FIX}") from None
        if (
            not isinstance(modules, list)
            or not modules
            or not all(isinstance(x, str) and x for x in modules)
            or len(set(modules)) != len(modules)
        ):
            raise CheckpointError(
                f"quantization_config.modules must be a non-empty list of distinct module names; {_FIX}"
            )
        self.format_version, self.n, self.m, self.modules = format_version, n, m, list(modules)
        kwargs.pop("quant_method", None)
        for key, value in kwargs.items():  # keep extra informative fields (hf_maskllm_version, ...)
            if hasattr(self, key):  # e.g. `to_dict`: would shadow a method transformers calls
                raise CheckpointError(f"quantization_config has an invalid field {key!r}; {_FIX}")
            setattr(self, key, value)


class NMSparseHfQuantizer(HfQuantizer):
    """Loads ``hf_maskllm_nm`` checkpoints into :class:`SparseLinear` modules."""

    requires_calibration = True  # only pre-compressed checkpoints; there is no on-the-fly quantization
    quantization_config: NMSparseConfig

    def _drop_marker(self, config: Any) -> Any:
        # The marker only stops loaders that lack hf_maskllm. Any value that is not a weight file name (the
        # marker, or the marker with a flipped byte) is dropped: the files are then found and verified as usual.
        marker = getattr(config, "transformers_weights", None)
        if isinstance(marker, str) and not marker.endswith((".safetensors", ".safetensors.index.json")):
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

    def _verify_files(
        self, checkpoint_files: list[str] | None
    ) -> dict[str, tuple[str, list[int], int]] | None:
        """Every weight file is safetensors with intact per-tensor checksums; returns ``{tensor: (dtype, shape, crc)}``."""
        if not checkpoint_files:
            return None
        self._source = str(Path(checkpoint_files[0]).parent)
        entries: dict[str, tuple[str, list[int], int]] = {}
        for file in checkpoint_files:
            if not str(file).endswith(".safetensors"):
                raise CheckpointError(
                    f"weight file {file} is not a safetensors file; compressed N:M checkpoints are safetensors only "
                    "and hf_maskllm never unpickles. Save the checkpoint again with save_compressed."
                )
            found, _ = verify_safetensors(file, CHECKSUM_KEY, CheckpointError, "weight file")
            twice = sorted(set(found) & set(entries))
            if twice:
                raise CheckpointError(
                    f"tensor(s) {twice[:3]} appear in several weight files; the checkpoint index is corrupt. "
                    "Download or save the checkpoint again."
                )
            entries.update(found)
        return entries

    def _check_quantized_dtypes(
        self, entries: dict[str, tuple[str, list[int], int]], model: torch.nn.Module
    ) -> None:
        """Version 2: every quantized tensor is stored with the format's dtype (transformers would cast it)."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        values = self.quantization_config.values
        wanted = {"qvalues": "I8" if values == "int8" else "U8", "scales": "F16"}
        for name in quantized_layer_names(model):
            for leaf, dtype in wanted.items():
                key = f"{name}.{leaf}"
                found = next(
                    (k for k in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")) if k in entries),
                    None,
                )
                if found is not None and entries[found][0] != dtype:
                    raise CheckpointError(
                        f"{self._source}: {found} is stored as {entries[found][0]}, but config.json declares {values} values "
                        f"(format version 2: qvalues {wanted['qvalues']}, scales F16); the tensors do not match the value "
                        f"type. {_FIX}"
                    )

    def _check_keys(self, entries: dict[str, tuple[str, list[int], int]], model: torch.nn.Module) -> None:
        """Every tensor the model needs is in the files with its shape; no compressed tensor is left over.

        transformers alone would fill a missing tensor with random values and only warn.
        """
        prefix = getattr(model, "base_model_prefix", "") or ""
        tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # {target: source}
        ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]

        def lookup(key: str) -> str | None:
            candidates = [key]
            if prefix:
                candidates += [f"{prefix}.{key}", key.removeprefix(f"{prefix}.")]
            return next((c for c in candidates if c in entries), None)

        for target, source in tied.items():
            stored_target, stored_source = lookup(target), lookup(source)
            if stored_target and stored_source and entries[stored_target][2] != entries[stored_source][2]:
                raise CheckpointError(
                    f"{self._source}: config.json ties {target} to {source} (tie_word_embeddings), but the checkpoint stores different "
                    f"weights for them, so one would be silently dropped; {_FIX}"
                )
        used: set[str] = set()
        missing, mismatched = [], []
        for key, tensor in model.state_dict().items():
            found = lookup(key)
            if found is None:
                if key not in tied and not any(p.search(key) for p in ignore):
                    missing.append(key)
                continue
            used.add(found)
            if list(tensor.shape) != entries[found][1]:
                mismatched.append(f"{found} {entries[found][1]} (model: {list(tensor.shape)})")
        if missing:
            raise CheckpointError(
                f"{self._source}: the compressed checkpoint lacks {len(missing)} tensor(s) this {type(model).__name__} needs, e.g. "
                f"{missing[:3]}; the files are incomplete, or config.json describes another model. Load it with "
                "the model class it was saved from, or download or save the checkpoint again."
            )
        if mismatched:
            raise CheckpointError(
                f"{self._source}: {len(mismatched)} tensor(s) of the compressed checkpoint do not fit this {type(model).__name__}, "
                f"e.g. {mismatched[:3]}; {_FIX}"
            )
        stray = sorted(
            k for k in set(entries) - used if k.endswith((".values", ".meta", ".qvalues", ".scales"))
        )
        if stray:
            raise CheckpointError(
                f"{self._source}: the checkpoint holds compressed tensors of modules that quantization_config.modules does not "
                f"list: {stray[:3]}; {_FIX}"
            )

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        cfg = self.quantization_config
        entries = self._verify_files(kwargs.get("checkpoint_files"))
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        quantized = getattr(cfg, "values", None) is not None
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
                        "load the checkpoint with the model class it was saved from (config.json `architectures`)."
                    ) from None
            if not isinstance(module, torch.nn.Linear) and not is_conv1d(module):
                raise CheckpointError(
                    f"quantization_config lists module {name!r}, a {type(module).__name__} in this model, not an "
                    f"nn.Linear / Conv1D; the checkpoint belongs to another architecture, or {_FIX}"
                )
            out_features, in_features = dense_weight_view(module).shape
            if in_features % cfg.m:
                raise CheckpointError(
                    f"quantization_config lists module {name!r}, whose in_features={in_features} in this model is "
                    f"not divisible by m={cfg.m}; {_FIX}"
                )
            dtype = module.weight.dtype
            with torch.device("meta"):
                if quantized:
                    bits = value_bits(cfg.values)
                    try:
                        check_group_size(in_features * cfg.n // cfg.m, bits, cfg.group_size, name)
                    except ConfigError as e:
                        raise CheckpointError(f"quantization_config: {e} {_FIX}") from None
                    sparse = QuantizedSparseLinear(
                        in_features,
                        out_features,
                        cfg.n,
                        cfg.m,
                        bits,
                        cfg.group_size,
                        module.bias is not None,
                        dtype=dtype,
                        conv1d=is_conv1d(module),
                    )
                else:
                    sparse = SparseLinear(
                        in_features,
                        out_features,
                        cfg.n,
                        cfg.m,
                        module.bias is not None,
                        dtype=dtype,
                        conv1d=is_conv1d(module),
                    )
            model.set_submodule(local, sparse)
        if getattr(cfg, "embedding", None) is not None:
            out_name, in_name = to_int8_embeddings(model, quantize=False)
            if entries is not None:
                self._check_int8_dtypes(entries, model, in_name or out_name)
        if entries is not None:
            if quantized:
                self._check_quantized_dtypes(entries, model)
            self._check_keys(entries, model)
        return model

    def _check_int8_dtypes(
        self, entries: dict[str, tuple[str, list[int], int]], model: torch.nn.Module, name: str
    ) -> None:
        """The int8 output embedding is stored as int8 codes and float16 scales (transformers would cast them)."""
        prefix = getattr(model, "base_model_prefix", "") or ""
        for leaf, dtype in (("qweight", "I8"), ("scales", "F16")):
            key = f"{name}.{leaf}"
            found = next(
                (k for k in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")) if k in entries), None
            )
            if found is not None and entries[found][0] != dtype:
                raise CheckpointError(
                    f"{self._source}: {found} is stored as {entries[found][0]}, but config.json declares an int8 output "
                    f"embedding ({leaf} {dtype}); {_FIX}"
                )

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """Verify after reading (every compressed module holds a well-formed N:M pair of finite values), then,
        for a model wholly on the CPU, move the weights out of the file mapping onto huge pages (:mod:`.huge_pages`)."""
        cfg = self.quantization_config
        where = getattr(self, "_source", "the checkpoint")
        for name, module in model.named_modules():
            if isinstance(module, SparseLinear):
                try:
                    validate(
                        module.values,
                        module.meta,
                        cfg.n,
                        cfg.m,
                        module.in_features,
                        module.out_features,
                        name,
                    )
                except CheckpointError as e:
                    raise CheckpointError(f"{where}: {e}") from None
                if not bool(torch.isfinite(module.values.detach()).all()):
                    raise CheckpointError(
                        f"{where}: {name}.values holds NaN or inf; the checkpoint is corrupt. Save or download it again."
                    )
            elif isinstance(module, QuantizedSparseLinear):
                try:
                    validate_quantized(
                        module.qvalues,
                        module.scales,
                        module.meta,
                        cfg.n,
                        cfg.m,
                        module.bits,
                        module.group_size,
                        module.in_features,
                        module.out_features,
                        name,
                    )
                except CheckpointError as e:
                    raise CheckpointError(f"{where}: {e}") from None
            elif isinstance(module, (Int8Embedding, Int8Linear)) and not getattr(module, "tied", False):
                shape = (
                    (module.num_embeddings, module.embedding_dim)
                    if isinstance(module, Int8Embedding)
                    else (module.out_features, module.in_features)
                )
                try:
                    validate_rows(module.qweight, module.scales, *shape, name)
                except CheckpointError as e:
                    raise CheckpointError(f"{where}: {e}") from None
        # a model split across devices (accelerate's hooks hold its tensors) stays as dispatched
        placed = getattr(model, "hf_device_map", None) or {}
        if all(str(device) == "cpu" for device in placed.values()):
            to_huge_pages(model)
        bind_save_pretrained(model)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        # transformers' own writer cannot put the plain-transformers guard into config.json nor the per-tensor
        # checksums into every shard; loaded models get a `save_pretrained` that calls `save_compressed`
        # (checkpoint.bind_save_pretrained), so this is reached only through `PreTrainedModel.save_pretrained(model, ...)`.
        logger.warning(
            "A compressed N:M model is saved with `model.save_pretrained(directory)` on the loaded model or "
            "`hf_maskllm.sparse.save_compressed(model, directory)`."
        )
        return False

    @property
    def is_trainable(self) -> bool:
        # The kept weights (`values`) train directly and stay N:M; PEFT LoRA works through hf_maskllm.sparse.lora.
        return True

    @property
    def is_qat_trainable(self) -> bool:
        # Lets `Trainer` train the compressed model without adapters (what transformers calls QAT).
        return True

    @property
    def is_compileable(self) -> bool:
        # The kernels are registered torch ops: `generate` may compile the forward (static cache).
        return True

    def _dequantize(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """Replace every :class:`SparseLinear` / :class:`QuantizedSparseLinear` by its dense layer (zeros kept;
        int8 / int4 values dequantized); ``model.dequantize()`` calls it."""
        unbind_save_pretrained(model)
        dequantize_embeddings(model)
        for name in quantized_layer_names(model):
            model.set_submodule(name, model.get_submodule(name).to_dense())
        return to_dense_layers(model)


def register() -> None:
    """Register the config and quantizer with transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(NMSparseConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(NMSparseHfQuantizer)


register()
