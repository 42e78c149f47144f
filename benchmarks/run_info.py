"""What a results file records about its run: command, date, machine (CPU model and the flags the
kernels use), versions and git commit. ``from run_info import run_info, rss_peak_bytes`` in a benchmark."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# CPU flags that decide which kernels run (torch's, oneDNN's and hf_maskllm's CPU dispatch)
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_vbmi2",
    "amx_bf16",
)


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's name (with its family and model number where /proc/cpuinfo gives them: virtual machines
    often name a whole line of CPUs, such as "AMD EPYC") and the kernel-relevant flags it has."""
    model, flags, numbers = platform.processor() or platform.machine(), [], {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("cpu family", "model") and key not in numbers:
                numbers[key] = line.split(":", 1)[1].strip()
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                present = set(line.split(":", 1)[1].split())
                flags = [flag for flag in KERNEL_FLAGS if flag in present]
    except OSError:
        pass
    if len(numbers) == 2:
        model += f" (family {numbers['cpu family']}, model {numbers['model']})"
    return model, flags


CODE_PATHS = ("hf_maskllm", "benchmarks/*.py", "examples/*.py", "pyproject.toml")


def git_commit() -> str:
    """``HEAD``'s commit, followed by the code files (package, benchmark scripts) that differ from it,
    untracked ones included: results and docs edited during a run do not change what ran."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", *CODE_PATHS], cwd=ROOT, capture_output=True, text=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = sorted(line[3:] for line in status if line[3:].endswith((".py", ".toml", ".cpp")))
    return commit + (f" (uncommitted changes to {', '.join(changed)})" if changed else "")


def run_info(script: str) -> dict:
    """The header fields of a results file written by ``script`` (called as ``sys.argv`` says)."""
    import transformers

    import hf_maskllm
    from hf_maskllm.kernels.cpu_extension import cpu_isa

    model, flags = cpu_model_and_flags()
    env = {
        k: os.environ[k]
        for k in ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
        if k in os.environ
    }
    return {
        "command": " ".join(["PYTHONPATH=. python", script, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cpu": model,
            "cores": os.cpu_count(),
            "flags": flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "hf_maskllm_cpu_isa": cpu_isa(),
            "env": env,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_maskllm": hf_maskllm.__version__,
        },
        "git_commit": git_commit(),
    }


def gpu_info(device: str) -> dict:
    """The Triton version, and on a CUDA device the GPU's name and the CUDA version."""
    try:
        import triton

        info = {"triton": triton.__version__}
    except ImportError:
        info = {"triton": None}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info = {"name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda, **info}
    return info


def header_lines(info: dict) -> list[str]:
    """Markdown lines for a results file's header."""
    machine = info["machine"]
    return [
        f"Command: `{info['command']}`  ",
        f"Date: {info['date']}; git commit {info['git_commit']}  ",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; CPU flags used by kernels: "
        f"{', '.join(machine['flags']) or 'none'}; torch CPU kernels {machine['torch_cpu_capability']}, "
        f"hf_maskllm CPU kernels {machine['hf_maskllm_cpu_isa']}"
        + (f"; env {machine['env']}" if machine["env"] else "")
        + "  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
    ]


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (``None`` where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_bytes("VmRSS") or 0


def rss_peak_bytes() -> int:
    """This process's peak resident set size since it started (or exec'd: ``VmHWM``, unlike
    ``ru_maxrss``, which Linux carries over from the parent across ``exec``)."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
