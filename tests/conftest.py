"""Test-wide setup: run offline by default, interpret Triton kernels on CPU, and serve a local Hub on demand."""

import os
from collections.abc import Iterator

# Before anything imports huggingface_hub / transformers / triton (they read these once, at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist workers share the cores instead of each taking all of them
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import pytest  # noqa: E402
from hub_server import LocalHub, serve_local_hub  # noqa: E402


@pytest.fixture
def local_hub(tmp_path) -> Iterator[LocalHub]:
    """A fresh, empty local Hub that huggingface_hub and transformers talk to online during the test."""
    with serve_local_hub(tmp_path) as hub:
        yield hub
