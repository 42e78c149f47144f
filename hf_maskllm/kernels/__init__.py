"""N:M sparse linear kernels: Triton on CUDA (2:4 fast path) behind :func:`nm_linear`, and C++ on CPU
(:mod:`.cpu_extension`, built on first use). Compressed layers reach both through :mod:`.route`, the one
routing place, whose registered torch ops ``torch.compile`` sees as single nodes.

Triton is imported lazily and the C++ kernels are built lazily: importing this package needs only torch.
"""

from .cpu_extension import cpu_isa, set_cpu_isa
from .ops import DECODE_MAX_TOKENS, EXPAND_MIN_TOKENS, nm_linear

__all__ = ["DECODE_MAX_TOKENS", "EXPAND_MIN_TOKENS", "cpu_isa", "nm_linear", "set_cpu_isa"]
