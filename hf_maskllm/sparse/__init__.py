"""The compressed N:M checkpoint: format, ``SparseLinear``, ``save_compressed`` and the transformers loader.

Importing this package registers the ``hf_maskllm_nm`` quantization method with transformers, so
``AutoModelForCausalLM.from_pretrained`` rebuilds compressed checkpoints with ``SparseLinear``, and
registers ``SparseLoraLinear`` with PEFT's LoRA, so ``get_peft_model`` wraps those layers.
"""

from .checkpoint import find_nm_modules, save_compressed
from .convert import to_dense_layers, to_sparse_layers
from .format import FORMAT_VERSION, compress, decompress, meta_bits, validate
from .linear import SparseLinear, set_dense_cache
from .lora import SparseLoraLinear, install, register_lora
from .quantizer import QUANT_METHOD, NMSparseConfig, NMSparseHfQuantizer
from .reconstruct import reconstruct

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "NMSparseConfig",
    "NMSparseHfQuantizer",
    "SparseLinear",
    "SparseLoraLinear",
    "compress",
    "decompress",
    "find_nm_modules",
    "meta_bits",
    "reconstruct",
    "register_lora",
    "save_compressed",
    "set_dense_cache",
    "to_dense_layers",
    "to_sparse_layers",
    "validate",
]

install()  # every LoraConfig maps SparseLinear to SparseLoraLinear (PEFT custom-module dispatch)
