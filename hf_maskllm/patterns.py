"""Where the N:M pattern is defined.

In every group of ``m`` consecutive weights along the *input* dimension of a ``[out, in]``
weight, ``n`` are kept. The ``C(m, n)`` candidate patterns are enumerated in
``itertools.combinations(range(m), n)`` order, exactly as the MaskLLM reference code does
(for 2:4: ``1100, 1010, 1001, 0110, 0101, 0011``), so candidate indices, logits and saved
masks stay comparable across tools.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import torch

from .errors import ConfigError

__all__ = [
    "candidate_patterns",
    "check_nm_args",
    "count_nm_violations",
    "indices_to_mask",
    "mask_to_indices",
    "num_candidates",
]

MAX_M = 8


def check_nm_args(n: object, m: object) -> None:
    """Raise :class:`ConfigError` unless ``1 <= n < m <= 8`` are ints."""
    if isinstance(n, bool) or isinstance(m, bool) or not isinstance(n, int) or not isinstance(m, int):
        raise ConfigError(f"`n` and `m` must be integers, got n={n!r}, m={m!r}.")
    if not 1 <= n < m <= MAX_M:
        raise ConfigError(
            f"`n` must be at least 1 and smaller than `m`, and `m` at most {MAX_M}; got n={n}, m={m}. "
            "Use for example n=2, m=4 (2:4, what sparse tensor cores accelerate)."
        )


def num_candidates(n: int, m: int) -> int:
    """Number of N:M candidate patterns, ``C(m, n)``."""
    return math.comb(m, n)


@cache
def _patterns_cpu(n: int, m: int) -> torch.Tensor:
    check_nm_args(n, m)
    rows = []
    for keep in itertools.combinations(range(m), n):
        row = [0.0] * m
        for k in keep:
            row[k] = 1.0
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def candidate_patterns(
    n: int, m: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The ``[C(m,n), m]`` 0/1 matrix of candidate patterns, in ``itertools.combinations`` order."""
    return _patterns_cpu(n, m).to(dtype=dtype, device=device)


def indices_to_mask(indices: torch.Tensor, n: int, m: int, shape: tuple[int, int]) -> torch.Tensor:
    """Expand per-group candidate indices (``[out*in/m]``) into a bool mask of ``shape = (out, in)``."""
    cand = candidate_patterns(n, m, dtype=torch.bool, device=indices.device)
    return cand[indices.long()].reshape(shape)


def mask_to_indices(mask: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Candidate index of every group of an exactly N:M bool mask ``[out, in]``; returns int64 ``[out*in/m]``.

    Raises :class:`ConfigError` when ``in`` is not divisible by ``m`` and
    :class:`~hf_maskllm.errors.NMViolationError` when a group does not keep exactly ``n`` weights.
    """
    from .errors import NMViolationError

    if mask.dim() != 2 or mask.shape[1] % m:
        raise ConfigError(
            f"mask must be 2-D with a last dimension divisible by m={m}, got shape {tuple(mask.shape)}."
        )
    # Encode each group as an m-bit integer (one shift-or per position: a reduction over a dimension of m
    # is several times slower), then look the code up in the candidate table; codes of no candidate (a
    # group not keeping exactly n weights) look up -1.
    groups = mask.reshape(-1, m).bool().to(torch.uint8 if m <= 8 else torch.long)
    codes = groups[:, 0].clone()
    for j in range(1, m):
        codes |= groups[:, j] << j
    weights = 2 ** torch.arange(m, device=mask.device)
    cand_codes = (candidate_patterns(n, m, dtype=torch.long, device=mask.device) * weights).sum(dim=1)
    lookup = torch.full((2**m,), -1, dtype=torch.long, device=mask.device)
    lookup[cand_codes] = torch.arange(cand_codes.numel(), device=mask.device)
    indices = lookup[codes.long()]
    bad = indices < 0
    if bool(bad.any()):
        raise NMViolationError(
            f"{int(bad.sum())} of {groups.shape[0]} groups do not keep exactly {n} of {m} weights; "
            "a prior or stored mask must be exactly N:M."
        )
    return indices


def count_nm_violations(weight: torch.Tensor, n: int, m: int) -> int:
    """Number of groups of ``m`` consecutive inputs (rows of ``[out, in]``) with more than ``n`` nonzeros."""
    if weight.dim() != 2 or weight.shape[1] % m:
        raise ConfigError(f"weight must be 2-D with in divisible by m={m}, got shape {tuple(weight.shape)}.")
    nonzero = (weight.reshape(-1, m) != 0).sum(dim=1)
    return int((nonzero > n).sum())
