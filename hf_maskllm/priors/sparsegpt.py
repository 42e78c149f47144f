"""SparseGPT for N:M masks (Frantar & Alistarh, 2023), following the reference ``fasterprune``.

For a layer with inputs ``X`` (tokens x in) the layer Hessian is ``H = 2/T * X^T X``. With
``U`` the upper Cholesky factor of ``H^-1``, columns are visited left to right in blocks of
``blocksize``; at the first column of each group of ``m`` the ``m - n`` weights of the group with
the smallest OBS saliency ``w_j^2 / U_jj^2`` are pruned, and every pruned (or kept) column's error
``(w - q) / U_jj`` is propagated to the columns on its right (inside the block at once, to later
blocks lazily). ``U_jj^2 = [(H_FF)^-1]_jj`` with ``F = {j, ..., in-1}``, so the saliency is the
loss of removing ``w_j`` when only the columns not yet visited may compensate.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..errors import ConfigError, DataError
from ..patterns import check_nm_args

__all__ = ["HessianStats", "sparsegpt_layer"]


class HessianStats:
    """Running ``sum_t x_t x_t^T`` (float64) over the inputs of one linear layer."""

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.num_tokens = 0

    @staticmethod
    def increment(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``X^T X`` of one batch of inputs ``[..., in]`` (a float32 matmul, float64 for float64 inputs;
        cacheable across layers sharing X)."""
        x = x.detach().reshape(-1, x.shape[-1])
        x = x if x.dtype == torch.float64 else x.float()
        return x.t() @ x, x.shape[0]

    def add(self, inc: tuple[torch.Tensor, int]) -> None:
        self.xtx += inc[0].to(self.xtx)
        self.num_tokens += inc[1]

    def hessian(self) -> torch.Tensor:
        """``H = 2/T * X^T X`` in float64."""
        if self.num_tokens == 0:
            raise DataError(
                "SparseGPT saw no calibration tokens for a layer; pass non-empty calibration data."
            )
        return self.xtx * (2.0 / self.num_tokens)


@contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """On a CPU, run LAPACK on one thread: its blocking, hence its last bits, depends on the thread count."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _upper_cholesky_of_inverse(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Dampen ``h`` by ``percdamp * mean(diag)`` and return the upper Cholesky factor of its inverse.

    If ``h`` is not positive definite after dampening, the dampening is raised 10x (with a warning)
    until it is. On a CPU the factorisations run on one thread, so that the factor, and the mask chosen
    from it, does not depend on the thread count.
    """
    with _one_thread(h.device):
        return _factor(h, percdamp)


def _factor(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    mean_diag = torch.mean(torch.diag(h))
    damp_frac = percdamp
    for _ in range(8):
        hd = h.clone()
        hd.diagonal().add_(damp_frac * mean_diag)
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            # H^-1 = L^-T L^-1 (torch.cholesky_inverse is far slower on CPU).
            eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
            linv = torch.linalg.solve_triangular(chol, eye, upper=False)
            hinv = linv.t() @ linv
            chol_inv, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                if damp_frac != percdamp:
                    warnings.warn(
                        f"SparseGPT: Hessian not positive definite with percdamp={percdamp}; used {damp_frac:g}.",
                        stacklevel=3,
                    )
                return chol_inv
        damp_frac = max(damp_frac * 10.0, 1e-4)
    raise DataError("SparseGPT: the layer Hessian is not positive definite even after heavy dampening.")


@torch.no_grad()
def sparsegpt_layer(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    n: int,
    m: int,
    blocksize: int = 128,
    percdamp: float = 0.01,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune a ``[out, in]`` weight to N:M with SparseGPT (or, given ``mask``, only update it for that mask).

    Args:
        weight: ``[out, in]`` weight (not modified).
        hessian: ``[in, in]`` layer Hessian ``2/T * X^T X`` (any float dtype; handled in float64).
        n, m: keep ``n`` of every ``m`` consecutive inputs.
        blocksize: columns per lazy-update block; rounded down to a multiple of ``m`` (at least ``m``)
            so that no group straddles two blocks.
        percdamp: dampening, as a fraction of the mean Hessian diagonal.
        mask: an N:M bool keep-mask ``[out, in]`` to use instead of choosing one: the OBS weight update
            for that fixed mask (one-shot reconstruction). Inputs that never fire keep their weights.

    Returns:
        ``(updated_weight, mask)``: the OBS-updated weight (zero where pruned; float64 for a float64
        ``weight``, else float32: the dtype of the whole solve) and the bool keep-mask, both
        ``[out, in]``, exactly N:M.
    """
    check_nm_args(n, m)
    rows, cols = weight.shape
    if cols % m:
        raise ConfigError(f"in_features={cols} is not divisible by m={m}; choose an m that divides it.")
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32, copy=True)
    h = hessian.detach().double().clone()
    # Inputs that never fire: no information; the reference zeroes their weights and sets H_jj = 1.
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    if mask is None:
        w[:, dead] = 0.0
    elif tuple(mask.shape) != (rows, cols) or mask.dtype != torch.bool:
        raise ConfigError(
            f"mask must be a bool tensor of shape {(rows, cols)}, got {mask.dtype} {tuple(mask.shape)}."
        )
    hinv = _upper_cholesky_of_inverse(h, percdamp).to(w.dtype)  # U, [in, in]

    bs = max(m, (blocksize // m) * m)
    # Work on W^T ([in, rows]) so that a column of W is a contiguous row here.
    wt = w.t().contiguous()
    fixed = mask is not None
    keep = (
        mask.t().to(w.device).contiguous()
        if fixed
        else torch.zeros(cols, rows, dtype=torch.bool, device=w.device)
    )
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        w1 = wt[i1:i2].clone()  # [count, rows]
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        d1 = torch.diag(hinv1)
        keep1 = keep[i1:i2]  # a view: filled in place
        for i in range(i2 - i1):
            if i % m == 0 and not fixed:
                # Saliency w^2 / U_jj^2 of the group's columns, with the weights as updated so far.
                score = w1[i : i + m] ** 2 / d1[i : i + m].unsqueeze(1) ** 2  # [m, rows]
                top = torch.argsort(score, dim=0, descending=True, stable=True)[:n]
                keep1[i : i + m].scatter_(0, top, True)
            col = w1[i]
            q = col * keep1[i]
            q1[i] = q
            err = (col - q) / d1[i]
            # OBS update of the columns on the right inside the block.
            # (addmm_ with k=1 rather than addr_: addr_ is ~100x slower on CPU.)
            w1[i:].addmm_(hinv1[i, i:].unsqueeze(1), err.unsqueeze(0), alpha=-1.0)
            err1[i] = err
        wt[i1:i2] = q1
        # Lazy update of all later blocks.
        wt[i2:].addmm_(hinv[i1:i2, i2:].t(), err1, alpha=-1.0)
    return wt.t().contiguous(), keep.t().contiguous()
