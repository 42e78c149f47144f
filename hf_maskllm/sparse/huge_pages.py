"""A loaded compressed model's CPU weights on transparent huge pages (Linux).

Decoding one token reads every weight once, front to back. ``from_pretrained`` leaves the tensors of a
compressed checkpoint in a private mapping of the safetensors file: 4 KiB pages, so the stream crosses a
page, and usually misses the TLB, every 4 KiB (in a virtual machine each miss is a two-level page walk).
:func:`to_huge_pages` copies them into one anonymous mapping advised for 2 MiB pages (``MADV_HUGEPAGE``),
which the kernel backs with transparent huge pages where it can. Values, dtypes, shapes, parameter
objects and ties do not change; only where the bytes live.

The compressed-checkpoint loader calls it for every model it loads onto the CPU; set
``HF_MASKLLM_HUGE_PAGES=0`` to keep the file mapping (its pages stay shareable between processes and
reclaimable by the kernel, at the cost of slower decoding).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.utils import logging

__all__ = ["huge_pages_available", "to_huge_pages"]

logger = logging.get_logger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether :func:`to_huge_pages` would move anything: Linux with transparent huge pages not ``[never]``, and
    ``HF_MASKLLM_HUGE_PAGES`` not ``0``."""
    if os.environ.get("HF_MASKLLM_HUGE_PAGES", "1").strip() == "0":
        return False
    if not sys.platform.startswith("linux") or not all(
        hasattr(mmap, flag) for flag in ("MADV_HUGEPAGE", "MAP_ANONYMOUS", "MAP_PRIVATE")
    ):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def _movable(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The model's CPU parameters (plain ``nn.Parameter``) and buffers that own their bytes: contiguous,
    overlapping no other tensor. One list per address: tensor objects that alias one another move together."""
    aliases: dict[tuple[int, int], list[torch.Tensor]] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        plain = type(t) in (torch.Tensor, torch.nn.Parameter)
        if plain and t.device.type == "cpu" and t.numel() and t.is_contiguous():
            group = aliases.setdefault((t.data_ptr(), t.nbytes), [])
            if not any(u is t for u in group):
                group.append(t)
    spans = sorted(aliases.items(), key=lambda kv: kv[0])
    keep = [True] * len(spans)
    reach, owner = -1, -1
    for i, ((start, nbytes), _) in enumerate(spans):
        if start < reach:  # overlaps an earlier span
            keep[i] = keep[owner] = False
        if start + nbytes > reach:
            reach, owner = start + nbytes, i
    return [group for (_, group), k in zip(spans, keep) if k]


def _slots(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """``id(tensor) -> [(module, attribute name)]`` for every parameter and buffer slot of ``model``."""
    slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, t in itertools.chain(
            module.named_parameters(recurse=False), module.named_buffers(recurse=False)
        ):
            slots.setdefault(id(t), []).append((module, name))
    return slots


def _file_page_releaser() -> Callable[[int, int], None]:
    """``release(address, nbytes)``: drop from this process the whole pages of a copied tensor's old bytes that
    lie in a mapping of a file (``MADV_DONTNEED``), so that the file's pages and the copy are not both resident
    until the last tensor is copied. The pages stay in the page cache, and reading them again would read the
    file; nothing reads them: no tensor overlaps a moved one. Anonymous memory is never touched (there,
    ``MADV_DONTNEED`` would zero it)."""
    page = mmap.PAGESIZE
    try:
        files = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(v, 16) for v in fields[0].split("-"))
                files.append((start, end))
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError, ValueError):
        return lambda address, nbytes: None

    def release(address: int, nbytes: int) -> None:
        start, end = -(-address // page) * page, (address + nbytes) // page * page
        if end > start and any(lo <= start and end <= hi for lo, hi in files):
            madvise(start, end - start, mmap.MADV_DONTNEED)

    return release


_CHUNK = 8 << 20  # bytes copied between two releases: the most a tensor is held twice


def _copy_releasing(dst: torch.Tensor, src: torch.Tensor, release: Callable[[int, int], None]) -> None:
    """Copy contiguous ``src`` into ``dst`` (same dtype and shape) 8 MiB at a time, releasing each copied piece
    of ``src``'s file pages as it goes: a large tensor (a tied embedding) is never resident twice."""
    if src.nbytes <= _CHUNK:
        dst.copy_(src)
    else:
        to, of = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for start in range(0, src.nbytes, _CHUNK):
            to[start : start + _CHUNK].copy_(of[start : start + _CHUNK])
            release(src.data_ptr() + start, min(_CHUNK, src.nbytes - start))
    release(src.data_ptr(), src.nbytes)  # the whole range (pages that straddle two pieces included)


@torch.no_grad()
def to_huge_pages(model: torch.nn.Module) -> int:
    """Copy ``model``'s CPU parameters and buffers into one mapping advised for 2 MiB pages.

    Each moved tensor is replaced, in every module slot that holds it, by a tensor of the same dtype, shape
    and values (a parameter by a new ``nn.Parameter`` with the same ``requires_grad`` and attributes), so
    ties hold. Each gets a storage of its own, so saving sees no shared tensors; nothing keeps the file
    mapping they were read from. Call it before an optimizer or a compiled graph holds the old objects (the
    loader calls it right after reading). Tensors on other devices, non-contiguous ones, parameter
    subclasses and overlapping views stay where they are. Returns the bytes moved: 0 where
    :func:`huge_pages_available` is false.
    """
    if not huge_pages_available():
        return 0
    groups = _movable(model)
    sizes = [-(-group[0].nbytes // _ALIGN) * _ALIGN for group in groups]
    total = sum(sizes)
    if total == 0:
        return 0
    slots = _slots(model)
    # anonymous and private: shared anonymous memory is shmem, which follows its own huge-page policy.
    # 2 MiB more than needed, so that the tensors can start on a huge-page boundary; the pages before it are
    # never touched, so never backed.
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(region)
    offset = -torch.frombuffer(view[:1], dtype=torch.uint8).data_ptr() % HUGE_PAGE
    release = _file_page_releaser()
    for group, size in zip(groups, sizes):
        first = group[0]
        # torch.frombuffer holds a reference to its slice of the mapping: it lives as long as a tensor uses it
        moved = torch.frombuffer(view[offset : offset + first.nbytes], dtype=torch.uint8)
        moved = moved.view(first.dtype).view(first.shape)
        _copy_releasing(moved, first, release)
        for old in group:
            new = moved
            if isinstance(old, torch.nn.Parameter):
                new = torch.nn.Parameter(moved, requires_grad=old.requires_grad)
                new.__dict__.update(old.__dict__)
            for module, name in slots.get(id(old), []):
                setattr(module, name, new)
        offset += size
    logger.info("hf_maskllm: %.1f MB of weights moved onto transparent huge pages", total / 1e6)
    return total
