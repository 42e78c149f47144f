"""Write a merged N:M model as a compressed (or plain dense) Hugging Face folder.

``save_compressed`` is the writer. A model whose layers are :class:`SparseLinear` (loaded from a
compressed checkpoint, or converted with ``to_sparse_layers``) gets a ``save_pretrained`` that calls
it (:func:`bind_save_pretrained`), so ``push_to_hub`` and ``Trainer`` checkpoints write the same
format: transformers' own writer drops the ``transformers_weights`` guard and writes one metadata
for every shard, so it cannot write this format (docs/design.md).
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, NMViolationError, TargetError
from ..hub import is_hub_repo_id
from ..modules import dense_weight_view, is_conv1d, output_embedding_names
from ..patterns import check_nm_args, count_nm_violations
from ..serialization import atomic_folder, tensor_checksums, verify_safetensors
from ..version import __version__
from .format import (
    CHECKSUM_KEY,
    FORMAT_VERSION,
    LOAD_MARKER,
    QUANT_METHOD,
    QUANTIZED_FORMAT_VERSION,
    check_group_size,
    compress,
)
from .int8_embedding import EMBEDDING_TYPES, Int8Linear, int8_embedding_keys, int8_embedding_tensors
from .linear import SparseLinear
from .quantize import quantize_layers, resolve_values
from .quantized_linear import QuantizedSparseLinear

__all__ = [
    "bind_save_pretrained",
    "check_modules",
    "compressed_config",
    "compressed_layer_names",
    "find_nm_modules",
    "save_compressed",
    "unbind_save_pretrained",
    "write_checkpoint_file",
    "write_index",
    "write_model_card",
]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_COMPRESSED = (SparseLinear, QuantizedSparseLinear)


def compressed_layer_names(model: nn.Module) -> list[str]:
    """Names of the :class:`SparseLinear` and :class:`QuantizedSparseLinear` modules of ``model``, in model order."""
    return [name for name, mod in model.named_modules() if isinstance(mod, _COMPRESSED)]


def _is_nm(module: nn.Module, n: int, m: int) -> bool:
    if isinstance(module, _COMPRESSED):
        return (module.n, module.m) == (n, m)
    weight = dense_weight_view(module)
    return weight.shape[1] % m == 0 and count_nm_violations(weight.detach(), n, m) == 0


def find_nm_modules(model: nn.Module, n: int = 2, m: int = 4) -> list[str]:
    """Names of every ``nn.Linear`` / ``Conv1D`` (not the output embedding) whose weight is exactly N:M."""
    skip = output_embedding_names(model)
    return [
        name
        for name, module in model.named_modules()
        if (isinstance(module, (nn.Linear, *_COMPRESSED)) or is_conv1d(module))
        and name not in skip
        and _is_nm(module, n, m)
    ]


def check_modules(model: nn.Module, modules: list[str], n: int, m: int) -> None:
    """Raise unless every name in ``modules`` is a linear / Conv1D (not the output embedding) that is exactly N:M."""
    named = dict(model.named_modules())
    skip = output_embedding_names(model)
    for name in modules:
        module = named.get(name)
        if module is None:
            raise TargetError(f"module {name!r} does not exist in {type(model).__name__}; check `modules`.")
        if not (isinstance(module, (nn.Linear, *_COMPRESSED)) or is_conv1d(module)):
            raise TargetError(
                f"module {name!r} is a {type(module).__name__}; only nn.Linear / Conv1D can be compressed."
            )
        if name in skip:
            raise TargetError(
                f"module {name!r} is the output embedding (often tied); leave it out of `modules`."
            )
        if isinstance(module, _COMPRESSED):
            if (module.n, module.m) != (n, m):
                raise NMViolationError(f"module {name!r} is {module.n}:{module.m} compressed, not {n}:{m}.")
            continue
        weight = dense_weight_view(module)
        if weight.shape[1] % m:
            raise NMViolationError(
                f"module {name!r} has in_features={weight.shape[1]}, not divisible by m={m}."
            )
        bad = count_nm_violations(weight.detach(), n, m)
        if bad:
            raise NMViolationError(
                f"module {name!r} is not {n}:{m} sparse ({bad} groups keep more than {n} of {m} weights); "
                "merge the mask into the weights first (MaskModel.merge_and_unload) or drop it from `modules`."
            )


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GB"


def _model_card(
    base: str,
    model_class: str,
    n: int,
    m: int,
    modules: list[str],
    sizes: dict[str, int],
    extra: dict | None,
    values: str | None = None,
    group_size: int | None = None,
    embedding: str | None = None,
) -> str:
    extra = dict(extra or {})
    base = str(extra.pop("base_model", base))
    lines = ["---", "library_name: transformers", "tags:", "- hf_maskllm", "- sparsity", f"- {n}:{m}"]
    if base and is_hub_repo_id(base):
        lines.append(f"base_model: {base}")
    lines += ["---", "", f"# {n}:{m} sparse model (hf_maskllm)", ""]
    stored = (
        f"format version {FORMAT_VERSION}: kept values + packed positions"
        if values is None
        else f"format version {QUANTIZED_FORMAT_VERSION}: {values} kept values with one float16 scale per "
        f"{group_size} + packed positions"
    )
    if embedding is not None:
        stored = f"format version {QUANTIZED_FORMAT_VERSION}: " + stored.split(": ", 1)[1]
        stored += f"; the output embedding in {embedding} with one float16 scale per row"
    lines.append(
        f"{len(modules)} linear layers of `{base or model_class}` are {n}:{m} sparse and stored compressed "
        f"({stored}). Load it with:"
    )
    lines += [
        "",
        "```python",
        "import hf_maskllm  # registers the format with transformers",
        "from transformers import AutoModelForCausalLM",
        "",
        'model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")',
        "```",
        "",
    ]
    lines.append(
        "Without `import hf_maskllm`, transformers refuses to load this checkpoint (it never loads random layers)."
    )
    lines += ["", "| | |", "|---|---|", f"| base model | {base or 'unknown'} |", f"| pattern | {n}:{m} |"]
    lines.append(f"| compressed modules | {len(modules)} |")
    if values is not None:
        lines.append(f"| kept values | {values}, one float16 scale per {group_size} kept values |")
    if embedding is not None:
        lines.append(
            f"| output embedding | {embedding}, one float16 scale per row (stored once when tied to the input embedding) |"
        )
    lines.append(f"| masked weights, dense | {_human(sizes['dense'])} |")
    lines.append(
        f"| masked weights, compressed | {_human(sizes['compressed'])} ({sizes['compressed'] / max(sizes['dense'], 1):.2%}) |"
    )
    lines.append(f"| all weights in this folder | {_human(sizes['total'])} |")
    for key, value in extra.items():
        lines.append(f"| {key} | {value} |")
    return "\n".join(lines) + "\n"


def write_checkpoint_file(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write one weight file of a compressed checkpoint: safetensors with a CRC-32 per tensor in its metadata.

    The file is read back and verified before this returns.
    """
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    metadata = {"format": "pt", CHECKSUM_KEY: json.dumps(tensor_checksums(tensors), sort_keys=True)}
    save_file(tensors, str(path), metadata=metadata)
    verify_safetensors(path, CHECKSUM_KEY, CheckpointError, "written weight file")


def _write_shards(state_dict: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        state_dict, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors"
    )
    for filename, names in split.filename_to_tensors.items():
        write_checkpoint_file({k: state_dict[k] for k in names}, folder / filename)
    if split.is_sharded:
        write_index(folder, split.tensor_to_filename, dict(split.metadata))


def write_index(folder: Path, weight_map: dict[str, str], metadata: dict[str, Any]) -> None:
    """Write ``model.safetensors.index.json`` (transformers' index of a sharded checkpoint) into ``folder``."""
    index = {"metadata": metadata, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_compressed(
    model: nn.Module,
    save_directory: str | os.PathLike,
    n: int = 2,
    m: int = 4,
    modules: list[str] | None = None,
    dense: bool = False,
    tokenizer: Any = None,
    max_shard_size: int | str = "2GB",
    model_card: dict | None = None,
    values: str | None = None,
    group_size: int | None = None,
    calibration_data: Any = None,
    embedding: str | None = None,
) -> list[str]:
    """Save a merged N:M model (targeted weights already zeroed) as a Hugging Face folder.

    ``modules=None`` picks every linear (not the output embedding) whose weight is exactly N:M.
    The pattern is verified before anything is written. ``dense=True`` writes a plain transformers
    checkpoint (zeros kept, no ``quantization_config``). Otherwise the listed layers are stored as
    ``P.values`` / ``P.meta`` (see :mod:`hf_maskllm.sparse.format`), reloadable after
    ``import hf_maskllm`` with ``AutoModelForCausalLM.from_pretrained``. Returns the module names.

    ``values``: ``None`` (or ``"float"``) stores the kept values in the model's dtype (format version 1);
    ``"int8"`` / ``"int4"`` stores them quantized, symmetric, one float16 scale per ``group_size`` kept
    values of a row (default 32; format version 2; ``P.qvalues`` / ``P.scales`` / ``P.meta``), by
    round-to-nearest, or with ``calibration_data`` (token ids ``[batch, seq]``, or texts with
    ``tokenizer``) by the error-compensating method of :mod:`hf_maskllm.sparse.gptq`. Layers already
    quantized are written as they are and need the same ``values`` and ``group_size``.

    ``embedding="int8"`` also stores the output layer (and the input embedding tied to it, once) as int8
    with one float16 scale per row, round-to-nearest (format version 2; see
    :mod:`hf_maskllm.sparse.int8_embedding`); a model already holding such a layer is written with it.

    The folder is built beside ``save_directory`` and swapped in at once (see
    :func:`hf_maskllm.serialization.atomic_folder`): a crash leaves the previous save complete.
    """
    check_nm_args(n, m)
    bits, group_size = resolve_values(values, group_size)
    if embedding in (None, "float") and any(isinstance(mod, Int8Linear) for mod in model.modules()):
        if embedding == "float":
            raise ConfigError(
                "this model's output embedding is int8; call model.dequantize() first to store it in float."
            )
        embedding = "int8"
    embedding = None if embedding == "float" else embedding
    if embedding is not None and embedding not in EMBEDDING_TYPES:
        raise ConfigError(
            f"`embedding` must be one of {list(EMBEDDING_TYPES)} or None (float), got {embedding!r}."
        )
    if embedding is not None and not any(isinstance(mod, Int8Linear) for mod in model.modules()):
        int8_embedding_keys(model)  # refuses an output layer it cannot store, before anything is written
    if calibration_data is not None and bits is None:
        raise ConfigError(
            "calibration_data is used to quantize the kept values; pass values='int8' or 'int4'."
        )
    if modules is None:
        modules = find_nm_modules(model, n, m)
        if not modules:
            raise NMViolationError(
                f"no linear layer of {type(model).__name__} is {n}:{m} sparse; merge the mask into the weights "
                "first (MaskModel.merge_and_unload), or check n and m."
            )
    else:
        modules = list(modules)
        if not modules:
            raise TargetError("`modules` is empty; pass None to pick every N:M linear, or a list of names.")
        check_modules(model, modules, n, m)
    has_sparse = any(isinstance(mod, _COMPRESSED) for mod in model.modules())
    if dense and has_sparse:
        raise CheckpointError(
            "dense=True needs a dense model, but this one holds SparseLinear modules; replace them with "
            "module.to_dense() first, or save compressed (dense=False)."
        )
    if dense and bits is not None:
        raise ConfigError(f"values={values!r} applies to compressed checkpoints; drop it or dense=True.")
    if dense and embedding is not None:
        raise ConfigError(
            f"embedding={embedding!r} applies to compressed checkpoints; drop it or dense=True."
        )
    _check_quantized(model, modules, n, m, bits, group_size)
    if calibration_data is not None and has_sparse:
        raise ConfigError(
            "calibration_data runs the error-compensating quantization on dense layers, but this model holds "
            "compressed layers; call model.dequantize() (the dense model with zeros) and save that with "
            "save_compressed(model, directory, values=..., calibration_data=...)."
        )

    if not dense:
        _check_finite(model, modules)
    target = Path(save_directory).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a folder; pick another save_directory.")

    def stale(name: str) -> bool:  # weight files of an earlier save that the new one does not rewrite
        return name.startswith("model") and ".safetensors" in name

    with atomic_folder(target, drop=stale, last="config.json") as tmp:
        if dense:
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        else:
            _save_compressed_files(
                model,
                tmp,
                n,
                m,
                modules,
                max_shard_size,
                model_card,
                bits,
                group_size,
                calibration_data,
                tokenizer,
                embedding,
            )
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return modules


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _check_quantized(
    model: nn.Module, modules: list[str], n: int, m: int, bits: int | None, group_size: int | None
) -> None:
    """Refuse a group size that does not fit a layer (naming one that fits all), and layers already
    quantized with another value type or group size (they are written as they are: a second rounding
    would lose what the first kept)."""
    named = dict(model.named_modules())
    if bits is not None:
        kept = {
            name: (
                named[name].in_features
                if isinstance(named[name], _COMPRESSED)
                else dense_weight_view(named[name]).shape[1]
            )
            * n
            // m
            for name in modules
        }
        for name, k in kept.items():
            check_group_size(k, bits, group_size, name, list(kept.values()))
    for name in modules:
        module = named[name]
        if isinstance(module, QuantizedSparseLinear) and (module.bits, module.group_size) != (
            bits,
            group_size,
        ):
            wanted = "float values" if bits is None else f"int{bits} values with group_size={group_size}"
            raise ConfigError(
                f"layer {name!r} holds {module.value_type} values with group_size={module.group_size}, but the save "
                f"asks for {wanted}; save with values={module.value_type!r}, group_size={module.group_size}, or "
                "start from the float model."
            )


def _check_finite(model: nn.Module, modules: list[str]) -> None:
    """Refuse NaN / inf in a module to be compressed: the loader rejects such values, so the save could never load."""
    named = dict(model.named_modules())
    for name in modules:
        module = named[name]
        if isinstance(module, QuantizedSparseLinear):
            weight = module.scales
        elif isinstance(module, SparseLinear):
            weight = module.values
        else:
            weight = dense_weight_view(module)
        if not bool(torch.isfinite(weight.detach()).all()):
            raise CheckpointError(
                f"module {name!r} holds NaN or inf weights; refusing to write a checkpoint that cannot load. "
                "Check the model (or the merged mask) and save again."
            )


def _save_compressed_files(
    model: nn.Module,
    tmp: Path,
    n: int,
    m: int,
    modules: list[str],
    max_shard_size: int | str,
    model_card: dict | None,
    bits: int | None = None,
    group_size: int | None = None,
    calibration_data: Any = None,
    tokenizer: Any = None,
    embedding: str | None = None,
) -> None:
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    named = dict(model.named_modules())
    state_dict = remove_tied_weights_from_state_dict(model.state_dict(), model)  # references, not copies
    sizes = {"dense": 0, "compressed": 0}
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if bits is not None and calibration_data is not None:  # the error-compensating method sees every layer
        kept = {name: compress(dense_weight_view(named[name]), n, m)[0] for name in modules}
        quantized = quantize_layers(model, kept, bits, group_size, calibration_data, tokenizer, n, m)
        del kept
    for name in modules:
        module = named[name]
        if isinstance(module, QuantizedSparseLinear):
            tensors = {"qvalues": module.qvalues, "scales": module.scales, "meta": module.meta}
            sizes["dense"] += module.in_features * module.out_features * _element_size(module.weight_dtype)
        else:
            if isinstance(module, SparseLinear):
                values, meta = module.values, module.meta
                sizes["dense"] += module.in_features * module.out_features * values.element_size()
                if bits is not None:
                    del state_dict[f"{name}.values"]
            else:
                weight = dense_weight_view(module)
                values, meta = compress(weight, n, m)  # one layer at a time
                sizes["dense"] += weight.numel() * weight.element_size()
                del state_dict[f"{name}.weight"]
            if bits is None:
                tensors = {"values": values, "meta": meta}
            else:
                qvalues, scales = quantized.pop(name, None) or next(
                    iter(quantize_layers(model, {name: values}, bits, group_size).values())
                )
                tensors = {"qvalues": qvalues, "scales": scales, "meta": meta}
        for key, tensor in tensors.items():
            state_dict[f"{name}.{key}"] = tensor.detach().cpu()
            sizes["compressed"] += tensor.numel() * tensor.element_size()
    if embedding is not None:  # the output layer (tied: the input embedding too) as int8 rows, stored once
        drop, add = int8_embedding_tensors(model)
        for key in drop:
            state_dict.pop(key, None)
        state_dict.update(add)
    sizes["total"] = sum(t.numel() * t.element_size() for t in state_dict.values())
    _write_shards(state_dict, tmp, max_shard_size)
    del state_dict

    float_dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    config = compressed_config(
        json.loads(model.config.to_json_string()),
        type(model).__name__,
        float_dtypes[0] if float_dtypes else None,
        n,
        m,
        modules,
        None if bits is None else f"int{bits}",
        group_size,
        embedding,
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(tmp)
    base = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    write_model_card(
        tmp,
        base,
        type(model).__name__,
        n,
        m,
        modules,
        sizes,
        model_card,
        None if bits is None else f"int{bits}",
        group_size,
        embedding,
    )


def compressed_config(
    config: dict[str, Any],
    architecture: str,
    dtype: torch.dtype | None,
    n: int,
    m: int,
    modules: list[str],
    values: str | None = None,
    group_size: int | None = None,
    embedding: str | None = None,
) -> dict[str, Any]:
    """``config.json`` of a compressed checkpoint: the model's config (a dict) with its ``quantization_config``
    and the guard that makes plain transformers refuse the folder (see ``quantizer.py``). ``values``
    (``"int8"`` / ``"int4"``) and ``group_size`` make it format version 2, as does ``embedding`` (``"int8"``:
    the output embedding stored as int8 rows)."""
    config = dict(config)
    config.pop("quantization_config", None)
    config["architectures"] = [architecture]
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    config["transformers_weights"] = LOAD_MARKER
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "n": n,
        "m": m,
        "modules": list(modules),
        "hf_maskllm_version": __version__,
    }
    if values is not None:
        config["quantization_config"] |= {
            "format_version": QUANTIZED_FORMAT_VERSION,
            "values": values,
            "group_size": group_size,
        }
    if embedding is not None:
        config["quantization_config"] |= {"format_version": QUANTIZED_FORMAT_VERSION, "embedding": embedding}
    return config


def write_model_card(
    folder: Path,
    base: str,
    model_class: str,
    n: int,
    m: int,
    modules: list[str],
    sizes: dict[str, int],
    extra: dict | None = None,
    values: str | None = None,
    group_size: int | None = None,
    embedding: str | None = None,
) -> None:
    """Write the compressed checkpoint's ``README.md``; ``sizes``: bytes of the masked weights ``dense`` and
    ``compressed``, and of every tensor in the folder (``total``); ``values`` / ``group_size``: the
    quantized value type, if any; ``embedding``: ``"int8"`` if the output embedding is stored as int8 rows."""
    (folder / "README.md").write_text(
        _model_card(base, model_class, n, m, modules, sizes, extra, values, group_size, embedding),
        encoding="utf-8",
    )


_IGNORED = ("safe_serialization", "is_main_process", "state_dict", "token", "save_original_format")


def _save_pretrained(
    self: nn.Module,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "2GB",
    push_to_hub: bool = False,
    tokenizer: Any = None,
    values: str | None = None,
    group_size: int | None = None,
    calibration_data: Any = None,
    embedding: str | None = None,
    **kwargs: Any,
) -> list[str]:
    """Save this compressed N:M model as a compressed checkpoint (``hf_maskllm.sparse.save_compressed``).

    Reload it with ``AutoModelForCausalLM.from_pretrained`` after ``import hf_maskllm``. Accepts
    what ``Trainer`` passes (``state_dict``: must be this model's own tensors; ``is_main_process``).
    ``values`` / ``group_size`` / ``calibration_data`` as for ``save_compressed``; by default a model
    with int8 / int4 layers is written with their value type and group size, and an int8 output embedding
    stays int8 (``embedding`` as for ``save_compressed``). Returns the names of the compressed modules.
    """
    unknown = sorted(set(kwargs) - set(_IGNORED))
    if unknown or push_to_hub or kwargs.get("safe_serialization") is False:
        raise CheckpointError(
            f"save_pretrained of a compressed N:M model does not take {unknown or ['push_to_hub']}"
            f"{' / safe_serialization=False' if kwargs.get('safe_serialization') is False else ''}; "
            "pass save_directory, max_shard_size and tokenizer (use model.push_to_hub(repo_id) to upload)."
        )
    if kwargs.get("is_main_process") is False:
        return []
    state_dict = kwargs.get("state_dict")
    if state_dict is not None and set(state_dict) != set(self.state_dict()):
        raise CheckpointError(
            "save_pretrained got a state_dict whose keys differ from this compressed model's; a compressed "
            "checkpoint is written from the model itself. Drop state_dict, or load it into the model first."
        )
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(mod, BaseTunerLayer) for mod in self.modules()):
        raise CheckpointError(
            "this model still holds PEFT adapter layers; merge them first (peft_model.merge_and_unload(), which "
            "keeps N:M) or save only the adapter with peft_model.save_pretrained."
        )
    names = compressed_layer_names(self)
    if not names:
        raise CheckpointError(
            "this model holds no SparseLinear layer any more; save it with the plain transformers save_pretrained "
            "(after model.dequantize()) or hf_maskllm.sparse.save_compressed."
        )
    first = self.get_submodule(names[0])
    if values is None:
        quantized = [self.get_submodule(name) for name in names]
        quantized = [mod for mod in quantized if isinstance(mod, QuantizedSparseLinear)]
        if quantized:
            values = quantized[0].value_type
            group_size = quantized[0].group_size if group_size is None else group_size
    return save_compressed(
        self,
        save_directory,
        first.n,
        first.m,
        modules=names,
        tokenizer=tokenizer,
        max_shard_size=max_shard_size,
        values=values,
        group_size=group_size,
        calibration_data=calibration_data,
        embedding=embedding,
    )


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` (and so ``push_to_hub`` and ``Trainer`` checkpoints) write compressed."""
    model.save_pretrained = types.MethodType(_save_pretrained, model)


def unbind_save_pretrained(model: nn.Module) -> None:
    """Undo :func:`bind_save_pretrained`: ``model.save_pretrained`` is its class's again."""
    if "save_pretrained" in vars(model):
        del model.save_pretrained
