"""Fixtures shared by the kernel tests."""

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches and counters empty before the test and after it (compile counts start from zero)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
