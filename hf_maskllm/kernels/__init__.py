"""N:M sparse linear kernels (Triton; 2:4 fast path) behind one public function, :func:`nm_linear`.

Triton is imported lazily: importing this package needs only torch.
"""

from .ops import GEMV_MAX_TOKENS, nm_linear

__all__ = ["GEMV_MAX_TOKENS", "nm_linear"]
