"""The compressed N:M checkpoint: format, ``SparseLinear``, ``save_compressed`` and the transformers loader.

Importing this package registers the ``hf_maskllm_nm`` quantization method with transformers (its
documented ``register_quantizer`` / ``register_quantization_config``), so
``AutoModelForCausalLM.from_pretrained`` rebuilds compressed checkpoints with ``SparseLinear``. PEFT
LoRA on such a model takes a ``LoraConfig`` passed through :func:`register_lora`.
"""

from .checkpoint import find_nm_modules, save_compressed
from .convert import to_sparse_layers
from .format import FORMAT_VERSION, QUANT_METHOD, compress, decompress, meta_bits, validate
from .linear import SparseLinear, set_dense_cache, to_dense_layers
from .lora import SparseLoraLinear, register_lora
from .quantizer import NMSparseConfig, NMSparseHfQuantizer
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
