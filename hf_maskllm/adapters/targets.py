"""Which layers of a model get a mask: matching ``target_modules`` / ``exclude_modules``.

PEFT's conventions: a list matches name suffixes (``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``),
a string is a regex that must match the whole name, and ``"all-linear"`` means every Linear / GPT-2
Conv1D except the output embedding. PEFT adapter layers (``lora_A``, ``lora_B``, ... inside a PEFT
tuner layer) are never masked: ``"all-linear"`` skips them (with a warning that the adapters' updates
stay dense), an explicit name refuses them.
"""

from __future__ import annotations

import difflib
import re
import warnings

import torch
from torch import nn

from ..errors import TargetError
from ..modules import dense_weight_view, output_embedding_names
from ..modules import is_linear as is_maskable

__all__ = ["adapter_layer_prefixes", "check_full_precision", "find_targets", "is_maskable"]

FULL_PRECISION = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def adapter_layer_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Names of the PEFT adapter sub-layers of ``model`` (e.g. ``...q_proj.lora_A``); empty without PEFT layers."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # without peft there are no adapter layers
        return ()
    prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            for attr in (*module.adapter_layer_names, *module.other_param_names):
                prefixes.append(f"{name}.{attr}" if name else attr)
    return tuple(prefixes)


def _plain_tensor(weight: torch.Tensor) -> bool:
    """A weight stored as an ordinary tensor (a DTensor shard included), not a quantizing tensor subclass."""
    if type(weight.data) is torch.Tensor:
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return False
    return isinstance(weight, DTensor)


def check_full_precision(model: nn.Module, names: list[str]) -> None:
    """Refuse to mask a model that transformers loaded quantized (bitsandbytes, GPTQ, AWQ, torchao, ...) or
    layers ``names`` of it whose weights are not full-precision floats: a mask selects among the
    full-precision weights. A compressed N:M checkpoint of this library passes (its dense layers can take
    masks); so does a GGUF checkpoint transformers dequantized, once it is no longer marked quantized."""
    from ..sparse.format import QUANT_METHOD

    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum, or a string
    if quantizer is not None and method == "gguf":
        raise TargetError(
            f"{type(model).__name__} was loaded from a GGUF file: transformers dequantized its weights but keeps "
            "the model marked quantized, which the Trainer refuses to train. Unmark it first: "
            "model.hf_quantizer.remove_quantization_config(model)."
        )
    if quantizer is not None and method != QUANT_METHOD:
        raise TargetError(
            f"{type(model).__name__} was loaded quantized ({method}); masks are learned over full-precision "
            "weights. Load the original full-precision checkpoint (a bitsandbytes model can also be "
            "model.dequantize()-d), learn and merge the mask, then quantize the sparse model."
        )
    bad = []
    for name in names:
        weight = dense_weight_view(model.get_submodule(name))
        if weight.dtype not in FULL_PRECISION or not _plain_tensor(weight):
            bad.append(f"{name} ({type(weight).__name__} of {weight.dtype})")
    if bad:
        raise TargetError(
            f"{len(bad)} target layer(s) hold quantized weights: {bad[:3]}{' ...' if len(bad) > 3 else ''}; masks "
            "are learned over full-precision (float16 / bfloat16 / float32 / float64) weights. Mask the "
            "full-precision model, merge the mask, then quantize the sparse model; or leave these layers out "
            "with exclude_modules."
        )


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _matches(name: str, spec: str | list[str] | tuple[str, ...]) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == s or name.endswith("." + s) for s in spec)


def find_targets(
    model: nn.Module,
    target_modules: str | list[str],
    exclude_modules: str | list[str] | None,
    m: int,
    strict: bool = False,
) -> list[str]:
    """Names of the modules to mask, in model order.

    Raises :class:`TargetError` if nothing matches, if an explicitly named module is not a
    supported layer type, or (``strict``) if a target's input size is not divisible by ``m``;
    without ``strict`` such a layer is skipped with a warning naming it.
    """
    all_linear = target_modules == "all-linear"
    skip = output_embedding_names(model) if all_linear else set()
    adapters = adapter_layer_prefixes(model)
    names: list[str] = []
    unsupported: list[str] = []
    indivisible: list[str] = []
    adapter_hits: list[str] = []
    for name, module in model.named_modules():
        if not name or name in skip:
            continue
        if exclude_modules is not None and _matches(name, exclude_modules):
            continue
        if all_linear:
            if not is_maskable(module):
                continue
        elif not _matches(name, target_modules):
            continue
        if adapters and _under(name, adapters):
            adapter_hits.append(name)
            continue
        if not is_maskable(module):
            hint = " (a PEFT adapter wrapper: target its base_layer)" if hasattr(module, "base_layer") else ""
            unsupported.append(f"{name} ({type(module).__name__}{hint})")
            continue
        if dense_weight_view(module).shape[1] % m:
            indivisible.append(f"{name} (in_features={dense_weight_view(module).shape[1]})")
            continue
        names.append(name)
    if adapter_hits and not all_linear:
        raise TargetError(
            f"target_modules matched PEFT adapter layers {adapter_hits[:3]}{' ...' if len(adapter_hits) > 3 else ''}; "
            "masks apply to base weights only. Merge the adapters first (peft_model.merge_and_unload()) or "
            "exclude them with exclude_modules."
        )
    if adapter_hits:
        warnings.warn(
            f"the model holds PEFT adapters ({len(adapter_hits)} adapter layers, e.g. {adapter_hits[0]}); they are not "
            "masked, so their updates stay dense. Merge them first (peft_model.merge_and_unload()) to mask the "
            "merged weights.",
            stacklevel=3,
        )
    if unsupported:
        raise TargetError(
            f"target_modules matched modules that cannot be masked: {unsupported[:5]}"
            f"{' ...' if len(unsupported) > 5 else ''}. Supported layer types: nn.Linear, transformers Conv1D. "
            "Narrow target_modules (e.g. ['q_proj', 'v_proj']) or add them to exclude_modules."
        )
    if indivisible:
        message = (
            f"{len(indivisible)} target layer(s) have an input size not divisible by m={m}: {indivisible[:5]}"
            f"{' ...' if len(indivisible) > 5 else ''}."
        )
        if strict:
            raise TargetError(
                message + " Exclude them with exclude_modules, or use strict=False to skip them."
            )
        warnings.warn(message + " They are left dense.", stacklevel=3)
    if names and not isinstance(target_modules, str):
        _warn_unmatched(model, target_modules, "target_modules")
    if names and exclude_modules is not None and not isinstance(exclude_modules, str):
        _warn_unmatched(model, exclude_modules, "exclude_modules")
    if not names:
        raise TargetError(
            f"target_modules={target_modules!r} (exclude_modules={exclude_modules!r}) matched no maskable layer "
            f"of {type(model).__name__}. Use 'all-linear' or names from model.named_modules(), "
            "e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']."
        )
    return names


def _warn_unmatched(model: nn.Module, spec: list[str] | tuple[str, ...], what: str) -> None:
    """Say which entries of a list of name suffixes match no module of ``model`` (a typo, or another family's name)."""
    names = [name for name, _ in model.named_modules() if name]
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in names})
    unmatched = [s for s in spec if not any(_matches(name, [s]) for name in names)]
    for entry in unmatched:
        close = difflib.get_close_matches(entry, suffixes, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        warnings.warn(
            f"{what} entry {entry!r} matches no module of {type(model).__name__}; it selects nothing.{hint}",
            stacklevel=4,
        )
