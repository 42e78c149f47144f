"""Magnitude pruning, and the N:M selection rule every prior shares.

Each row of a ``[out, in]`` weight is cut into groups of ``m`` consecutive inputs; in each group
the ``n`` highest-scoring weights are kept. Ties go to the lower input index (stable sort), so
masks are deterministic.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..patterns import check_nm_args

__all__ = ["magnitude_mask", "nm_mask_from_scores"]


def nm_mask_from_scores(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Bool mask ``[out, in]`` keeping the ``n`` highest scores in every group of ``m`` consecutive inputs."""
    check_nm_args(n, m)
    if scores.dim() != 2 or scores.shape[1] % m:
        raise ConfigError(f"scores must be 2-D with in divisible by m={m}, got shape {tuple(scores.shape)}.")
    groups = scores.reshape(-1, m)  # [out*in/m, m]
    keep = torch.argsort(groups, dim=1, descending=True, stable=True)[:, :n]
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, keep, True)
    return mask.reshape(scores.shape)


def magnitude_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M mask of a ``[out, in]`` weight keeping the largest ``|W|`` per group. Needs no data."""
    return nm_mask_from_scores(weight.detach().float().abs(), n, m)
