"""Build, cache and load the CPU N:M kernels (``kernels/cpu/*.cpp``).

The C++ sources are compiled once per torch version, Python version, machine type and sources with
``torch.utils.cpp_extension.load`` (the C++ compiler that ``torch.compile`` on CPU needs as well;
ninja from the ``ninja`` wheel), into ``torch_extensions/`` under ``$HF_MASKLLM_CACHE`` (default
``~/.cache/hf_maskllm``); later processes load the built library in milliseconds. The instruction
set is chosen at run time from what the CPU supports, capped by ``ATEN_CPU_CAPABILITY``
(``default``, ``avx2``, ``avx512``: the variable torch's own CPU kernels follow) or by
:func:`set_cpu_isa`.

Where the library cannot be built (no compiler, ``HF_MASKLLM_CPU_KERNELS=0``), :func:`cpu_kernels`
returns ``None`` after one warning that names the cause and the fix, and compressed layers run from
a cached dense weight (dense speed, dense memory).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import sys
import time
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

from ..cache import cache_root

__all__ = ["CPU_ISA_LEVELS", "cpu_isa", "cpu_kernels", "set_cpu_isa"]

logger = logging.getLogger(__name__)

# bindings.cpp holds the Python module and the registered ops' kernels, nm_linear.cpp the float kernels,
# nm_linear_quant.cpp the int8 / int4 N:M ones, int8_linear.cpp the dense int8 layer, decode_attention.cpp
# the attention of decode steps; common.h what the kernels share. The files compile in parallel (ninja),
# longest first: bindings.cpp parses pybind11 and torch's Python headers.
SOURCES = tuple(
    Path(__file__).resolve().parent / "cpu" / name
    for name in (
        "bindings.cpp",
        "nm_linear_quant.cpp",
        "nm_linear.cpp",
        "decode_attention.cpp",
        "int8_linear.cpp",
    )
)
HEADERS = (Path(__file__).resolve().parent / "cpu" / "common.h",)
# Instruction-set levels of the C++ dispatch, lowest first.
CPU_ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")
_ATEN_CAPS = {"default": "scalar", "avx2": "avx2", "avx512": "avx512_bf16"}


def _build_directory() -> Path:
    """One folder per torch installation (version and location), Python version, machine type and sources (a
    changed source builds anew). Two environments with the same torch version compile against their own copies
    of its headers: in one folder, each switch between them would rebuild the library."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    source = digest.hexdigest()[:12]
    where = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    tag = (
        f"torch{torch.__version__}-{where}-py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
        f"-{source}"
    )
    return cache_root() / "torch_extensions" / re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


def _ninja_on_path() -> None:
    """Put the ``ninja`` wheel's binary on ``PATH`` (a venv's ``bin`` is not on it unless activated)."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _warn_unavailable(reason: str) -> None:
    warnings.warn(
        f"hf_maskllm: the CPU N:M kernels are unavailable ({reason}); compressed layers on CPU run from a "
        "cached dense copy of each weight instead (dense speed, more memory than the dense model). To fix: "
        "install a C++ compiler (g++ or clang, as torch.compile on CPU needs) and `pip install ninja`, "
        "and unset HF_MASKLLM_CPU_KERNELS=0 if it is set.",
        RuntimeWarning,
        stacklevel=3,
    )


@lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    """The compiled CPU kernel module (``nm_linear``, ``nm_expand``, ``nm_linear_q``, ``nm_expand_q``, ``set_isa``),
    or ``None`` with one warning."""
    if os.environ.get("HF_MASKLLM_CPU_KERNELS", "1") == "0":
        _warn_unavailable("HF_MASKLLM_CPU_KERNELS=0")
        return None
    from torch.utils import cpp_extension

    _ninja_on_path()
    build_dir = _build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(build_dir)
    built = any(build_dir.glob("*.so"))
    if not built:
        logger.warning(
            "hf_maskllm: compiling the CPU N:M kernels once (under a minute) into %s; later runs load them.",
            build_dir,
        )
    start = time.perf_counter()
    # OpenMP: torch's own pool on Linux (its libgomp is already loaded); elsewhere one thread per call.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    try:
        module = cpp_extension.load(
            name="hf_maskllm_nm_cpu",
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", *openmp],
            extra_ldflags=openmp,
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja, or a failed build: say which, fall back
        _warn_unavailable(_cause(error))
        return None
    if not built:
        logger.warning("hf_maskllm: CPU N:M kernels compiled in %.1f s.", time.perf_counter() - start)
    module.set_isa(_requested_level())
    return module


def _cause(error: Exception) -> str:
    """The line of a build error that says what went wrong (the compiler's error, a missing program)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [
        line
        for line in lines
        if re.search(r"error|not found|no such file|cannot|required|fatal|permission", line, re.IGNORECASE)
        and not line.startswith(("ninja: build stopped", "Error building extension", "FAILED:"))
    ]
    detail = (telling or lines or [""])[0]
    return f"{type(error).__name__}: {detail[:300]}"


def _remove_stale_lock(build_dir: Path) -> None:
    """torch waits forever on the lock file of a build that was killed; one older than 15 minutes is stale."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > 15 * 60:
            logger.warning("hf_maskllm: removing a stale build lock %s (a killed build left it).", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def _requested_level() -> int:
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return CPU_ISA_LEVELS.index(_ATEN_CAPS.get(cap, CPU_ISA_LEVELS[-1]))


def cpu_isa() -> str | None:
    """The instruction set the CPU kernels use (one of :data:`CPU_ISA_LEVELS`), or ``None`` without kernels."""
    module = cpu_kernels()
    return None if module is None else CPU_ISA_LEVELS[module.isa()]


def set_cpu_isa(level: str | None) -> str | None:
    """Cap the kernels' instruction set at ``level`` (``None``: the best the CPU has, within
    ``ATEN_CPU_CAPABILITY``); returns the level now in use (``None`` without kernels)."""
    module = cpu_kernels()
    if module is None:
        return None
    if level is not None and level not in CPU_ISA_LEVELS:
        raise ValueError(f"level must be one of {CPU_ISA_LEVELS} or None, got {level!r}.")
    wanted = _requested_level() if level is None else CPU_ISA_LEVELS.index(level)
    return CPU_ISA_LEVELS[module.set_isa(wanted)]
