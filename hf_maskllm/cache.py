"""Where hf_maskllm keeps what it builds once per machine (the converted SmolLM2, the extracted Wikipedia
articles, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """``$HF_MASKLLM_CACHE`` if set, else ``~/.cache/hf_maskllm``."""
    return Path(os.environ.get("HF_MASKLLM_CACHE") or Path.home() / ".cache" / "hf_maskllm")
