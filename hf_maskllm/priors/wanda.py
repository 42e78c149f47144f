"""Wanda: prune by ``|W_ij| * ||X_j||_2`` (weight magnitude times input-feature norm).

``X_j`` is input feature ``j`` of the layer over every calibration token (Sun et al., 2023).
"""

from __future__ import annotations

import torch

from ..errors import DataError
from .magnitude import nm_mask_from_scores

__all__ = ["InputNormStats", "wanda_mask"]


class InputNormStats:
    """Running sum of squared input features, ``sum_t X_tj^2``, for one linear layer."""

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        self.sq_sum = torch.zeros(in_features, dtype=torch.float64, device=device)
        self.num_tokens = 0

    @staticmethod
    def increment(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Statistics of one batch of inputs ``[..., in]`` (cacheable when several layers share an input)."""
        x = x.detach().reshape(-1, x.shape[-1])
        x = x if x.dtype == torch.float64 else x.float()
        return x.pow(2).sum(dim=0), x.shape[0]

    def add(self, inc: tuple[torch.Tensor, int]) -> None:
        self.sq_sum += inc[0].to(self.sq_sum)
        self.num_tokens += inc[1]

    def norms(self) -> torch.Tensor:
        """``||X_j||_2`` over all tokens seen, float32 ``[in]``."""
        if self.num_tokens == 0:
            raise DataError("Wanda saw no calibration tokens for a layer; pass non-empty calibration data.")
        return self.sq_sum.sqrt().float()


def wanda_mask(weight: torch.Tensor, input_norms: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M mask of a ``[out, in]`` weight keeping the largest ``|W_ij| * ||X_j||`` per group."""
    scores = weight.detach().float().abs() * input_norms.to(weight.device).float().unsqueeze(0)
    return nm_mask_from_scores(scores, n, m)
