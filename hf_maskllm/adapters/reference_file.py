"""The MaskLLM reference implementation's mask file, ``mask_compressed.npz``: written.

NVlabs/MaskLLM publishes its learned masks as one ``.npz`` archive (written by its
``tool_compress_mask.py``, applied by its ``eval_llama_ppl.py``): for every masked weight, the key
``<parameter name>.mask`` (the parameter's name in the transformers model, e.g.
``model.layers.0.self_attn.q_proj.weight.mask``) holds ``np.packbits`` of the flattened boolean mask
in the parameter's own shape (bits big-endian within a byte, the last byte padded with zeros).
``save_pretrained(dir, format="npz")`` writes it here, streaming one layer at a time into the archive,
so the whole model's masks are never held unpacked at once; it is read by the one reader of every mask
source, ``mask_source.py``.
"""

from __future__ import annotations

import zipfile
from collections.abc import Collection, Iterable
from pathlib import Path

import numpy as np
import torch

from ..serialization import atomic_write

__all__ = ["REFERENCE_NAME", "write_reference_file"]

REFERENCE_NAME = "mask_compressed.npz"
_SUFFIX = ".weight.mask"


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
