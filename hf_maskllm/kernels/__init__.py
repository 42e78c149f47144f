"""N:M sparse linear kernels (Triton; 2:4 fast path) behind one public function, :func:`nm_linear`.

Triton is imported lazily: importing this package needs only torch.
"""

from .ops import DECODE_MAX_TOKENS, EXPAND_MIN_TOKENS, nm_linear

__all__ = ["DECODE_MAX_TOKENS", "EXPAND_MIN_TOKENS", "nm_linear"]
