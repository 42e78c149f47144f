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

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hub_server import LocalHub, serve_local_hub  # noqa: E402

# The longest test files (measured on 2 cores), longest first; the others follow in collection order.
# pytest-xdist (--dist loadfile) hands whole files to the workers in this order: no long file starts
# last while the other worker has run out of work.
LONGEST_FIRST = [
    "test_cli.py",
    "test_notebook.py",
    "test_zero_shot.py",
    "test_distributed.py",
    "test_fuzz.py",
    "adapters/test_named_masks.py",
    "test_crash_safety.py",
    "kernels/test_ops.py",
    "kernels/test_compile.py",
    "test_bypass_and_configs.py",
    "test_grad_accumulation.py",
    "numerics/test_fused_linear.py",
    "test_cpu_generation.py",
    "kernels/test_cpu_extension.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here, rank = Path(__file__).parent, {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        path = Path(item.path)
        return rank.get(path.relative_to(here).as_posix() if path.is_relative_to(here) else "", len(rank))

    items.sort(key=key)  # stable: a file's tests stay together and in order


@pytest.fixture
def local_hub(tmp_path) -> Iterator[LocalHub]:
    """A fresh, empty local Hub that huggingface_hub and transformers talk to online during the test."""
    with serve_local_hub(tmp_path) as hub:
        yield hub
