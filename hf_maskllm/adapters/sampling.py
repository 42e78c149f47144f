"""Where the mask is sampled: Gumbel-softmax over the C(m, n) candidates of every group.

Training: ``p = gumbel_softmax(kappa * logits, tau)`` per group, soft mask ``p @ candidates``
(``[G, C] @ [C, m] -> [G, m]``). Evaluation / export: ``candidates[argmax(logits)]``.
"""

from __future__ import annotations

import torch

__all__ = ["hard_indices", "max_probability", "sample_soft_mask"]


def sample_soft_mask(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    hard: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample a differentiable mask ``[G, m]`` (float32) from per-group logits ``[G, C]``.

    ``hard=True`` is straight-through: the forward value is the one-hot argmax sample, the
    gradient that of the soft sample.
    """
    scores = kappa * logits.float()  # [G, C]
    # Gumbel(0, 1) noise: -log(Exp(1)).
    noise = torch.empty_like(scores).exponential_(generator=generator).log_().neg_()
    probs = ((scores + noise) / tau).softmax(dim=-1)  # [G, C]
    if hard:
        one_hot = torch.zeros_like(probs).scatter_(-1, probs.argmax(dim=-1, keepdim=True), 1.0)
        probs = one_hot - probs.detach() + probs
    return probs @ candidates.to(probs.dtype)  # [G, m]


@torch.no_grad()
def hard_indices(logits: torch.Tensor) -> torch.Tensor:
    """Index of the most likely candidate of every group, ``[G]`` (uint8 when ``C <= 255``)."""
    idx = logits.argmax(dim=-1)
    return idx.to(torch.uint8) if logits.shape[-1] <= 255 else idx


@torch.no_grad()
def max_probability(logits: torch.Tensor, kappa: float) -> torch.Tensor:
    """Mean over groups of ``max softmax(kappa * logits)``: the paper's convergence signal (0-d tensor)."""
    return (kappa * logits.float()).softmax(dim=-1).amax(dim=-1).mean()
