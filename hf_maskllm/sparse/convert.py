"""Turn a model's N:M layers into :class:`SparseLinear` (mask-keeping) and back, and save such a model.

A model whose layers are :class:`SparseLinear` behaves the same whether it was loaded from a
compressed checkpoint or converted with :func:`to_sparse_layers`: it carries the ``hf_maskllm_nm``
quantizer (so ``Trainer`` trains it, ``dequantize()`` makes it dense) and its ``save_pretrained``
writes a compressed checkpoint with :func:`~hf_maskllm.sparse.save_compressed`.
"""

from __future__ import annotations

import os
import types
from typing import Any

from torch import nn

from ..errors import CheckpointError, TargetError
from .checkpoint import _check_modules, find_nm_modules, save_compressed
from .linear import SparseLinear

__all__ = ["bind_save_pretrained", "sparse_layer_names", "to_dense_layers", "to_sparse_layers"]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def sparse_layer_names(model: nn.Module) -> list[str]:
    """Names of the :class:`SparseLinear` modules of ``model``, in model order."""
    return [name for name, mod in model.named_modules() if isinstance(mod, SparseLinear)]


def to_sparse_layers(
    model: nn.Module, n: int = 2, m: int = 4, modules: list[str] | None = None, trainable: bool = True
) -> nn.Module:
    """Replace N:M ``nn.Linear`` / ``Conv1D`` layers (zeros merged in) by :class:`SparseLinear`, in place.

    ``modules=None`` picks every exactly-N:M linear except the output embedding (as
    :func:`~hf_maskllm.sparse.save_compressed` does). After this, training updates only the kept
    weights, so the model stays exactly N:M, and ``model.save_pretrained`` writes a compressed
    checkpoint. ``trainable`` sets ``requires_grad`` of the kept weights. Returns ``model``.
    """
    from .quantizer import NMSparseConfig, NMSparseHfQuantizer

    names = find_nm_modules(model, n, m) if modules is None else list(modules)
    if not names:
        raise TargetError(
            f"no linear layer of {type(model).__name__} is {n}:{m} sparse; merge the mask first "
            "(MaskModel.merge_and_unload) or check n and m."
        )
    _check_modules(model, names, n, m)  # raises for a missing, non-linear or non-N:M module
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, SparseLinear):
            sparse = SparseLinear.from_dense(module, n, m)
            sparse.values.requires_grad_(trainable)
            _set(model, name, sparse)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):  # a transformers model
        quant = NMSparseConfig(n=n, m=m, modules=sparse_layer_names(model))
        model.hf_quantizer = NMSparseHfQuantizer(quant, pre_quantized=True)
        model.quantization_method = quant.quant_method
        config.quantization_config = quant
        bind_save_pretrained(model)
    return model


def to_dense_layers(model: nn.Module) -> nn.Module:
    """Replace every :class:`SparseLinear` by its dense layer (zeros kept), in place; returns ``model``."""
    for name in sparse_layer_names(model):
        _set(model, name, model.get_submodule(name).to_dense())
    if "save_pretrained" in vars(model):
        del model.save_pretrained
    return model


_IGNORED = ("safe_serialization", "is_main_process", "state_dict", "token", "save_original_format")


def _save_pretrained(
    self: nn.Module,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "2GB",
    push_to_hub: bool = False,
    tokenizer: Any = None,
    **kwargs: Any,
) -> list[str]:
    """Save this compressed N:M model as a compressed checkpoint (``hf_maskllm.sparse.save_compressed``).

    Reload it with ``AutoModelForCausalLM.from_pretrained`` after ``import hf_maskllm``. Accepts
    what ``Trainer`` passes (``state_dict``: must be this model's own tensors; ``is_main_process``).
    Returns the names of the compressed modules.
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
    names = sparse_layer_names(self)
    if not names:
        raise CheckpointError(
            "this model holds no SparseLinear layer any more; save it with the plain transformers save_pretrained "
            "(after model.dequantize()) or hf_maskllm.sparse.save_compressed."
        )
    first = self.get_submodule(names[0])
    return save_compressed(
        self,
        save_directory,
        first.n,
        first.m,
        modules=names,
        tokenizer=tokenizer,
        max_shard_size=max_shard_size,
    )


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` (and so ``push_to_hub`` and ``Trainer`` checkpoints) write compressed."""
    model.save_pretrained = types.MethodType(_save_pretrained, model)
