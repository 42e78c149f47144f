"""Activations through a TMA tensor descriptor (Hopper and newer), shared by the matmul kernels.

With a descriptor the copy engine writes the ``x`` tile into shared memory in the MMA's layout and
zero-fills what lies outside ``[T, K]``: the kernel's loop issues no address arithmetic, masks or
shared-memory stores for ``x``. Counted on sm_90a SASS (``benchmarks/kernel_sass.py``) that takes
about a third off the ``tl.dot`` kernel's loop (128 x 128 tiles; bigger ones only fit with TMA) and
13-25% off the ``mma.sync`` decode configs; the decode configs on ``wgmma`` keep pointers.

Each kernel takes both ``x_ptr`` and ``x_desc`` and a per-config ``X_DESC``; the launcher passes
``HAS_DESC`` (whether ``x_desc`` is a real descriptor, part of the autotune key) and
:func:`descriptor_or_pointer_configs` turns configs that want a descriptor into pointer configs
when there is none (rows not 16-byte aligned, pre-Hopper GPUs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["descriptor_or_pointer_configs", "load_x_tile", "set_x_block", "x_descriptor"]


@functools.cache
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def x_descriptor(x2d: torch.Tensor):
    """A TMA descriptor over ``x2d [T, K]`` (its block is set per config), or None where TMA cannot read it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the interpreter emulates TMA
    if not interpret and not (x2d.is_cuda and _hopper_or_newer(x2d.get_device())):
        return None
    row_bytes = x2d.stride(0) * x2d.element_size()
    # rows laid out one after another (a broadcast [1, K] view has stride 0), 16-byte aligned
    if x2d.stride(1) != 1 or x2d.stride(0) < x2d.shape[1] or row_bytes % 16 or x2d.data_ptr() % 16:
        return None
    return TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), [16, 16])


def set_x_block(nargs: dict) -> None:
    """Autotune pre-hook: the descriptor's block is the config's ``[rows, BLOCK_K]`` tile of ``x``.

    Set for pointer configs too: the block is part of the compiled signature, so a block left over
    from the previous config would compile the kernel again.
    """
    if nargs["HAS_DESC"]:
        rows = nargs["BLOCK_M"] if "BLOCK_M" in nargs else nargs["BLOCK_T"]
        nargs["x_desc"].block_shape = [rows, nargs["BLOCK_K"]]


def descriptor_or_pointer_configs(configs: list[triton.Config], has_desc: bool) -> list[triton.Config]:
    """``configs`` as they are when there is a descriptor; otherwise their ``X_DESC=False`` versions."""
    if has_desc:
        return configs
    out = []
    for c in configs:
        if c.kwargs["X_DESC"]:
            c = triton.Config(
                {**c.kwargs, "X_DESC": False},
                num_warps=c.num_warps,
                num_stages=c.num_stages,
                pre_hook=c.pre_hook,
            )
        out.append(c)
    return out


@triton.jit
def load_x_tile(
    x_ptr,
    x_desc,
    row0,
    k0,
    num_rows,
    in_features,
    stride_xt,
    USE_DESC: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows ``[row0, row0 + ROWS)``, columns ``[k0, k0 + BLOCK_K)`` of ``x`` (zeros outside ``[T, K]``):
    through the TMA descriptor when ``USE_DESC``, else with masked pointer loads."""
    if USE_DESC:
        return x_desc.load([row0, k0])
    offs_r = row0 + tl.arange(0, ROWS)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = x_ptr + offs_r.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]  # int64: T * K can exceed 2**31
    if EVEN_K:
        return tl.load(ptrs, mask=(offs_r < num_rows)[:, None], other=0.0)
    return tl.load(ptrs, mask=(offs_r < num_rows)[:, None] & (offs_k < in_features)[None, :], other=0.0)
