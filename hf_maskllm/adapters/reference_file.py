"""The MaskLLM reference implementation's mask file, ``mask_compressed.npz``: found, read and written.

NVlabs/MaskLLM publishes its learned masks as one ``.npz`` archive (written by its
``tool_compress_mask.py``, applied by its ``eval_llama_ppl.py``): for every masked weight, the key
``<parameter name>.mask`` (the parameter's name in the transformers model, e.g.
``model.layers.0.self_attn.q_proj.weight.mask``) holds ``np.packbits`` of the flattened boolean mask
in the parameter's own shape (bits big-endian within a byte, the last byte padded with zeros). A Hub
repo with that file at its root is a published mask.

Reading uses ``np.load(..., allow_pickle=False)`` only: an archive holding pickled objects is refused
and nothing in it is unpickled. Every mask is checked to cover exactly the masked layers, to have the
length its layer's shape gives, and to be exactly N:M before it is used. Writing streams one layer at a
time into the archive, so the whole model's masks are never held unpacked at once.
"""

from __future__ import annotations

import difflib
import math
import os
import zipfile
from collections.abc import Collection, Iterable
from pathlib import Path

import numpy as np
import torch

from ..errors import MaskFileError, NMViolationError
from ..hub import is_hub_repo_id
from ..patterns import mask_to_indices
from ..serialization import atomic_write, resolve_folder
from .config import CONFIG_NAME

__all__ = [
    "REFERENCE_NAME",
    "ReferenceMasks",
    "find_reference_file",
    "read_reference_indices",
    "write_reference_file",
]

REFERENCE_NAME = "mask_compressed.npz"
_SUFFIX = ".weight.mask"


def find_reference_file(
    name_or_path: str | os.PathLike, revision: str | None = None, subfolder: str | None = None
) -> Path | None:
    """The local path of the reference mask file ``name_or_path`` names, or ``None`` when it names an
    hf_maskllm mask folder (or nothing that exists: the hf_maskllm loader then says what is wrong).

    A ``.npz`` file; a folder holding ``mask_compressed.npz`` and no ``mask_config.json``; or a Hub repo
    id (``owner/name``) whose root (or ``subfolder``) holds ``mask_compressed.npz`` and no
    ``mask_config.json``.
    """
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path if path.suffix == ".npz" else None
    if path.is_dir():
        folder = path / prefix
        is_reference = (folder / REFERENCE_NAME).is_file() and not (folder / CONFIG_NAME).is_file()
        return folder / REFERENCE_NAME if is_reference else None
    if not is_hub_repo_id(str(name_or_path)):
        return None
    # One download of whichever of the two formats the repo holds (the files already cached are reused).
    folder = resolve_folder(
        name_or_path,
        [],
        [prefix + CONFIG_NAME, prefix + REFERENCE_NAME],
        MaskFileError,
        "mask repo",
        revision,
    )
    folder = folder / prefix
    if (folder / REFERENCE_NAME).is_file() and not (folder / CONFIG_NAME).is_file():
        return folder / REFERENCE_NAME
    return None


def read_reference_indices(
    path: Path,
    shapes: dict[str, tuple[int, int]],
    n: int,
    m: int,
    transposed: Collection[str] = (),
    model_layers: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Candidate indices (``[out*in/m]`` int64) of every layer in ``shapes`` (``[out, in]``), read from
    the reference archive ``path`` and verified.

    ``transposed``: layers whose parameter is stored ``[in, out]`` (GPT-2 ``Conv1D``); ``model_layers``:
    every module name of the model, to tell a key naming no layer from one naming a layer left dense.
    Raises :class:`MaskFileError` naming the key or layer at fault.
    """
    with ReferenceMasks(path, shapes, n, m, transposed, model_layers) as masks:
        return {name: masks.indices(name) for name in shapes}


class ReferenceMasks:
    """An open reference archive, checked to cover exactly the layers in ``shapes``; :meth:`indices`
    reads and verifies one layer at a time (the archive is decompressed entry by entry), so a caller
    that works layer by layer never holds the whole model's masks unpacked. A context manager."""

    def __init__(
        self,
        path: Path,
        shapes: dict[str, tuple[int, int]],
        n: int,
        m: int,
        transposed: Collection[str] = (),
        model_layers: Collection[str] = (),
    ) -> None:
        self.path, self.shapes, self.n, self.m = path, shapes, n, m
        self.transposed = set(transposed)
        self.archive = _open(path)
        try:
            self.keys: dict[str, str] = {}
            for key in self.archive.files:
                if not key.endswith(_SUFFIX):
                    raise MaskFileError(
                        f"{path}: key {key!r} is not a mask of a weight ('<layer>.weight.mask'); the file is not a "
                        "MaskLLM mask_compressed.npz, or was edited."
                    )
                self.keys[key[: -len(_SUFFIX)]] = key
            _check_coverage(path, self.keys, shapes, set(model_layers))
        except BaseException:
            self.archive.close()
            raise

    def __enter__(self) -> ReferenceMasks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the archive."""
        self.archive.close()

    def indices(self, name: str) -> torch.Tensor:
        """Candidate indices (``[out*in/m]`` int64) of layer ``name``, read and verified."""
        path, n, m = self.path, self.n, self.m
        out_f, in_f = self.shapes[name]
        key = self.keys[name]
        packed = _array(self.archive, key, path)
        numel = out_f * in_f
        if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != math.ceil(numel / 8):
            raise MaskFileError(
                f"{path}: {key!r} holds {packed.size} {packed.dtype} values (shape {packed.shape}); the layer "
                f"{name} is {_param_shape(name, out_f, in_f, self.transposed)}, so its mask is "
                f"{math.ceil(numel / 8)} uint8 bytes (np.packbits of {numel} bits). The mask belongs to another "
                "model."
            )
        bits = np.unpackbits(packed)
        del packed
        if bits[numel:].any():
            raise MaskFileError(
                f"{path}: {key!r} has set bits past the end of its mask; the file is corrupt."
            )
        mask = torch.from_numpy(bits[:numel].view(bool))
        mask = mask.reshape(in_f, out_f).t() if name in self.transposed else mask.reshape(out_f, in_f)
        try:
            return mask_to_indices(mask, n, m)
        except NMViolationError as e:
            kept = mask.reshape(-1, m).sum(dim=1)
            bad = int((kept != n).nonzero()[0, 0])
            raise MaskFileError(
                f"{path}: the mask of {name} ({key!r}) is not {n}:{m}: {e} (group {bad} of its rows keeps "
                f"{int(kept[bad])}). Pass the N:M it was learned with (MaskConfig(n=..., m=...))."
            ) from None


def write_reference_file(
    path: Path, masks: Iterable[tuple[str, torch.Tensor]], transposed: Collection[str] = ()
) -> None:
    """Atomically write ``(layer name, [out, in] bool mask)`` pairs as a reference ``mask_compressed.npz``.

    Streams: each mask is packed and compressed into the archive before the next one is asked for.
    """
    with atomic_write(path) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, mask in masks:
            mask = mask.detach().bool().cpu()
            stored = mask.t() if name in transposed else mask  # the parameter's own layout
            packed = np.packbits(stored.contiguous().numpy().reshape(-1))
            with archive.open(name + _SUFFIX + ".npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, packed, allow_pickle=False)


def _open(path: Path) -> np.lib.npyio.NpzFile:
    try:
        archive = np.load(path, allow_pickle=False)
    except ValueError as e:  # a pickle (or a .npy of objects): np.load refuses it, and so do we
        raise MaskFileError(
            f"{path} holds pickled data ({e}); hf_maskllm never unpickles a file it is given. Use the reference's "
            "mask_compressed.npz (np.packbits arrays only) or an hf_maskllm mask folder."
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise MaskFileError(
            f"{path} is not a readable .npz archive ({type(e).__name__}: {e}); download or save it again."
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise MaskFileError(
            f"{path} is a single .npy array, not an .npz archive of masks keyed '<layer>.weight.mask'."
        )
    return archive


def _array(archive: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as e:  # an object array: loading it would unpickle
        raise MaskFileError(
            f"{path}: {key!r} holds pickled objects ({e}); hf_maskllm never unpickles a file it is given. "
            "The file is not a MaskLLM mask_compressed.npz."
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise MaskFileError(f"{path}: {key!r} cannot be read ({e}); the file is corrupt.") from None


def _check_coverage(
    path: Path, by_layer: dict[str, str], shapes: dict[str, tuple[int, int]], model_layers: set[str]
) -> None:
    for name, key in sorted(by_layer.items()):
        if name in shapes:
            continue
        if name in model_layers:
            raise MaskFileError(
                f"{path}: {key!r} masks layer {name}, which this MaskConfig leaves dense; add it to "
                "target_modules (or remove it from exclude_modules)."
            )
        close = difflib.get_close_matches(name, sorted(set(shapes) | model_layers), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise MaskFileError(
            f"{path}: {key!r} names no layer of this model ({name!r}).{hint} The mask belongs to another model."
        )
    missing = sorted(set(shapes) - set(by_layer))
    if missing:
        raise MaskFileError(
            f"{path} holds no mask for {len(missing)} masked layer(s): {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}. Leave them dense with MaskConfig(exclude_modules=[...]), or "
            "use the mask file of this model."
        )


def _param_shape(name: str, out_f: int, in_f: int, transposed: Collection[str]) -> list[int]:
    return [in_f, out_f] if name in transposed else [out_f, in_f]
