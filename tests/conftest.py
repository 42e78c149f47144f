"""Test-wide setup: run offline by default, interpret Triton kernels on CPU, and serve a local Hub on demand."""

import os
from collections.abc import Iterator

# Before anything imports huggingface_hub / transformers / triton (they read these once, at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hub_server import LocalHub, serve_local_hub  # noqa: E402


@pytest.fixture
def local_hub(tmp_path) -> Iterator[LocalHub]:
    """A fresh, empty local Hub that huggingface_hub and transformers talk to online during the test."""
    with serve_local_hub(tmp_path) as hub:
        yield hub
