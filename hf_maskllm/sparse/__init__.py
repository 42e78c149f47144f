"""The compressed N:M checkpoint: format, ``SparseLinear``, ``save_compressed`` and the transformers loader.

Importing this package registers the ``hf_maskllm_nm`` quantization method with transformers (its
documented ``register_quantizer`` / ``register_quantization_config``), so
``AutoModelForCausalLM.from_pretrained`` rebuilds compressed checkpoints with ``SparseLinear`` (float kept values) or
``QuantizedSparseLinear`` (int8 / int4 kept values). PEFT
LoRA on such a model takes a ``LoraConfig`` passed through :func:`register_lora`.
"""

from .checkpoint import find_nm_modules, save_compressed
from .convert import to_sparse_layers
from .format import (
    FORMAT_VERSION,
    QUANT_METHOD,
    QUANTIZED_FORMAT_VERSION,
    VALUE_TYPES,
    compress,
    decompress,
    dequantize,
    meta_bits,
    validate,
    validate_quantized,
)
from .linear import SparseLinear, set_dense_cache, to_dense_layers
from .lora import SparseLoraLinear, register_lora
from .quantize import DEFAULT_GROUP_SIZE, quantize_rtn
from .quantized_linear import QuantizedSparseLinear
from .quantizer import NMSparseConfig, NMSparseHfQuantizer
from .reconstruct import reconstruct

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FORMAT_VERSION",
    "QUANTIZED_FORMAT_VERSION",
    "QUANT_METHOD",
    "VALUE_TYPES",
    "NMSparseConfig",
    "NMSparseHfQuantizer",
    "QuantizedSparseLinear",
    "SparseLinear",
    "SparseLoraLinear",
    "compress",
    "decompress",
    "dequantize",
    "find_nm_modules",
    "meta_bits",
    "quantize_rtn",
    "reconstruct",
    "register_lora",
    "save_compressed",
    "set_dense_cache",
    "to_dense_layers",
    "to_sparse_layers",
    "validate",
    "validate_quantized",
]
