"""Annealing schedules for the Gumbel temperature ``tau`` and the logit scale ``kappa``."""

from __future__ import annotations

import math

from ..errors import ConfigError

__all__ = ["schedule_value"]


def schedule_value(start: float, end: float, progress: float, kind: str = "linear") -> float:
    """Value at ``progress`` in [0, 1] (clamped) going from ``start`` to ``end``.

    ``linear``: straight line (the paper). ``cosine``: half cosine, slow at both ends.
    ``exponential``: geometric interpolation ``start * (end / start) ** progress``.
    """
    t = min(max(float(progress), 0.0), 1.0)
    if kind == "linear":
        return start + (end - start) * t
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    if kind == "exponential":
        return start * (end / start) ** t
    raise ConfigError(f"Unknown schedule {kind!r}; use 'linear', 'cosine' or 'exponential'.")
