"""Where the mask is sampled: Gumbel-softmax over the C(m, n) candidates of every group.

Training: ``p = softmax((kappa * logits + g) / tau)`` per group with Gumbel noise ``g``, soft mask
``p @ candidates`` (``[G, C] @ [C, m] -> [G, m]``). Evaluation / export: ``candidates[argmax(logits)]``.

The noise is a counter-based hash of ``(seed, element index)``, not a generator's stream: the same
seed gives the same noise in the forward and in the backward pass (which recomputes it instead of
keeping it), on any device, and inside one fused compiled loop (``torch.compile`` turns these
functions into a single C++ / Triton kernel). The fused training forward / backward of a masked
linear that uses them lives in ``fused_linear.py``.
"""

from __future__ import annotations

import itertools

import torch

from ..patterns import candidate_patterns
from .denormals import LN_FLOAT32_TINY, flush_gradient, flushed_product

__all__ = [
    "bits_to_uniform",
    "draw_seed",
    "gumbel_uniform",
    "hard_indices",
    "hash_bits",
    "hash_index",
    "max_probability",
    "sample_probs",
    "sample_soft_mask",
    "schedule_number",
    "seed_tensor",
    "soft_mask_from_probs",
]

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x045D9F3B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (two multiply-xorshift rounds) on int32 bits.

    int32 so that it vectorises 16-wide on CPU; products wrap like unsigned arithmetic (as torch's own
    int32 ops do) and ``& 0xFFFF`` after each arithmetic right shift makes it a logical one.
    """
    x = (((x >> 16) & 0xFFFF) ^ x) * _HASH_MUL
    x = (((x >> 16) & 0xFFFF) ^ x) * _HASH_MUL
    return ((x >> 16) & 0xFFFF) ^ x


def draw_seed(device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh noise seed: ``[2]`` int32 (two random 32-bit words) from ``device``'s global RNG.

    A tensor on the logits' device, so compiled code never re-specialises on it and a CUDA step
    needs no host round trip; ``torch.manual_seed`` and the Trainer's RNG checkpoints make runs
    reproducible. Under ``torch.distributed`` every rank gets its own noise (the Trainer seeds all
    ranks alike, and each rank sees other data, so each should see other noise too).
    """
    seed = torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        seed = seed + 1_000_003 * torch.distributed.get_rank()
    return _as_int32(seed & _M32)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)`` -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def seed_tensor(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An integer ``seed`` (up to 64 bits) in the ``[2]`` int32 form :func:`draw_seed` returns."""
    return _as_int32(torch.tensor([seed & _M32, (seed >> 32) & _M32], dtype=torch.int64, device=device))


def hash_bits(seed: torch.Tensor, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """32 pseudo-random bits per element, ``[rows, cols]`` int32: a hash of ``seed`` and the element index.

    The index wraps at 2**32 (tensors above 4 G elements would repeat bits).
    """
    return hash_index(seed, torch.arange(rows * cols, device=device, dtype=torch.int32).view(rows, cols))


def hash_index(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """32 pseudo-random bits (int32) per element of ``index`` (int32): a hash of ``seed`` and the index.

    ``(index + seed[0]) ^ seed[1]`` through one full-avalanche hash (:func:`_mix32`): for every seed a
    bijection of the index, so a seed picks a scrambled window of one pseudo-random table. The index
    enters only through ``index + seed[0]`` (an FSDP shard offsets ``seed[0]`` to draw the bits of its
    elements). Two multiply rounds per element, not four: the hash is a large part of a sampling pass,
    and ``tests/numerics/test_sampling.py`` checks the noise it gives (uniformity, independence of a group's
    candidates, Gumbel-max frequencies equal to the softmax).
    """
    return _mix32((index + seed[0]) ^ seed[1])


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """int32 random bits -> float32 uniform in ``(0, 1)``: 23 bits, centred in their bin.

    23, not 24: ``(2**24 - 1) + 0.5`` is not a float32 and would round to ``u = 1`` (infinite noise).
    """
    return (((bits >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / 2**23)


def gumbel_uniform(seed: torch.Tensor, groups: int, choices: int, device: torch.device) -> torch.Tensor:
    """Uniform noise in ``(0, 1)``, ``[groups, choices]`` float32, a pure function of ``seed`` and the index."""
    return bits_to_uniform(hash_bits(seed, groups, choices, device))


def sample_probs(
    logits: torch.Tensor, seed: torch.Tensor, tau: float | torch.Tensor, kappa: float | torch.Tensor
) -> list[torch.Tensor]:
    """``softmax((kappa * logits + g) / tau)`` with ``g = -log(-log u)``: C float32 columns ``[G]``.

    ``tau`` and ``kappa``: numbers or 0-d tensors (a 0-d CPU tensor gives what its value as a number does).

    Column by column (C is small and static) so that compiled code vectorises over groups; a
    softmax over a last dimension of 6 would not. Probabilities below the float32 normal range are
    0, and no denormal is formed on the way (``denormals.py``): exp is never evaluated where its
    result would be denormal (such a probability, at most that result, is below the range too).
    """
    u = gumbel_uniform(seed, logits.shape[0], logits.shape[1], logits.device)
    scores = [
        (kappa * logits[:, c].float() - torch.log(-torch.log(u[:, c]))) / tau for c in range(logits.shape[1])
    ]
    top = scores[0]
    for s in scores[1:]:
        top = torch.maximum(top, s)
    exps = []
    for s in scores:
        shifted = s - top
        exps.append(
            torch.where(shifted < LN_FLOAT32_TINY, 0.0, torch.exp(torch.clamp(shifted, min=LN_FLOAT32_TINY)))
        )
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    inv = 1.0 / total
    return [flushed_product(e, inv) for e in exps]


def soft_mask_from_probs(probs: list[torch.Tensor], n: int, m: int, hard: bool) -> list[torch.Tensor]:
    """The mask's m columns: ``mask_j = sum of p_c over the candidates c that keep position j``.

    ``hard``: the one-hot sample's candidate instead (the straight-through forward value).
    """
    combos = list(itertools.combinations(range(m), n))
    if hard:
        chosen = candidate_patterns(n, m, device=probs[0].device)[torch.stack(probs, dim=-1).argmax(dim=-1)]
        return [chosen[:, j] for j in range(m)]
    columns = []
    for j in range(m):
        keep = [probs[c] for c, combo in enumerate(combos) if j in combo]
        total = keep[0]
        for p in keep[1:]:
            total = total + p
        columns.append(total)
    return columns


def sample_soft_mask(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float | torch.Tensor,
    kappa: float | torch.Tensor,
    hard: bool = False,
    seed: int | None = None,
) -> torch.Tensor:
    """A differentiable mask ``[G, m]`` (float32) sampled from per-group logits ``[G, C]``, by plain autograd.

    For inspection and as the reference of the fused training path (``fused_linear.py``), which
    gives the same values and gradients without keeping per-group tensors. ``tau`` and ``kappa``: numbers
    or 0-d tensors (``MaskSchedule.tensor``). ``seed`` defaults to :func:`draw_seed`. ``hard=True`` is
    straight-through (one-hot forward, soft gradient).
    """
    seed_t = draw_seed(logits.device) if seed is None else seed_tensor(seed, logits.device)
    n, m = int(candidates[0].sum()), candidates.shape[1]
    with torch.autocast(logits.device.type, enabled=False):  # float32 math even under bf16 autocast
        probs = sample_probs(flush_gradient(logits), seed_t, schedule_number(tau), schedule_number(kappa))
        soft = torch.stack(soft_mask_from_probs(probs, n, m, hard=False), dim=-1)
        if not hard:
            return soft
        return soft + (torch.stack(soft_mask_from_probs(probs, n, m, hard=True), dim=-1) - soft).detach()


def schedule_number(value: float | torch.Tensor) -> float | torch.Tensor:
    """A 0-d tensor as it is (compiled code reads its value at run time), any other number as a float."""
    return value if isinstance(value, torch.Tensor) else float(value)


@torch.no_grad()
def hard_indices(logits: torch.Tensor) -> torch.Tensor:
    """Index of the most likely candidate of every group, ``[G]`` (uint8 when ``C <= 255``)."""
    # Logits stored candidate-major (the training layout) are a strided [G, C] view: an argmax over a
    # contiguous copy is several times faster than over the view, with the same result.
    idx = logits.contiguous().argmax(dim=-1)
    return idx.to(torch.uint8) if logits.shape[-1] <= 255 else idx


@torch.no_grad()
def max_probability(logits: torch.Tensor, kappa: float) -> torch.Tensor:
    """Mean over groups of ``max softmax(kappa * logits)``: the paper's convergence signal (0-d tensor)."""
    return (kappa * logits.float()).softmax(dim=-1).amax(dim=-1).mean()
