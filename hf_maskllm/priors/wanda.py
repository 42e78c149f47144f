"""Wanda: prune by ``|W_ij| * ||X_j||_2`` (weight magnitude times input-feature norm).

``X_j`` is input feature ``j`` of the layer over every calibration token (Sun et al., 2023).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import DataError
from ..modules import dense_weight_view
from .magnitude import nm_mask_from_scores

__all__ = ["InputNormStats", "input_norms", "wanda_mask"]


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


@torch.no_grad()
def input_norms(
    model: nn.Module, names: Sequence[str], tokens: torch.Tensor, batch_size: int = 4
) -> dict[str, torch.Tensor]:
    """``{name: ||X_j||_2}`` (float32 ``[in]``) of the layers ``names`` of ``model``: their input features
    over every token of ``tokens`` (``[S, L]`` ids), in one pass of the model as it is (eval mode, no
    gradient), ``batch_size`` sequences per forward. Squares are summed in float64."""
    stats = {name: InputNormStats(dense_weight_view(model.get_submodule(name)).shape[1]) for name in names}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, inputs, name=name: stats[name].add(InputNormStats.increment(inputs[0].double()))
        )
        for name in names
    ]
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    try:
        for batch in tqdm(tokens.split(batch_size), desc="Input norms (Wanda order)", leave=False):
            model(input_ids=batch.to(device))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return {name: stat.norms() for name, stat in stats.items()}
