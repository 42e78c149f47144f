"""One reader for every mask source: found, its format told from its files, checked, read layer by layer.

Three formats hold a learned N:M mask:

- ``hf_maskllm``: a folder written by ``MaskModel.save_pretrained`` (``mask_config.json`` +
  ``mask_model.safetensors``, ``mask_file.py``);
- ``nvlabs``: NVlabs/MaskLLM's ``mask_compressed.npz``: key ``<parameter name>.mask`` holds
  ``np.packbits`` of the flattened boolean mask in the parameter's own shape;
- ``patch``: PATCH's ``mask.npz`` (its released MaskLLM and PATCH masks): key ``<parameter name>``
  holds ``np.packbits`` of the flattened boolean keep-mask, ``<parameter name>.__shape__`` its shape
  (int64), and ``__meta__`` a JSON string (``base_model``, ``method``, ``pattern``, ``sparsity``...).

:func:`open_mask_source` takes a folder, a file or a Hub repo id, finds the mask and its format and the
config it is read with; :func:`source_targets` gives the layers of a model it masks; :class:`LayerMasks`
checks that it covers exactly those layers and reads it one layer at a time (candidate indices, exactly
N:M); :func:`read_mask` reads every layer at once. ``from_pretrained``, ``load_mask``, ``prior=<source>``,
``merge_checkpoint`` and ``hf-maskllm merge`` all read masks here.

An ``.npz`` archive is opened with ``np.load(..., allow_pickle=False)`` only: pickled content is refused
and never unpickled. A boolean mask is N:M when every group of ``m`` inputs keeps at most ``n`` weights;
a group that keeps fewer (a mask read as ``weight != 0`` of a masked model, where a kept weight was
exactly zero) is completed to ``n`` with the positions of the smallest dense weights (those exact
zeros), so ``W * mask`` is unchanged.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
import zipfile
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, MaskFileError, TargetError
from ..hub import is_hub_repo_id
from ..patterns import candidate_patterns
from ..serialization import resolve_folder
from .config import CONFIG_NAME, MaskConfig
from .mask_file import (
    LOGITS_NAME,
    MASKS_NAME,
    load_mask_config,
    open_packed_masks,
    read_logits,
    unpack_layer,
)
from .packing import pack_indices
from .reference_file import REFERENCE_NAME
from .targets import find_targets

__all__ = [
    "FORMATS",
    "PATCH_NAME",
    "LayerMasks",
    "MaskSource",
    "SavedMask",
    "holds_mask",
    "open_mask_source",
    "read_mask",
    "reference_config",
    "resolve_mask_folder",
    "source_targets",
    "warn_other_base_model",
]

FORMATS = ("hf_maskllm", "nvlabs", "patch")
PATCH_NAME = "mask.npz"
_NVLABS_SUFFIX = ".weight.mask"
_PATCH_SHAPE = ".__shape__"
_PATCH_META = "__meta__"
_WEIGHT = ".weight"
_FILE_NAMES = {"nvlabs": REFERENCE_NAME, "patch": PATCH_NAME}


@dataclass
class MaskSource:
    """A mask found: ``path`` (the hf_maskllm folder, or the ``.npz`` file), its ``format`` (one of
    :data:`FORMATS`), the ``config`` it is read with, and PATCH's ``__meta__`` (``{}`` for the others)."""

    path: Path
    format: str
    config: MaskConfig
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def reference(self) -> bool:
        """True for a file that carries no config (NVlabs' or PATCH's ``.npz``)."""
        return self.format != "hf_maskllm"

    @property
    def base_model(self) -> str | None:
        """The model the mask was learned on, as the source records it (NVlabs' file records none)."""
        if self.format == "patch":
            base = self.meta.get("base_model")
            return base if isinstance(base, str) and base else None
        return self.config.base_model_name_or_path if self.format == "hf_maskllm" else None

    def describe(self) -> str:
        """``path`` and, for PATCH, what ``__meta__`` says the mask is."""
        if self.format != "patch":
            return str(self.path)
        told = ", ".join(f"{k}={self.meta[k]!r}" for k in ("method", "pattern") if k in self.meta)
        return f"{self.path} ({told})" if told else str(self.path)


@dataclass
class SavedMask:
    """A mask source read and verified: its config, packed and unpacked hard masks, summary and logits."""

    folder: Path
    config: MaskConfig
    shapes: dict[str, tuple[int, int]]
    packed: dict[str, torch.Tensor]
    indices: dict[str, torch.Tensor]
    summary: dict[str, Any]
    logits: dict[str, torch.Tensor] | None


# ---------------------------------------------------------------------------------------------- finding
def open_mask_source(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    subfolder: str | None = None,
    config: MaskConfig | None = None,
    base_model_name_or_path: str | None = None,
    default: MaskConfig | None = None,
) -> MaskSource:
    """Find the mask ``name_or_path`` names (a folder, an ``.npz`` file or a Hub repo id, optionally its
    ``subfolder``), tell its format from its files, and the config it is read with.

    ``config`` is for a file that carries none (NVlabs' or PATCH's ``.npz``; refused for an hf_maskllm
    folder, which carries its own); without it ``default``, else PATCH's ``__meta__`` pattern (``"2:4"``),
    else ``MaskConfig()``. ``base_model_name_or_path`` fills the config's ``base_model_name_or_path`` when
    the source names no base model.
    """
    if config is not None and not isinstance(config, MaskConfig):
        raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
    npz = _find_npz(name_or_path, revision, subfolder)
    if npz is None:
        if config is not None:
            raise ConfigError(
                f"config= is for a mask file that carries none (NVlabs' {REFERENCE_NAME} or PATCH's {PATCH_NAME}); "
                f"{name_or_path!r} is an hf_maskllm mask folder with its own config. Drop config=."
            )
        folder = _hf_maskllm_folder(name_or_path, revision, subfolder)
        return MaskSource(folder, "hf_maskllm", read_config(folder))
    with _open(npz) as archive:
        patch = _PATCH_META in archive.files or any(k.endswith(_PATCH_SHAPE) for k in archive.files)
        meta = _patch_meta(archive, npz) if patch else {}
    if config is not None:
        cfg = reference_config(config)
    elif default is not None:
        cfg = reference_config(default)
    else:
        cfg = _config_of_pattern(meta.get("pattern")) if patch else MaskConfig()
    source = MaskSource(npz, "patch" if patch else "nvlabs", cfg, meta)
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = source.base_model or base_model_name_or_path or None
    return source


def resolve_mask_folder(
    name_or_path: str | os.PathLike, revision: str | None = None, subfolder: str | None = None
) -> Path:
    """The local folder of a saved hf_maskllm mask (a folder, or a Hub repo id, optionally a subfolder)."""
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    try:
        folder = resolve_folder(
            name_or_path,
            [prefix + CONFIG_NAME, prefix + MASKS_NAME],
            [prefix + LOGITS_NAME, prefix + "README.md"],
            MaskFileError,
            "mask folder",
            revision,
        )
    except MaskFileError as e:
        path = Path(name_or_path).expanduser() / prefix
        named = sorted(p.parent.name for p in path.glob(f"*/{CONFIG_NAME}")) if path.is_dir() else []
        if named:
            raise MaskFileError(
                f"{e} It holds named masks in subfolders {named}: pass the subfolder of the one you want, e.g. "
                f"{str(path / named[0])!r}, or subfolder={named[0]!r}."
            ) from e
        raise
    return folder / prefix if prefix else folder


def _hf_maskllm_folder(name_or_path: str | os.PathLike, revision: str | None, subfolder: str | None) -> Path:
    try:
        return resolve_mask_folder(name_or_path, revision, subfolder)
    except MaskFileError as e:
        path = Path(name_or_path).expanduser()
        if path.is_dir() and not (path / (subfolder or "") / CONFIG_NAME).is_file():
            raise MaskFileError(
                f"{e} It holds no {REFERENCE_NAME} (NVlabs MaskLLM) or {PATCH_NAME} (PATCH) either."
            ) from e
        raise


def _find_npz(name_or_path: str | os.PathLike, revision: str | None, subfolder: str | None) -> Path | None:
    """The local ``.npz`` file ``name_or_path`` names, or ``None`` for an hf_maskllm folder (or nothing:
    the folder reader then says what is missing)."""
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix != ".npz":
            raise MaskFileError(
                f"{path} is a file but not an .npz mask archive; pass an hf_maskllm mask folder, NVlabs' "
                f"{REFERENCE_NAME}, PATCH's {PATCH_NAME}, a folder holding one, or a Hub repo id."
            )
        return path
    if path.is_dir():
        return _npz_in(path / prefix)
    if not is_hub_repo_id(str(name_or_path)):
        return None
    # One download of whichever format the repo holds (files already cached are reused).
    names = (CONFIG_NAME, REFERENCE_NAME, PATCH_NAME)
    folder = resolve_folder(
        name_or_path, [], [prefix + f for f in names], MaskFileError, "mask repo", revision
    )
    return _npz_in(folder / prefix)


def holds_mask(folder: Path) -> bool:
    """Whether ``folder`` holds a mask of any format at its top."""
    return any((folder / name).is_file() for name in (CONFIG_NAME, REFERENCE_NAME, PATCH_NAME))


def _npz_in(folder: Path) -> Path | None:
    if (folder / CONFIG_NAME).is_file():
        return None
    for name in (REFERENCE_NAME, PATCH_NAME):
        if (folder / name).is_file():
            return folder / name
    return None


def read_config(folder: Path) -> MaskConfig:
    """The saved ``MaskConfig`` of an hf_maskllm mask folder, checked for values that cannot be loaded."""
    config = load_mask_config(folder)
    if not -(2**63) <= config.seed < 2**64:  # torch.Generator.manual_seed's range
        raise MaskFileError(
            f"{folder / CONFIG_NAME}: seed={config.seed} is outside [-2**63, 2**64); the file is corrupt. "
            "Fix the field or save the mask again."
        )
    return config


def reference_config(config: MaskConfig | None) -> MaskConfig:
    """The config a file without one is read with: a copy of ``config`` (default ``MaskConfig()``), no prior."""
    if config is None:
        return MaskConfig()
    if not isinstance(config, MaskConfig):
        raise ConfigError(f"config must be a MaskConfig, got {type(config).__name__}: {config!r}.")
    if config.prior is not None:
        raise ConfigError(
            f"config.prior={config.prior!r}: a loaded mask is the hard mask of the file, it has no prior. Drop "
            "prior, or pass the file as MaskConfig(prior=...) to get_mask_model to learn a mask from it."
        )
    config = MaskConfig.from_dict(config.to_dict())  # the caller's object stays as it was
    config.validate()
    return config


def _config_of_pattern(pattern: object) -> MaskConfig:
    """``MaskConfig(n, m)`` of PATCH's ``pattern`` (``"2:4"``; ``"Dense/2:4 tiles"`` gives 2:4 too, and its
    dense tiles are refused when read), ``MaskConfig()`` when it names none."""
    found = re.search(r"(\d+):(\d+)", str(pattern or ""))
    if found and 0 < int(found[1]) < int(found[2]) <= 16:
        return MaskConfig(n=int(found[1]), m=int(found[2]))
    return MaskConfig()


# ---------------------------------------------------------------------------------------------- targets
def source_targets(model: nn.Module, source: MaskSource) -> list[str]:
    """The layers of ``model`` that ``source`` masks: its config's targets and, for PATCH's file, those of
    them the file masks (the others are said in a warning and stay dense). A :class:`MaskFileError` says
    when the mask belongs to another model."""
    config = source.config
    try:
        targets = find_targets(
            model,
            config.target_modules,
            config.exclude_modules,
            config.m,
            strict=source.reference and config.strict,
        )
    except TargetError as e:
        raise MaskFileError(
            f"mask {source.path}: its target_modules / exclude_modules select no layer of this "
            f"{type(model).__name__} ({e}) The mask belongs to another model; load it into the model it was "
            "learned on."
        ) from e
    if source.format != "patch":
        return targets
    with _open(source.path) as archive:
        masked = set(_layer_keys(archive, source.path, "patch"))
    dense = [name for name in targets if name not in masked]
    kept = [name for name in targets if name in masked]
    if dense:
        warnings.warn(
            f"{source.path} masks no weight of {len(dense)} of the {len(targets)} layers the config targets "
            f"({dense[:3]}{'...' if len(dense) > 3 else ''}); they stay dense.",
            stacklevel=3,
        )
    if not kept:
        raise MaskFileError(
            f"{source.describe()} masks none of the layers of this {type(model).__name__} that the config "
            f"targets ({targets[:3]}...); the mask belongs to another model."
        )
    return kept


def warn_other_base_model(source: MaskSource, name_or_path: str | None, stacklevel: int = 3) -> None:
    """Warn when ``source`` records another base model than ``name_or_path``, naming both."""
    saved = source.base_model
    if saved and name_or_path and saved != str(name_or_path):
        warnings.warn(
            f"The mask in {source.path} was learned on {saved!r} and is loaded onto {str(name_or_path)!r}. A mask "
            "only fits the weights it was learned on; if this is the same model saved elsewhere, ignore this "
            "warning.",
            stacklevel=stacklevel,
        )


# ---------------------------------------------------------------------------------------------- reading
class LayerMasks:
    """The hard masks of ``source``, checked to cover exactly the layers in ``shapes`` (``[out, in]``), read
    one layer at a time (:meth:`indices`): a caller working layer by layer never holds every layer's masks
    unpacked. ``transposed``: layers whose parameter is stored ``[in, out]`` (GPT-2 ``Conv1D``);
    ``model_layers``: every module name of the model, to tell a key naming no layer from one naming a layer
    left dense. A context manager."""

    def __init__(
        self,
        source: MaskSource,
        shapes: dict[str, tuple[int, int]],
        transposed: Collection[str] = (),
        model_layers: Collection[str] = (),
    ) -> None:
        self.source, self.shapes, self.transposed = source, shapes, set(transposed)
        n, m = source.config.n, source.config.m
        self._archive: np.lib.npyio.NpzFile | None = None
        self._packed: dict[str, torch.Tensor] = {}
        if source.format == "hf_maskllm":
            self._packed, self.summary = open_packed_masks(source.path / MASKS_NAME, shapes, n, m)
            return
        self._archive = _open(source.path)
        try:
            self._keys = _layer_keys(self._archive, source.path, source.format)
            _check_coverage(source, self._keys, shapes, set(model_layers))
        except BaseException:
            self._archive.close()
            raise
        if source.format == "nvlabs":
            self.summary: dict[str, Any] = {"source": f"MaskLLM reference {REFERENCE_NAME}"}
        else:
            told = {
                k: source.meta[k]
                for k in ("base_model", "method", "variant", "pattern", "sparsity")
                if k in source.meta
            }
            self.summary = {"source": f"PATCH {PATCH_NAME}", **told}

    def __enter__(self) -> LayerMasks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file."""
        if self._archive is not None:
            self._archive.close()

    def indices(self, name: str, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Candidate indices (int64, one per group of ``m`` inputs) of layer ``name``, verified N:M.

        ``weight`` (``[out, in]``, the dense layer's): where a group of a boolean mask keeps fewer than ``n``
        weights, it is completed with the positions of its smallest weights (the lowest positions without it).
        """
        cfg = self.source.config
        if self._archive is None:
            path = self.source.path / MASKS_NAME
            return unpack_layer(path, name, self._packed[name], self.shapes[name], cfg.n, cfg.m)
        mask = self._bool_mask(name)
        return _nm_indices(self.source, name, self._keys[name], mask, cfg.n, cfg.m, weight)

    def packed(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Layer ``name``'s hard mask packed as stored in memory (``packing.py``), of its ``indices``."""
        if self._archive is None:
            return self._packed[name]
        return pack_indices(indices, math.comb(self.source.config.m, self.source.config.n))

    def logits(self) -> dict[str, torch.Tensor] | None:
        """The saved logits of an hf_maskllm folder that has them, verified; ``None`` otherwise."""
        if self._archive is not None or not (self.source.path / LOGITS_NAME).is_file():
            return None
        cfg = self.source.config
        groups_c = {name: (s[0] * s[1] // cfg.m, math.comb(cfg.m, cfg.n)) for name, s in self.shapes.items()}
        return read_logits(self.source.path / LOGITS_NAME, groups_c)

    def _bool_mask(self, name: str) -> torch.Tensor:
        """Layer ``name``'s boolean mask ``[out, in]`` from the archive, its length (and PATCH's shape) checked."""
        path, key = self.source.path, self._keys[name]
        out_f, in_f = self.shapes[name]
        param = [in_f, out_f] if name in self.transposed else [out_f, in_f]
        if self.source.format == "patch":
            stored = _array(self._archive, key + _PATCH_SHAPE, path)
            if stored.dtype.kind not in "iu" or stored.ndim != 1 or stored.tolist() != param:
                raise MaskFileError(
                    f"{path}: {key!r} has shape {stored.tolist()} ({key + _PATCH_SHAPE!r}), but the model's weight "
                    f"of layer {name} is {param}. The mask belongs to another model."
                )
        packed = _array(self._archive, key, path)
        numel = out_f * in_f
        if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != math.ceil(numel / 8):
            raise MaskFileError(
                f"{path}: {key!r} holds {packed.size} {packed.dtype} values (shape {packed.shape}); the layer "
                f"{name} is {param}, so its mask is {math.ceil(numel / 8)} uint8 bytes (np.packbits of {numel} "
                "bits). The mask belongs to another model."
            )
        bits = np.unpackbits(packed)
        del packed
        if bits[numel:].any():
            raise MaskFileError(
                f"{path}: {key!r} has set bits past the end of its mask; the file is corrupt."
            )
        mask = torch.from_numpy(bits[:numel].view(bool))
        return mask.reshape(in_f, out_f).t() if name in self.transposed else mask.reshape(out_f, in_f)


def read_mask(
    source: MaskSource,
    shapes: dict[str, tuple[int, int]],
    transposed: Collection[str] = (),
    model_layers: Collection[str] = (),
    weights: dict[str, torch.Tensor] | None = None,
) -> SavedMask:
    """Every layer of ``source`` for the layers in ``shapes`` (and an hf_maskllm folder's logits), verified;
    ``weights``: the dense ``[out, in]`` weights that complete groups keeping fewer than ``n`` (:class:`LayerMasks`)."""
    with LayerMasks(source, shapes, transposed, model_layers) as masks:
        indices, packed = {}, {}
        for name in shapes:
            indices[name] = masks.indices(name, None if weights is None else weights.get(name))
            packed[name] = masks.packed(name, indices[name])
        logits = masks.logits()
        return SavedMask(
            source.path, source.config, dict(shapes), packed, indices, dict(masks.summary), logits
        )


# ---------------------------------------------------------------------------------------------- checks
def _nm_indices(
    source: MaskSource,
    name: str,
    key: str,
    mask: torch.Tensor,
    n: int,
    m: int,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """The candidate indices of a boolean mask that keeps at most ``n`` of every ``m``; refused otherwise."""
    out_f, in_f = mask.shape
    if in_f % m:
        raise MaskFileError(
            f"{source.path}: layer {name} has {in_f} inputs, not a multiple of m={m}; it cannot hold an {n}:{m} "
            "mask. Leave it dense with MaskConfig(exclude_modules=[...]), or pass the file's N:M."
        )
    groups = mask.reshape(-1, m)
    kept = _count_kept(groups)
    over = kept > n
    if bool(over.any()):
        bad = int(over.nonzero()[0, 0])
        told = (
            f" Its __meta__ says pattern={source.meta.get('pattern')!r}." if source.format == "patch" else ""
        )
        raise MaskFileError(
            f"{source.path}: the mask of {name} ({key!r}) is not {n}:{m}: {float(over.float().mean()):.1%} of its "
            f"{groups.shape[0]} groups keep more than {n} of {m} weights (group {bad} of its rows keeps "
            f"{int(kept[bad])}).{told} Only an N:M mask can be loaded; if it was learned with another N:M, pass "
            "it (MaskConfig(n=..., m=...))."
        )
    under = kept < n
    del kept, over
    if bool(under.any()):
        # Complete each group that keeps fewer than n with its smallest dense weights (exact zeros where the
        # mask was read as weight != 0), so W * mask does not change; lowest positions without weights.
        if weight is not None:
            score = weight.detach().reshape(-1, m)[under.to(weight.device)].abs().float().cpu()
        else:
            score = torch.zeros(int(under.sum()), m)
        score[groups[under]] = -1.0  # the kept positions first
        order = torch.sort(score, dim=1, stable=True).indices[:, :n]
        groups[under] = torch.zeros_like(score, dtype=torch.bool).scatter_(1, order, True)
    # Candidate index of every group by its m-bit code (1 byte per group for m <= 8): a layer's transient
    # memory stays near its packed mask's, not 8 bytes per weight.
    code_dtype = torch.uint8 if m <= 8 else torch.int32
    codes = torch.zeros(groups.shape[0], dtype=code_dtype)
    for j in range(m):
        codes |= groups[:, j].to(code_dtype) << j
    bits = 2 ** torch.arange(m)
    cand_codes = (candidate_patterns(n, m, dtype=torch.long) * bits).sum(dim=1)
    lookup = torch.full((2**m,), -1, dtype=torch.long)
    lookup[cand_codes] = torch.arange(cand_codes.numel())
    return lookup[codes.long()]


def _count_kept(groups: torch.Tensor) -> torch.Tensor:
    """How many weights each group ``[G, m]`` keeps (uint8 for m < 256)."""
    kept = groups[:, 0].to(torch.uint8)
    for j in range(1, groups.shape[1]):
        kept += groups[:, j]
    return kept


def _layer_keys(archive: np.lib.npyio.NpzFile, path: Path, fmt: str) -> dict[str, str]:
    """``{layer name: key of its mask}`` of an archive in format ``fmt``; a key of no mask is refused."""
    keys: dict[str, str] = {}
    files = set(archive.files)
    for key in archive.files:
        if fmt == "nvlabs":
            if not key.endswith(_NVLABS_SUFFIX):
                raise MaskFileError(
                    f"{path}: key {key!r} is not a mask of a weight ('<layer>.weight.mask'); the file is not a "
                    f"MaskLLM {REFERENCE_NAME}, or was edited."
                )
            keys[key[: -len(_NVLABS_SUFFIX)]] = key
            continue
        if key == _PATCH_META:
            continue
        if key.endswith(_PATCH_SHAPE):
            if key[: -len(_PATCH_SHAPE)] not in files:
                raise MaskFileError(
                    f"{path}: {key!r} is the shape of no mask in the file; the file was edited."
                )
            continue
        if not key.endswith(_WEIGHT):
            raise MaskFileError(
                f"{path}: key {key!r} is not a mask of a weight ('<layer>.weight', with '<layer>.weight.__shape__'); "
                f"the file is not a PATCH {PATCH_NAME}, or was edited."
            )
        if key + _PATCH_SHAPE not in files:
            raise MaskFileError(
                f"{path}: {key!r} has no {key + _PATCH_SHAPE!r}; the file is corrupt or was edited."
            )
        keys[key[: -len(_WEIGHT)]] = key
    return keys


def _check_coverage(
    source: MaskSource, keys: dict[str, str], shapes: dict[str, tuple[int, int]], model_layers: set[str]
) -> None:
    path = source.path
    unknown = sorted(name for name in keys if name not in shapes and name not in model_layers)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(set(shapes) | model_layers), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        verb = "names" if len(unknown) == 1 else f"({len(unknown)} keys) name"
        raise MaskFileError(
            f"{path}: {[keys[k] for k in unknown[:3]]}{'...' if len(unknown) > 3 else ''} {verb} no layer of this "
            f"model.{hint} The mask belongs to another model."
        )
    for name, key in sorted(keys.items()):
        if name not in shapes:
            raise MaskFileError(
                f"{path}: {key!r} masks layer {name}, which this MaskConfig leaves dense; add it to "
                "target_modules (or remove it from exclude_modules)."
            )
    missing = sorted(set(shapes) - set(keys))
    if missing:
        raise MaskFileError(
            f"{path} holds no mask for {len(missing)} masked layer(s): {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}. Leave them dense with MaskConfig(exclude_modules=[...]), or "
            "use the mask file of this model."
        )


def _patch_meta(archive: np.lib.npyio.NpzFile, path: Path) -> dict[str, Any]:
    """PATCH's ``__meta__`` (a JSON string) as a dict; ``{}`` when the file has none."""
    if _PATCH_META not in archive.files:
        return {}
    value = _array(archive, _PATCH_META, path)
    try:
        if value.dtype.kind in "US" and value.size == 1:
            text = value.item()
            text = text.decode() if isinstance(text, bytes) else text
        elif value.dtype == np.uint8 and value.ndim == 1:
            text = value.tobytes().decode()
        else:
            raise ValueError(f"a {value.dtype} array of shape {value.shape}")
        meta = json.loads(text)
    except ValueError as e:
        raise MaskFileError(f"{path}: '__meta__' is not a JSON string ({e}); the file is corrupt.") from None
    if not isinstance(meta, dict):
        raise MaskFileError(f"{path}: '__meta__' is not a JSON object; the file is corrupt.")
    return meta


def _open(path: Path) -> np.lib.npyio.NpzFile:
    """The ``.npz`` archive at ``path``, opened without unpickling anything."""
    try:
        archive = np.load(path, allow_pickle=False)
    except ValueError as e:  # a pickle (or a .npy of objects): np.load refuses it, and so do we
        raise MaskFileError(
            f"{path} holds pickled data ({e}); hf_maskllm never unpickles a file it is given. Use NVlabs' "
            f"{REFERENCE_NAME}, PATCH's {PATCH_NAME} (np.packbits arrays only) or an hf_maskllm mask folder."
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise MaskFileError(
            f"{path} is not a readable .npz archive ({type(e).__name__}: {e}); download or save it again."
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise MaskFileError(f"{path} is a single .npy array, not an .npz archive of masks keyed by layer.")
    return archive


def _array(archive: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as e:  # an object array: loading it would unpickle
        raise MaskFileError(
            f"{path}: {key!r} holds pickled objects ({e}); hf_maskllm never unpickles a file it is given. "
            "The file is not a mask archive."
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise MaskFileError(f"{path}: {key!r} cannot be read ({e}); the file is corrupt.") from None
