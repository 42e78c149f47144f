"""hf_maskllm: learnable N:M sparsity masks (MaskLLM) for Hugging Face transformers.

Public API::

    from hf_maskllm import MaskConfig, get_mask_model, MaskModel, MaskAnnealCallback, MaskAdamW, MaskTrainingArguments, check_nm
    from hf_maskllm import merge_checkpoint, save_compressed
"""

from .adapters import (
    MaskAnnealCallback,
    MaskConfig,
    MaskedLinear,
    MaskModel,
    get_mask_model,
    merge_checkpoint,
)
from .check import NMReport, check_nm
from .errors import MaskLLMError
from .kernels import attention as _attention  # noqa: F401  (registers attn_implementation="hf_maskllm")
from .optim import MaskAdamW
from .sparse import SparseLinear, save_compressed  # registers the compressed format with transformers
from .training_args import MaskTrainingArguments
from .version import __version__

__all__ = [
    "MaskAdamW",
    "MaskAnnealCallback",
    "MaskConfig",
    "MaskLLMError",
    "MaskModel",
    "MaskTrainingArguments",
    "MaskedLinear",
    "NMReport",
    "SparseLinear",
    "__version__",
    "check_nm",
    "get_mask_model",
    "merge_checkpoint",
    "save_compressed",
]
