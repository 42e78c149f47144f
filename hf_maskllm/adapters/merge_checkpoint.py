"""Merging a saved mask into a dense checkpoint on disk, streaming: ``merge_checkpoint``.

``MaskModel.from_pretrained(model, mask).save_pretrained(folder, merged=True)`` needs the whole model in
memory, plus the mask's logits and the compressed tensors beside it. ``merge_checkpoint`` never builds the
model: it reads the dense checkpoint's safetensors files one tensor at a time, applies the mask to each
masked weight (decoded one layer at a time), compresses it, and writes output files of at most
``max_shard_size``. It holds about one output file and the mask's packed bits (0.65 bit per weight for
2:4), never the model. The folder it writes is
the same compressed checkpoint, tensor for tensor (the sharding may differ).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import CheckpointError, ConfigError
from ..modules import dense_weight_view, is_conv1d
from ..patterns import indices_to_mask
from ..serialization import atomic_folder, resolve_folder
from ..sparse.checkpoint import compressed_config, write_checkpoint_file, write_index, write_model_card
from ..sparse.format import check_group_size, compress, pack_codes
from ..sparse.int8_embedding import EMBEDDING_TYPES, int8_embedding_keys, quantize_rows
from ..sparse.quantize import quantize_rtn, resolve_values
from .card import merged_card_fields
from .config import MaskConfig
from .mask_source import LayerMasks, open_mask_source, source_targets, warn_other_base_model

__all__ = ["merge_checkpoint"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Files of the base folder copied unchanged: the generation config and the tokenizer's files.
_COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def merge_checkpoint(
    model_name_or_path: str | os.PathLike,
    mask: str | os.PathLike,
    save_directory: str | os.PathLike,
    config: MaskConfig | None = None,
    revision: str | None = None,
    mask_revision: str | None = None,
    mask_subfolder: str | None = None,
    max_shard_size: int | str = "2GB",
    progress: bool = True,
    values: str | None = None,
    group_size: int | None = None,
    embedding: str | None = None,
) -> list[str]:
    """Apply a saved mask to a dense safetensors checkpoint and write the compressed N:M checkpoint.

    ``model_name_or_path``: a folder or Hub repo id holding ``config.json`` and ``model.safetensors``
    (or shards with ``model.safetensors.index.json``); ``mask``: a saved mask (hf_maskllm folder, the
    MaskLLM reference's ``mask_compressed.npz``, PATCH's ``mask.npz``, or a Hub repo of any; ``config`` as
    for :meth:`MaskModel.from_pretrained`). The weights keep the checkpoint's dtype; the output files hold at most
    ``max_shard_size`` bytes each, which with one input tensor at a time bounds the memory the merge
    needs (about one output file and the packed mask, plus the input file's pages the system keeps
    cached). The tokenizer's files
    and ``generation_config.json`` are copied. The folder is built beside ``save_directory`` and swapped
    in at once. ``AutoModelForCausalLM.from_pretrained(save_directory)`` loads it after
    ``import hf_maskllm``. Returns the names of the compressed layers.

    ``values="int8"`` / ``"int4"`` stores the kept values quantized by round-to-nearest, one float16 scale
    per ``group_size`` kept values (default 32; format version 2), one layer at a time; the default
    keeps the checkpoint's dtype (version 1). ``embedding="int8"`` stores the output layer (tied: the input
    embedding, once) as int8 with one float16 scale per row (round-to-nearest; format version 2).
    """
    if embedding not in (None, "float", *EMBEDDING_TYPES):
        raise ConfigError(
            f"`embedding` must be one of {list(EMBEDDING_TYPES)} or None (float), got {embedding!r}."
        )
    embedding = None if embedding == "float" else embedding
    base = _base_folder(model_name_or_path, revision)
    shards = _shards(base)
    skeleton = _skeleton(base)
    source = open_mask_source(mask, mask_revision, mask_subfolder, config, str(model_name_or_path))
    cfg = source.config
    warn_other_base_model(source, str(model_name_or_path))
    targets = source_targets(skeleton, source)
    layers = {name: skeleton.get_submodule(name) for name in targets}
    shapes = {name: tuple(dense_weight_view(layer).shape) for name, layer in layers.items()}
    transposed = {name for name, layer in layers.items() if is_conv1d(layer)}
    bits, group_size = resolve_values(values, group_size)
    if bits is not None:  # refuse before anything is written
        all_kept = [shapes[name][1] * cfg.n // cfg.m for name in targets]
        for name, kept in zip(targets, all_kept, strict=True):
            check_group_size(kept, bits, group_size, name, all_kept)
    weights = {f"{name}.weight": name for name in targets}
    _check_weights(
        base, shards, weights, {f"{name}.weight": tuple(layers[name].weight.shape) for name in targets}
    )
    rows = int8_embedding_keys(skeleton) if embedding is not None else {}
    kept_rows = {key: key for key, prefix in rows.items() if prefix is not None}
    params = dict(skeleton.named_parameters())
    _check_weights(base, shards, kept_rows, {key: tuple(params[key].shape) for key in kept_rows})
    target = Path(save_directory).expanduser().resolve()
    if target == base.resolve():
        raise CheckpointError(f"save_directory {target} is the dense checkpoint's folder; pick another one.")
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a folder; pick another save_directory.")
    model_layers = {name for name, _ in skeleton.named_modules()}
    sizes = {"dense": 0, "compressed": 0, "total": 0}

    def stale(name: str) -> bool:  # weight files of an earlier save that this one does not rewrite
        return name.startswith("model") and ".safetensors" in name

    with (
        LayerMasks(source, shapes, transposed, model_layers) as masks,
        atomic_folder(target, drop=stale, last="config.json") as tmp,
    ):
        bar = tqdm(total=len(targets), desc=f"merge {cfg.n}:{cfg.m} mask", unit="layer", disable=not progress)
        tensors = (
            item
            for shard in shards
            for item in _merged_tensors(
                base / shard,
                weights,
                masks,
                shapes,
                transposed,
                cfg.n,
                cfg.m,
                sizes,
                bar,
                bits,
                group_size,
                rows,
            )
        )
        dtypes = _write_bounded_shards(tensors, tmp, max_shard_size, sizes)
        first = next((dtypes[k] for k, _ in skeleton.named_parameters() if k in dtypes), None)
        bar.close()
        config_dict = json.loads((base / "config.json").read_text(encoding="utf-8"))
        value_type = None if bits is None else f"int{bits}"
        merged = compressed_config(
            config_dict,
            type(skeleton).__name__,
            first,
            cfg.n,
            cfg.m,
            targets,
            value_type,
            group_size,
            embedding,
        )
        (tmp / "config.json").write_text(
            json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        for file in _COPIED:
            if (base / file).is_file():
                shutil.copyfile(base / file, tmp / file)
        card = merged_card_fields(cfg, masks.summary)
        write_model_card(tmp, str(model_name_or_path), type(skeleton).__name__, cfg.n, cfg.m,
                         targets, sizes, card, value_type, group_size, embedding)  # fmt: skip
    return targets


def _merged_tensors(
    path: Path,
    weights: dict[str, str],
    masks: LayerMasks,
    shapes: dict[str, tuple[int, int]],
    transposed: set[str],
    n: int,
    m: int,
    sizes: dict[str, int],
    bar: tqdm,
    bits: int | None = None,
    group_size: int | None = None,
    rows: dict[str, str | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one input shard, one at a time, each masked weight replaced by its compressed pair
    (and, with ``rows``, the output embedding by its int8 rows: ``{key: prefix, or None to drop it}``)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
            tensor = f.get_tensor(key)
            if rows and key in rows:
                if rows[key] is not None:
                    try:
                        qweight, scales = quantize_rows(tensor)
                    except CheckpointError as e:
                        raise CheckpointError(f"{path}: {key}: {e}") from None
                    yield from ((f"{rows[key]}.qweight", qweight), (f"{rows[key]}.scales", scales))
                continue
            name = weights.get(key)
            if name is None:
                yield key, tensor
                continue
            weight = tensor.t() if name in transposed else tensor  # [out, in]
            mask = indices_to_mask(masks.indices(name, weight), n, m, shapes[name])
            merged = weight * mask.to(weight.dtype)
            del tensor, weight, mask
            if not bool(torch.isfinite(merged).all()):
                raise CheckpointError(
                    f"{path}: {key} holds NaN or inf weights (W * mask keeps them, even at pruned positions); "
                    "refusing to write a checkpoint that cannot load. Check the dense checkpoint."
                )
            values, meta = compress(merged, n, m)
            sizes["dense"] += merged.numel() * merged.element_size()
            del merged
            if bits is None:
                stored = {"values": values, "meta": meta}
            else:  # round-to-nearest, this layer only
                codes, scales = quantize_rtn(values, bits, group_size)
                stored = {"qvalues": pack_codes(codes, bits), "scales": scales, "meta": meta}
                del values, codes
            sizes["compressed"] += sum(t.numel() * t.element_size() for t in stored.values())
            bar.update(1)
            yield from ((f"{name}.{leaf}", tensor) for leaf, tensor in stored.items())


def _write_bounded_shards(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    max_shard_size: int | str,
    sizes: dict[str, int],
) -> dict[str, torch.dtype]:
    """Write ``tensors`` as weight files of at most ``max_shard_size`` bytes each (a larger tensor alone in
    its file), holding one file's tensors at a time, with the index when there are several; returns the
    dtype of every floating tensor, by parameter name (a compressed weight's values as ``<layer>.weight``)."""
    from huggingface_hub.serialization._base import (
        parse_size_to_int,
    )  # what split_torch_state_dict_into_shards uses

    limit = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    parts: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    dtypes: dict[str, torch.dtype] = {}

    def flush() -> None:
        write_checkpoint_file(pending, folder / f"part-{len(parts)}.tmp")
        parts.append(list(pending))
        pending.clear()

    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + nbytes > limit:
            flush()
            pending_bytes = 0
        pending[key] = tensor
        pending_bytes += nbytes
        sizes["total"] += nbytes
        if tensor.is_floating_point():
            name = key[: -len(".values")] + ".weight" if key.endswith(".values") else key
            dtypes[name] = tensor.dtype
    if pending or not parts:
        flush()
    if len(parts) == 1:
        (folder / "part-0.tmp").rename(folder / _SINGLE)
        return dtypes
    weight_map = {}
    for i, keys in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (folder / f"part-{i}.tmp").rename(folder / name)
        weight_map.update(dict.fromkeys(keys, name))
    write_index(folder, weight_map, {"total_size": sizes["total"]})
    return dtypes


def _base_folder(model_name_or_path: str | os.PathLike, revision: str | None) -> Path:
    """The local folder of the dense checkpoint (a folder, or the Hub files the merge reads)."""
    wanted = ["model*.safetensors", _INDEX, *_COPIED]  # not consolidated.safetensors or subfolders' files
    return resolve_folder(
        model_name_or_path, ["config.json"], wanted, CheckpointError, "dense checkpoint", revision
    )


def _shards(folder: Path) -> list[str]:
    """The weight files of the dense checkpoint in ``folder``, in the index's order."""
    if (folder / _INDEX).is_file():
        try:
            weight_map = json.loads((folder / _INDEX).read_text(encoding="utf-8"))["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{folder / _INDEX} is not a valid safetensors index ({e}); download it again."
            ) from None
        missing = [s for s in shards if not (folder / s).is_file() or "/" in s or s.startswith(".")]
        if missing:
            raise CheckpointError(
                f"{folder / _INDEX} names shards that are not in the folder: {missing[:3]}."
            )
        return shards
    if (folder / _SINGLE).is_file():
        return [_SINGLE]
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise CheckpointError(
            f"{folder} holds PyTorch pickle weights ({pickled[:2]}), no safetensors; hf_maskllm never unpickles a "
            "file it is given. Convert the checkpoint to safetensors (load it with transformers where you trust "
            "it, then save_pretrained), or load the model and use MaskModel.from_pretrained."
        )
    raise CheckpointError(f"{folder} holds no {_SINGLE} or {_INDEX}; is it a transformers checkpoint?")


def _skeleton(folder: Path) -> torch.nn.Module:
    """The model of ``folder/config.json`` on the meta device: its layer names, types and shapes, no weights."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    with torch.device("meta"):
        try:
            return cls(config) if cls is not None else AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            raise CheckpointError(
                f"{folder / 'config.json'} names architecture {architecture!r}, which transformers does not "
                f"provide ({e}); load the model yourself and use MaskModel.from_pretrained."
            ) from None


def _check_weights(
    folder: Path, shards: list[str], weights: dict[str, str], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Refuse before writing anything when a masked layer's weight is missing from the checkpoint or has
    another shape than the config gives."""
    from safetensors import safe_open

    found: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                if key in weights:
                    found[key] = tuple(f.get_slice(key).get_shape())
    missing = [key for key in weights if key not in found]
    if missing:
        raise CheckpointError(
            f"{folder} stores no tensor {missing[0]!r} ({len(missing)} masked weights missing): its tensors are "
            "named otherwise than the model's parameters (transformers renames some on load). Load the model "
            "and use MaskModel.from_pretrained(model, mask).save_pretrained(folder, merged=True)."
        )
    wrong = [key for key in weights if found[key] != shapes[key]]
    if wrong:
        key = wrong[0]
        raise CheckpointError(
            f"{folder}: {key} has shape {list(found[key])}, but config.json gives {list(shapes[key])}; the "
            "checkpoint is corrupt or its config belongs to another model."
        )
