"""Quantize the kept values of compressed N:M layers to int8 / int4 (format version 2).

:func:`quantize_rtn` is round-to-nearest, symmetric, one float16 scale per ``group_size`` kept values
of a row: ``scale = absmax / qmax`` rounded to float16 first, ``q = clamp(round(v / scale))`` (an
all-zero group gets scale 0 and codes 0). :func:`quantize_layers` quantizes the chosen layers of a
model, by round-to-nearest or, given calibration token ids, by the error-compensating method of
:mod:`hf_maskllm.sparse.gptq` (the mask never changes either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from .format import check_group_size, pack_codes, qmax, value_bits

__all__ = ["DEFAULT_GROUP_SIZE", "calibration_ids", "quantize_layers", "quantize_rtn", "resolve_values"]

DEFAULT_GROUP_SIZE = 32  # kept values per scale, for int8 and int4


def resolve_values(values: str | None, group_size: int | None) -> tuple[int | None, int | None]:
    """``(bits, group_size)`` of a value type (``None``, ``"float"``: ``(None, None)``), checking the arguments."""
    if values in (None, "float"):
        if group_size is not None:
            raise ConfigError(
                f"group_size={group_size} applies to int8 / int4 values only; pass values='int8' or 'int4'."
            )
        return None, None
    bits = value_bits(values)
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"`group_size` must be a positive int (kept values per scale), got {group_size!r}.")
    return bits, group_size


@torch.no_grad()
def quantize_rtn(values: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes ``int8 [out, kept]`` and scales ``float16 [out, kept // group_size]``.

    ``values [out, kept]`` are a compressed layer's kept values (any float dtype).
    """
    out, kept = values.shape
    check_group_size(kept, bits, group_size)
    top = qmax(bits)
    groups = values.detach().to(torch.float32).view(out, kept // group_size, group_size)
    absmax = groups.abs().amax(dim=-1)  # [out, G]
    if not bool(torch.isfinite(absmax).all()):
        raise CheckpointError("the kept values hold NaN or inf; they cannot be quantized.")
    scales = (absmax / top).to(torch.float16)
    if not bool(torch.isfinite(scales).all()):
        raise CheckpointError(
            f"kept values up to {float(absmax.max()):.3g} exceed what float16 scales hold "
            f"({torch.finfo(torch.float16).max * top:.3g} for {bits}-bit codes); store float values instead."
        )
    scale = scales.to(torch.float32).unsqueeze(-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round(groups / safe), torch.zeros_like(groups)).clamp_(-top, top)
    return codes.to(torch.int8).view(out, kept), scales


def calibration_ids(calibration_data: Any, tokenizer: Any = None) -> torch.Tensor:
    """``int64 [batch, seq]`` token ids from a tensor / nested list of ids, or from texts with ``tokenizer``."""
    if isinstance(calibration_data, str) or (
        isinstance(calibration_data, Sequence) and calibration_data and isinstance(calibration_data[0], str)
    ):
        if tokenizer is None:
            raise ConfigError("calibration_data holds texts; pass the model's tokenizer too (tokenizer=...).")
        texts = [calibration_data] if isinstance(calibration_data, str) else list(calibration_data)
        rows = [tokenizer(text, return_tensors="pt")["input_ids"][0] for text in texts]
        length = min(len(r) for r in rows)
        if length < 2:
            raise ConfigError("every calibration text must hold at least two tokens.")
        return torch.stack([r[:length] for r in rows])
    ids = torch.as_tensor(calibration_data)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.numel() == 0:
        raise ConfigError(
            f"calibration_data must be token ids [batch, seq] (ints) or texts, got {ids.dtype} {list(ids.shape)}."
        )
    return ids.long()


def quantize_layers(
    model: nn.Module,
    kept_values: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    calibration_data: Any = None,
    tokenizer: Any = None,
    n: int = 2,
    m: int = 4,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (qvalues, scales)}`` for every layer of ``kept_values`` (``{layer: values [out, kept]}``).

    Without ``calibration_data``: round-to-nearest, one layer at a time. With it (token ids or texts
    plus ``tokenizer``): the error-compensating quantization of :mod:`hf_maskllm.sparse.gptq`, which runs
    the model on those tokens (``model`` must then hold the merged ``n:m`` weights of these layers).
    """
    names = list(kept_values)
    all_kept = [v.shape[1] for v in kept_values.values()]
    for name, v in kept_values.items():
        check_group_size(v.shape[1], bits, group_size, name, all_kept)
    if calibration_data is None:
        return {
            name: (pack_codes(codes, bits), scales)
            for name, (codes, scales) in (
                (k, quantize_rtn(v, bits, group_size)) for k, v in kept_values.items()
            )
        }
    from .gptq import gptq_quantize_model

    ids = calibration_ids(calibration_data, tokenizer)
    result = gptq_quantize_model(model, names, bits, group_size, ids, n=n, m=m)
    out = {}
    low = -8 if bits == 4 else -qmax(bits)
    for name in names:
        codes, scales = result[name]
        rows, kept = kept_values[name].shape
        if (
            tuple(codes.shape) != (rows, kept)
            or tuple(scales.shape) != (rows, kept // group_size)
            or bool((codes < low).any() or (codes > qmax(bits)).any())
            or not bool(torch.isfinite(scales).all())
        ):
            raise CheckpointError(
                f"the error-compensating quantization returned malformed codes or scales for {name!r} "
                f"(codes {list(codes.shape)}, scales {list(scales.shape)}); quantize without calibration_data."
            )
        out[name] = (pack_codes(codes, bits), scales.to(torch.float16).contiguous())
    return out
