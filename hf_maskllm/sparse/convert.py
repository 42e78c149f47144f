"""Turn a model's N:M layers into :class:`SparseLinear` (mask-keeping), as a loaded compressed checkpoint has them.

A model converted with :func:`to_sparse_layers` behaves as one loaded from a compressed checkpoint:
it carries the ``hf_maskllm_nm`` quantizer (so ``Trainer`` trains it, ``dequantize()`` makes it
dense) and its ``save_pretrained`` writes a compressed checkpoint with
:func:`~hf_maskllm.sparse.save_compressed`. The way back is
:func:`~hf_maskllm.sparse.linear.to_dense_layers` (``model.dequantize()`` for a transformers model).
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError, TargetError
from ..modules import dense_weight_view, is_conv1d
from .checkpoint import bind_save_pretrained, check_modules, compressed_layer_names, find_nm_modules
from .format import QUANTIZED_FORMAT_VERSION, check_group_size, compress, pack_codes
from .linear import SparseLinear
from .quantize import quantize_rtn, resolve_values
from .quantized_linear import QuantizedSparseLinear
from .quantizer import NMSparseConfig, NMSparseHfQuantizer

__all__ = ["to_sparse_layers"]


def to_sparse_layers(
    model: nn.Module,
    n: int = 2,
    m: int = 4,
    modules: list[str] | None = None,
    trainable: bool = True,
    values: str | None = None,
    group_size: int | None = None,
) -> nn.Module:
    """Replace N:M ``nn.Linear`` / ``Conv1D`` layers (zeros merged in) by :class:`SparseLinear` (or
    :class:`QuantizedSparseLinear`), in place.

    ``modules=None`` picks every exactly-N:M linear except the output embedding (as
    :func:`~hf_maskllm.sparse.save_compressed` does). After this, training updates only the kept
    weights, so the model stays exactly N:M, and ``model.save_pretrained`` writes a compressed
    checkpoint. ``trainable`` sets ``requires_grad`` of the kept weights. Returns ``model``.

    ``values="int8"`` / ``"int4"`` instead builds :class:`QuantizedSparseLinear` layers (round-to-nearest,
    one float16 scale per ``group_size`` kept values, default 32), as a checkpoint saved with that value
    type loads; they do not train.
    """
    bits, group_size = resolve_values(values, group_size)
    names = find_nm_modules(model, n, m) if modules is None else list(modules)
    if not names:
        raise TargetError(
            f"no linear layer of {type(model).__name__} is {n}:{m} sparse; merge the mask first "
            "(MaskModel.merge_and_unload) or check n and m."
        )
    check_modules(model, names, n, m)  # raises for a missing, non-linear or non-N:M module
    if bits is not None:
        for name in names:  # refuse before changing anything
            module = model.get_submodule(name)
            check_group_size(_in_features(module) * n // m, bits, group_size, name)
            if isinstance(module, QuantizedSparseLinear) and (module.bits, module.group_size) != (
                bits,
                group_size,
            ):
                raise ConfigError(
                    f"layer {name!r} already holds {module.value_type} values with group_size={module.group_size}; "
                    "quantizing it again would round twice. Start from the float model."
                )
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, QuantizedSparseLinear):
            continue
        if bits is not None:
            model.set_submodule(name, _quantized(module, n, m, bits, group_size))
        elif not isinstance(module, SparseLinear):
            sparse = SparseLinear.from_dense(module, n, m)
            sparse.values.requires_grad_(trainable)
            model.set_submodule(name, sparse)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):  # a transformers model
        quantized = [mod for mod in model.modules() if isinstance(mod, QuantizedSparseLinear)]
        fields = (
            {
                "format_version": QUANTIZED_FORMAT_VERSION,
                "values": quantized[0].value_type,
                "group_size": quantized[0].group_size,
            }
            if quantized
            else {}
        )
        quant = NMSparseConfig(n=n, m=m, modules=compressed_layer_names(model), **fields)
        model.hf_quantizer = NMSparseHfQuantizer(quant, pre_quantized=True)
        model.quantization_method = quant.quant_method
        config.quantization_config = quant
        bind_save_pretrained(model)
    return model


def _quantized(module: nn.Module, n: int, m: int, bits: int, group_size: int) -> QuantizedSparseLinear:
    """A :class:`QuantizedSparseLinear` holding ``module``'s N:M weight, kept values rounded to nearest."""
    if isinstance(module, SparseLinear):
        values, meta, dtype, conv1d = module.values.detach(), module.meta, module.values.dtype, module.conv1d
    else:
        weight = dense_weight_view(module)
        values, meta = compress(weight, n, m)
        dtype, conv1d = weight.dtype, is_conv1d(module)
    codes, scales = quantize_rtn(values, bits, group_size)
    bias = getattr(module, "bias", None)
    return QuantizedSparseLinear.from_tensors(
        pack_codes(codes, bits), scales, meta, _in_features(module), n, m, bits, group_size,
        None if bias is None else bias.detach(), dtype, conv1d,
    )  # fmt: skip


def _in_features(module: nn.Module) -> int:
    if isinstance(module, (SparseLinear, QuantizedSparseLinear)):
        return module.in_features
    return dense_weight_view(module).shape[1]
