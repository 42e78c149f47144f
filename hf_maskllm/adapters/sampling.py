"""Where the mask is sampled: Gumbel-softmax over the C(m, n) candidates of every group.

Training: ``p = softmax((kappa * logits + g) / tau)`` per group with Gumbel noise ``g``, soft mask
``p @ candidates`` (``[G, C] @ [C, m] -> [G, m]``). Evaluation / export: ``candidates[argmax(logits)]``.

The sample is a custom autograd function that keeps nothing per group alive for the backward
pass: it saves the logits (a parameter, no copy) and the noise *seed*, and recomputes noise and
probabilities in backward. That removes the ``[G, C]`` noise and probability tensors autograd
would otherwise hold for every masked layer until the backward pass (about 12 bytes per masked
weight for 2:4). ``set_compiled_sampling(True)`` additionally fuses the per-group math with
``torch.compile`` (worth it on CPU for long runs; costs a compile at first use).
"""

from __future__ import annotations

import torch

__all__ = ["hard_indices", "max_probability", "sample_soft_mask", "set_compiled_sampling"]

_COMPILED: dict[str, object] = {}
_USE_COMPILED = False


def set_compiled_sampling(enabled: bool) -> bool:
    """Fuse the sampling math with ``torch.compile`` (first call compiles); returns the previous setting."""
    global _USE_COMPILED
    previous, _USE_COMPILED = _USE_COMPILED, bool(enabled)
    return previous


def _uniform(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """Uniform(0, 1) noise reproducible from ``seed`` (regenerated identically in backward)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, device=device).uniform_(generator=generator).clamp_(min=1e-30)


def _probs(logits: torch.Tensor, u: torch.Tensor, tau: float, kappa: float) -> torch.Tensor:
    # p = softmax((kappa * logits + g) / tau), g = -log(-log(u)) ~ Gumbel(0, 1)
    gumbel = -torch.log(-torch.log(u))
    return torch.softmax((kappa * logits.float() + gumbel) / tau, dim=-1)


def _mask_fwd(logits, u, tau, kappa, candidates, hard: bool):
    probs = _probs(logits, u, tau, kappa)  # [G, C]
    if hard:  # straight-through: forward the one-hot sample, backward the soft gradient
        return candidates[probs.argmax(dim=-1)]
    return probs @ candidates  # [G, m]


def _mask_bwd(grad_mask, logits, u, tau, kappa, candidates):
    probs = _probs(logits, u, tau, kappa)  # recomputed, not saved
    dp = grad_mask.float() @ candidates.t()  # dL/dp  [G, C]
    ds = probs * (dp - (probs * dp).sum(dim=-1, keepdim=True))  # softmax backward
    return ds * (kappa / tau)  # ds/dlogits = kappa / tau


def _fn(name: str):
    if not _USE_COMPILED:
        return {"fwd": _mask_fwd, "bwd": _mask_bwd}[name]
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile({"fwd": _mask_fwd, "bwd": _mask_bwd}[name], dynamic=True)
    return _COMPILED[name]


class _GumbelMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, candidates, tau, kappa, hard, seed):
        u = _uniform(logits.shape, seed, logits.device)
        with torch.autocast(logits.device.type, enabled=False):  # float32 math even under bf16 autocast
            mask = _fn("fwd")(logits, u, tau, kappa, candidates, hard)
        ctx.save_for_backward(logits, candidates)
        ctx.tau, ctx.kappa, ctx.seed = tau, kappa, seed
        return mask

    @staticmethod
    def backward(ctx, grad_mask):
        logits, candidates = ctx.saved_tensors
        u = _uniform(logits.shape, ctx.seed, logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            grad = _fn("bwd")(grad_mask, logits, u, ctx.tau, ctx.kappa, candidates)
        return grad.to(logits.dtype), None, None, None, None, None


def sample_soft_mask(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    kappa: float,
    hard: bool = False,
    seed: int | None = None,
) -> torch.Tensor:
    """Sample a differentiable mask ``[G, m]`` (float32) from per-group logits ``[G, C]``.

    ``seed`` defaults to a draw from torch's global RNG, so ``torch.manual_seed`` (and the
    Trainer's RNG checkpointing) make runs reproducible. ``hard=True`` is straight-through.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # The Trainer seeds every rank alike: give each rank its own noise, as its own data.
            seed = (seed + 1_000_003 * torch.distributed.get_rank()) % 2**62
    return _GumbelMask.apply(logits, candidates.float(), float(tau), float(kappa), bool(hard), seed)


@torch.no_grad()
def hard_indices(logits: torch.Tensor) -> torch.Tensor:
    """Index of the most likely candidate of every group, ``[G]`` (uint8 when ``C <= 255``)."""
    idx = logits.argmax(dim=-1)
    return idx.to(torch.uint8) if logits.shape[-1] <= 255 else idx


@torch.no_grad()
def max_probability(logits: torch.Tensor, kappa: float) -> torch.Tensor:
    """Mean over groups of ``max softmax(kappa * logits)``: the paper's convergence signal (0-d tensor)."""
    return (kappa * logits.float()).softmax(dim=-1).amax(dim=-1).mean()
