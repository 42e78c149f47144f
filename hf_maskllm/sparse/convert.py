"""Turn a model's N:M layers into :class:`SparseLinear` (mask-keeping), as a loaded compressed checkpoint has them.

A model converted with :func:`to_sparse_layers` behaves as one loaded from a compressed checkpoint:
it carries the ``hf_maskllm_nm`` quantizer (so ``Trainer`` trains it, ``dequantize()`` makes it
dense) and its ``save_pretrained`` writes a compressed checkpoint with
:func:`~hf_maskllm.sparse.save_compressed`. The way back is
:func:`~hf_maskllm.sparse.linear.to_dense_layers` (``model.dequantize()`` for a transformers model).
"""

from __future__ import annotations

from torch import nn

from ..errors import TargetError
from .checkpoint import bind_save_pretrained, check_modules, find_nm_modules
from .linear import SparseLinear, sparse_layer_names
from .quantizer import NMSparseConfig, NMSparseHfQuantizer

__all__ = ["to_sparse_layers"]


def to_sparse_layers(
    model: nn.Module, n: int = 2, m: int = 4, modules: list[str] | None = None, trainable: bool = True
) -> nn.Module:
    """Replace N:M ``nn.Linear`` / ``Conv1D`` layers (zeros merged in) by :class:`SparseLinear`, in place.

    ``modules=None`` picks every exactly-N:M linear except the output embedding (as
    :func:`~hf_maskllm.sparse.save_compressed` does). After this, training updates only the kept
    weights, so the model stays exactly N:M, and ``model.save_pretrained`` writes a compressed
    checkpoint. ``trainable`` sets ``requires_grad`` of the kept weights. Returns ``model``.
    """
    names = find_nm_modules(model, n, m) if modules is None else list(modules)
    if not names:
        raise TargetError(
            f"no linear layer of {type(model).__name__} is {n}:{m} sparse; merge the mask first "
            "(MaskModel.merge_and_unload) or check n and m."
        )
    check_modules(model, names, n, m)  # raises for a missing, non-linear or non-N:M module
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, SparseLinear):
            sparse = SparseLinear.from_dense(module, n, m)
            sparse.values.requires_grad_(trainable)
            model.set_submodule(name, sparse)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):  # a transformers model
        quant = NMSparseConfig(n=n, m=m, modules=sparse_layer_names(model))
        model.hf_quantizer = NMSparseHfQuantizer(quant, pre_quantized=True)
        model.quantization_method = quant.quant_method
        config.quantization_config = quant
        bind_save_pretrained(model)
    return model
