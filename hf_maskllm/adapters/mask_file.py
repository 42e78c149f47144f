"""The saved-mask folder: ``mask_config.json`` + ``mask_model.safetensors`` (+ logits) + ``README.md``.

``mask_model.safetensors`` holds, for every masked layer ``<name>`` (its name in the base model):

- ``<name>.mask``: uint8, the hard mask's candidate indices packed in base C (see ``packing.py``);
- ``<name>.shape``: int64 ``[2]``, the layer's ``[out, in]``.

Its metadata records ``format``, ``format_version``, ``n``, ``m``, a JSON training summary and a JSON
``crc32`` per layer of the packed bytes: most flipped bits still decode to a valid mask, so only the
checksum turns silent corruption into an error.
``mask_logits.safetensors`` (optional) holds ``<name>.logits`` ``[out*in/m, C(m,n)]`` to resume
training or to seed a new run.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from ..errors import MaskFileError
from ..serialization import load_safetensors, save_safetensors
from .config import FORMAT_VERSION
from .packing import pack_indices, unpack_indices

__all__ = ["LOGITS_NAME", "MASKS_NAME", "read_logits", "read_masks", "write_logits", "write_masks"]

MASKS_NAME = "mask_model.safetensors"
LOGITS_NAME = "mask_logits.safetensors"
FORMAT_TAG = "hf_maskllm.mask"


def write_masks(
    path: Path,
    indices: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, int]],
    n: int,
    m: int,
    summary: dict[str, Any] | None = None,
) -> None:
    """Atomically write packed hard masks (candidate indices per layer) to ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    checksums: dict[str, int] = {}
    for name, idx in indices.items():
        tensors[f"{name}.mask"] = pack_indices(idx, math.comb(m, n))
        tensors[f"{name}.shape"] = torch.tensor(shapes[name], dtype=torch.int64)
        checksums[name] = _crc32(tensors[f"{name}.mask"])
    metadata = {
        "crc32": json.dumps(checksums, sort_keys=True),
        "format": FORMAT_TAG,
        "format_version": str(FORMAT_VERSION),
        "n": str(n),
        "m": str(m),
        "summary": json.dumps(summary or {}, sort_keys=True),
    }
    save_safetensors(tensors, path, metadata=metadata)


def _crc32(packed: torch.Tensor) -> int:
    return zlib.crc32(packed.contiguous().numpy().tobytes())


def _check_header(path: Path, metadata: dict[str, str], n: int, m: int) -> None:
    if metadata.get("format") != FORMAT_TAG:
        raise MaskFileError(
            f"{path} is not an hf_maskllm mask file (metadata format={metadata.get('format')!r})."
        )
    try:
        version, file_n, file_m = int(metadata["format_version"]), int(metadata["n"]), int(metadata["m"])
    except (KeyError, ValueError):
        raise MaskFileError(f"{path} has incomplete metadata {metadata}; save the mask again.") from None
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


def read_masks(
    path: Path, shapes: dict[str, tuple[int, int]], n: int, m: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and validate packed masks for exactly the layers in ``shapes``; returns indices and summary."""
    tensors, metadata = load_safetensors(path, error=MaskFileError, what="mask file")
    _check_header(path, metadata, n, m)
    stored = {k[: -len(".mask")] for k in tensors if k.endswith(".mask")}
    missing, extra = sorted(set(shapes) - stored), sorted(stored - set(shapes))
    if missing or extra:
        raise MaskFileError(
            f"{path} was saved for other layers: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}. Load it into the model (and "
            "target_modules) it was learned on."
        )
    try:
        checksums = json.loads(metadata["crc32"])
        if not isinstance(checksums, dict):
            raise TypeError
    except (KeyError, TypeError, json.JSONDecodeError):
        raise MaskFileError(f"{path} has no valid `crc32` metadata; save the mask again.") from None
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        stored_shape = tensors.get(f"{name}.shape")
        if (
            stored_shape is None
            or stored_shape.dtype != torch.int64
            or tuple(stored_shape.tolist()) != tuple(shape)
        ):
            got = None if stored_shape is None else stored_shape.tolist()
            raise MaskFileError(
                f"{path}: layer {name} was saved with shape {got}, but the model's is {list(shape)}; "
                "the mask belongs to another model."
            )
        packed = tensors[f"{name}.mask"]
        if packed.dtype == torch.uint8 and checksums.get(name) != _crc32(packed):
            raise MaskFileError(f"{path}: the packed mask of {name} fails its checksum; the file is corrupt.")
        groups = shape[0] * shape[1] // m
        out[name] = unpack_indices(tensors[f"{name}.mask"], groups, math.comb(m, n))
    try:
        summary = json.loads(metadata.get("summary", "{}"))
    except json.JSONDecodeError:
        summary = {}
    return out, summary if isinstance(summary, dict) else {}


def write_logits(path: Path, logits: dict[str, torch.Tensor]) -> None:
    """Atomically write raw logits per layer."""
    save_safetensors(
        {f"{k}.logits": v for k, v in logits.items()}, path, metadata={"format": FORMAT_TAG + ".logits"}
    )


def read_logits(path: Path, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Read raw logits for exactly the layers whose expected logit shapes are given; checks finiteness."""
    tensors, _ = load_safetensors(path, error=MaskFileError, what="logits file")
    out = {}
    for name, shape in shapes.items():
        t = tensors.get(f"{name}.logits")
        if t is None or tuple(t.shape) != tuple(shape):
            raise MaskFileError(
                f"{path}: logits of {name} are {None if t is None else tuple(t.shape)}, expected {tuple(shape)}; "
                "they belong to another model or N:M."
            )
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise MaskFileError(f"{path}: logits of {name} are not finite floats; the file is corrupt.")
        out[name] = t
    return out
