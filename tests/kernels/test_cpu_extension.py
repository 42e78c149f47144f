"""Building and loading the CPU N:M kernels (``hf_maskllm.kernels.cpu_extension``): the build, the instruction
set ATen allows, a build that fails or is switched off (one warning, then the cached dense route), stale locks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hf_maskllm.kernels.cpu_extension import CPU_ISA_LEVELS, cpu_isa, cpu_kernels

EXT = cpu_kernels()
# `make test` sets HF_MASKLLM_REQUIRE_CPU_KERNELS=1: there a build failure fails instead of skipping
REQUIRED = os.environ.get("HF_MASKLLM_REQUIRE_CPU_KERNELS") == "1"
pytestmark = pytest.mark.skipif(
    EXT is None and not REQUIRED, reason="the CPU kernels could not be built here"
)
BEST = cpu_isa() if EXT is not None else "scalar"


def test_the_kernels_build():
    assert EXT is not None and cpu_isa() in CPU_ISA_LEVELS


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=600,
    )


def test_aten_cpu_capability_caps_the_instruction_set():
    result = _run(
        "from hf_maskllm.kernels.cpu_extension import cpu_isa; print(cpu_isa())", ATEN_CPU_CAPABILITY="avx2"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == ("avx2" if CPU_ISA_LEVELS.index(BEST) >= 1 else "scalar")


FALLBACK = """
    import warnings
    import torch
    import torch.nn.functional as F
    from hf_maskllm.sparse import SparseLinear
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 8)
    with torch.no_grad():
        linear.weight.view(8, 8, 4)[..., :2] = 0
    sparse = SparseLinear.from_dense(linear, 2, 4)
    x = torch.randn(3, 32)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(3):
            y = sparse(x)
    assert torch.equal(y, F.linear(x, linear.weight, linear.bias))
    assert sparse._cache is not None  # the cached dense route
    messages = [str(w.message) for w in caught if "CPU N:M kernels" in str(w.message)]
    assert len(messages) == 1, messages
    print(messages[0])
"""


def test_switched_off_kernels_warn_once_and_the_cached_route_runs():
    result = _run(FALLBACK, HF_MASKLLM_CPU_KERNELS="0")
    assert result.returncode == 0, result.stderr
    assert "unavailable (HF_MASKLLM_CPU_KERNELS=0)" in result.stdout and "unset" in result.stdout


def test_a_failed_build_warns_once_naming_the_cause_and_the_fix(tmp_path):
    # a fresh cache (so it must build) and a compiler that does not exist
    result = _run(FALLBACK, HF_MASKLLM_CACHE=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    assert result.returncode == 0, result.stderr
    cause = result.stdout.split("unavailable (", 1)[1].split(");", 1)[0]
    assert "no-such-compiler" in cause and "not found" in cause, cause  # the shell's own words
    assert "install a C++ compiler" in result.stdout


def test_stale_build_lock_is_removed(tmp_path, monkeypatch):
    from hf_maskllm.kernels import cpu_extension

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_extension._remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running
    os.utime(lock, (0, 0))
    cpu_extension._remove_stale_lock(tmp_path)
    assert not lock.exists()


def test_each_torch_installation_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two environments with the same torch version compile against their own headers: one folder each, so
    switching between them loads their own library instead of rebuilding a shared one."""
    import torch

    from hf_maskllm.kernels import cpu_extension

    monkeypatch.setenv("HF_MASKLLM_CACHE", str(tmp_path))
    here = cpu_extension._build_directory()
    assert here == cpu_extension._build_directory() and here.parent == tmp_path / "torch_extensions"
    assert here.name.startswith(f"torch{torch.__version__}".replace("+", "_"))
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-env" / "torch" / "__init__.py"))
    elsewhere = cpu_extension._build_directory()
    assert elsewhere != here and elsewhere.name.split("-")[0] == here.name.split("-")[0]
