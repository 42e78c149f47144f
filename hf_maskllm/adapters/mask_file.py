"""The saved-mask folder: ``mask_config.json`` + ``mask_model.safetensors`` (+ logits) + ``README.md``.

``mask_model.safetensors`` holds, for every masked layer ``<name>`` (its name in the base model):

- ``<name>.mask``: uint8, the hard mask's candidate indices packed in base C (see ``packing.py``);
- ``<name>.shape``: int64 ``[2]``, the layer's ``[out, in]``.

Its metadata records ``format``, ``format_version``, ``n``, ``m``, a JSON training summary (with its
``summary_crc32``) and a JSON ``crc32`` per layer of the packed bytes: most flipped bits still decode
to a valid mask, so only the checksum turns silent corruption into an error.
``mask_logits.safetensors`` (optional) holds ``<name>.logits`` ``[out*in/m, C(m,n)]`` to resume
training or to seed a new run, with a ``crc32`` per layer of the same kind.

Writers verify the N:M invariant before writing (every index in ``[0, C(m, n))``, one per group);
readers verify it after reading (chunk range, padding, checksums), so a loaded mask is exactly N:M.
The one reader of every mask source (``mask_source.py``) reads a folder through :func:`open_packed_masks`
and :func:`unpack_layer`, one layer at a time.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from ..errors import MaskFileError, NMViolationError
from ..serialization import load_safetensors, save_safetensors, stored_checksums
from .config import CONFIG_NAME, FORMAT_VERSION, MaskConfig
from .packing import pack_indices, unpack_indices

__all__ = [
    "LOGITS_NAME",
    "MASKS_NAME",
    "load_mask_config",
    "open_packed_masks",
    "read_logits",
    "unpack_layer",
    "write_logits",
    "write_masks",
]

MASKS_NAME = "mask_model.safetensors"
LOGITS_NAME = "mask_logits.safetensors"
FORMAT_TAG = "hf_maskllm.mask"
LOGITS_TAG = FORMAT_TAG + ".logits"


def write_masks(
    path: Path,
    indices: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    n: int,
    m: int,
    summary: dict[str, Any] | None = None,
) -> None:
    """Atomically write packed hard masks (candidate indices per layer) to ``path``.

    Verifies first that every layer has one candidate index in ``[0, C(m, n))`` per group of ``m``
    inputs (so the mask is exactly N:M); raises :class:`NMViolationError` before writing otherwise.
    """
    tensors: dict[str, torch.Tensor] = {}
    checksums: dict[str, int] = {}
    num_candidates = math.comb(m, n)
    for name, idx in indices.items():
        out_f, in_f = shapes[name]
        if in_f % m or idx.numel() != out_f * in_f // m:
            raise NMViolationError(
                f"Mask of {name} has {idx.numel()} groups for a [{out_f}, {in_f}] layer, expected "
                f"{out_f * in_f // m if not in_f % m else 'in divisible by m'} groups of {m}; refusing to save it."
            )
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_candidates):
            raise NMViolationError(
                f"Mask of {name} holds candidate indices outside [0, {num_candidates}), so it is not {n}:{m}; "
                "refusing to save it. Recompute it from the logits (hard_indices)."
            )
        tensors[f"{name}.mask"] = pack_indices(idx, num_candidates)
        tensors[f"{name}.shape"] = torch.tensor(shapes[name], dtype=torch.int64)
        checksums[name] = _crc32(tensors[f"{name}.mask"])
    summary_json = json.dumps(summary or {}, sort_keys=True)
    metadata = {
        "crc32": json.dumps(checksums, sort_keys=True),
        "format": FORMAT_TAG,
        "format_version": str(FORMAT_VERSION),
        "n": str(n),
        "m": str(m),
        "summary": summary_json,
        "summary_crc32": str(zlib.crc32(summary_json.encode())),
    }
    save_safetensors(tensors, path, metadata=metadata)


def _crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def load_mask_config(folder: Path) -> MaskConfig:
    """``MaskConfig.from_pretrained(folder)`` for a local mask folder; every error names a fix."""
    try:
        return MaskConfig.from_pretrained(folder)
    except MaskFileError as e:
        if not _values_at_fault(folder / CONFIG_NAME):
            raise  # missing, not JSON, or written by a newer hf_maskllm: the message names the fix
        raise MaskFileError(f"{e} Fix {CONFIG_NAME}, or save the mask again.") from None


def _values_at_fault(path: Path) -> bool:
    """Whether ``path`` is JSON of a format version this hf_maskllm reads, so that a failed load is its values' fault."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the reader's own error says what is wrong with the file
        return False
    version = data.get("format_version") if isinstance(data, dict) else None
    return not (isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION)


def _check_header(path: Path, metadata: dict[str, str], n: int, m: int) -> None:
    if metadata.get("format") != FORMAT_TAG:
        raise MaskFileError(
            f"{path} is not an hf_maskllm mask file (metadata format={metadata.get('format')!r}); "
            "pass a folder written by MaskModel.save_pretrained, or save the mask again."
        )
    try:
        version, file_n, file_m = int(metadata["format_version"]), int(metadata["n"]), int(metadata["m"])
    except (KeyError, ValueError):
        raise MaskFileError(
            f"{path} has incomplete metadata (format_version, n, m): {sorted(metadata)}; the file is corrupt, "
            "save the mask again."
        ) from None
    if version < 1:
        raise MaskFileError(
            f"{path} has an invalid format_version {version}; the file is corrupt, save it again."
        )
    if version > FORMAT_VERSION:
        raise MaskFileError(
            f"{path} uses mask format version {version}, newer than this hf_maskllm supports "
            f"({FORMAT_VERSION}); upgrade with `pip install -U hf_maskllm`."
        )
    if (file_n, file_m) != (n, m):
        raise MaskFileError(
            f"{path} holds {file_n}:{file_m} masks but {n}:{m} was expected; use a MaskConfig with "
            f"n={file_n}, m={file_m}, or a mask saved for {n}:{m}."
        )


def open_packed_masks(
    path: Path, shapes: dict[str, tuple[int, int]], n: int, m: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The packed bytes per layer (uint8, as stored) and the summary of the mask file ``path``, checked for
    the layers in ``shapes`` (header, coverage, shapes, checksums); :func:`unpack_layer` decodes a layer."""
    tensors, metadata = load_safetensors(path, error=MaskFileError, what="mask file")
    _check_header(path, metadata, n, m)
    stored = {k[: -len(".mask")] for k in tensors if k.endswith(".mask")}
    missing, extra = sorted(set(shapes) - stored), sorted(stored - set(shapes))
    unknown = sorted(
        k for k in tensors if not k.endswith((".mask", ".shape")) or k[: k.rindex(".")] not in stored
    )
    if missing or extra:
        raise MaskFileError(
            f"{path} was saved for other layers: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}. Load it into the model (and "
            "target_modules) it was learned on."
        )
    if unknown:
        raise MaskFileError(
            f"{path} holds tensors that are not part of a saved mask: {unknown[:3]}; the file is corrupt or was "
            "edited. Save the mask again."
        )
    checksums = stored_checksums(metadata, "crc32", path, MaskFileError, "Mask file")
    summary_json = metadata.get("summary", "{}")
    if metadata.get("summary_crc32") != str(zlib.crc32(summary_json.encode())):
        raise MaskFileError(
            f"{path}: the training summary fails its checksum; the file is corrupt, save it again."
        )
    packed_out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        stored_shape = tensors.get(f"{name}.shape")
        if (
            stored_shape is None
            or stored_shape.dtype != torch.int64
            or stored_shape.dim() != 1
            or tuple(stored_shape.tolist()) != tuple(shape)
        ):
            got = None if stored_shape is None else stored_shape.tolist()
            raise MaskFileError(
                f"{path}: layer {name} was saved with shape {got}, but the model's is {list(shape)}; "
                "the mask belongs to another model. Load it into the model it was learned on."
            )
        packed = tensors[f"{name}.mask"]
        if packed.dtype == torch.uint8 and checksums.get(name) != _crc32(packed):
            raise MaskFileError(
                f"{path}: the packed mask of {name} fails its checksum; the file is corrupt. "
                "Save or download it again."
            )
        packed_out[name] = packed
    try:
        summary = json.loads(summary_json)
    except json.JSONDecodeError:
        summary = None
    if not isinstance(summary, dict):
        raise MaskFileError(
            f"{path}: the training summary is not a JSON object; the file is corrupt, save it again."
        )
    return packed_out, summary


def unpack_layer(
    path: Path, name: str, packed: torch.Tensor, shape: tuple[int, int], n: int, m: int
) -> torch.Tensor:
    """The candidate indices (int64, one per group) of layer ``name`` from its packed bytes; a byte
    string that does not decode to ``shape``'s groups raises :class:`MaskFileError` naming the layer."""
    try:
        return unpack_indices(packed, shape[0] * shape[1] // m, math.comb(m, n))
    except MaskFileError as e:
        raise MaskFileError(f"{path}: layer {name}: {e}") from None


def write_logits(path: Path, logits: dict[str, torch.Tensor]) -> None:
    """Atomically write raw logits per layer (refuses NaN / inf), with a CRC-32 per layer."""
    for name, t in logits.items():
        if not bool(torch.isfinite(t).all()):
            raise MaskFileError(f"Logits of {name} contain NaN or inf; refusing to save them.")
    checksums = {name: _crc32(t) for name, t in logits.items()}
    # the CRC covers the bytes, not how they are read: a header relabelled bfloat16 <-> float16 keeps them
    dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in logits.items()}
    metadata = {
        "format": LOGITS_TAG,
        "crc32": json.dumps(checksums, sort_keys=True),
        "dtypes": json.dumps(dtypes, sort_keys=True),
    }
    save_safetensors({f"{k}.logits": v for k, v in logits.items()}, path, metadata=metadata)


def read_logits(path: Path, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Read raw logits for exactly the layers whose expected logit shapes are given; checks finiteness."""
    tensors, metadata = load_safetensors(path, error=MaskFileError, what="logits file")
    if metadata.get("format") != LOGITS_TAG:
        raise MaskFileError(
            f"{path} is not an hf_maskllm logits file (metadata format={metadata.get('format')!r}); "
            f"delete it to load the hard masks alone, or save the mask again with save_logits=True."
        )
    checksums = stored_checksums(metadata, "crc32", path, MaskFileError, "Mask file")
    # the dtype each layer was saved in (files written before hf_maskllm recorded it have none)
    dtypes = (
        stored_checksums(metadata, "dtypes", path, MaskFileError, "Mask file") if "dtypes" in metadata else {}
    )
    extra = sorted(set(tensors) - {f"{name}.logits" for name in shapes})
    if extra:
        raise MaskFileError(
            f"{path} holds logits of layers the mask lacks: {extra[:3]}; it belongs to another mask. "
            "Delete it or save the mask again."
        )
    out = {}
    for name, shape in shapes.items():
        t = tensors.get(f"{name}.logits")
        if t is None or tuple(t.shape) != tuple(shape):
            raise MaskFileError(
                f"{path}: logits of {name} are {None if t is None else tuple(t.shape)}, expected {tuple(shape)}; "
                "they belong to another model or N:M. Delete the file or save the mask again."
            )
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise MaskFileError(
                f"{path}: logits of {name} are not finite floats; the file is corrupt. Delete it to load the "
                "hard masks alone, or save the mask again."
            )
        stored_as = str(t.dtype).removeprefix("torch.")
        relabelled = bool(dtypes) and dtypes.get(name) != stored_as
        if checksums.get(name) != _crc32(t) or relabelled:
            detail = f" (stored as {stored_as}, saved as {dtypes.get(name)})" if relabelled else ""
            raise MaskFileError(
                f"{path}: logits of {name} fail their checksum{detail}; the file is corrupt. Delete it to load "
                "the hard masks alone, or save the mask again."
            )
        out[name] = t
    return out
