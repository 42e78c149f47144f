"""The compressed N:M checkpoint: format, ``SparseLinear``, ``save_compressed`` and the transformers loader.

Importing this package registers the ``hf_maskllm_nm`` quantization method with transformers, so
``AutoModelForCausalLM.from_pretrained`` rebuilds compressed checkpoints with ``SparseLinear``.
"""

from .checkpoint import find_nm_modules, save_compressed
from .format import FORMAT_VERSION, compress, decompress, meta_bits, validate
from .linear import SparseLinear
from .quantizer import QUANT_METHOD, NMSparseConfig, NMSparseHfQuantizer

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "NMSparseConfig",
    "NMSparseHfQuantizer",
    "SparseLinear",
    "compress",
    "decompress",
    "find_nm_modules",
    "meta_bits",
    "save_compressed",
    "validate",
]
