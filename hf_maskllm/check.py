"""``check_nm``: verify that a model's weights are N:M sparse, with a per-layer report."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .adapters.layer import MaskedLinear
from .adapters.targets import find_targets
from .errors import MaskLLMError, NMViolationError, TargetError
from .modules import dense_weight_view
from .patterns import check_nm_args, count_nm_violations

__all__ = ["NMReport", "check_nm"]


@dataclass
class NMReport:
    """Result of :func:`check_nm`: groups and violating groups per checked layer."""

    n: int
    m: int
    layers: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (groups, violations)
    # name -> how the layer stores its kept values: "int8, 32 per scale" / "int4, 32 per scale" for
    # quantized compressed layers, else the float dtype ("float32", "bfloat16", ...)
    values: dict[str, str] = field(default_factory=dict)
    # name -> how an output embedding stored as int8 rows (not N:M, not checked) holds its weight
    embeddings: dict[str, str] = field(default_factory=dict)

    @property
    def violations(self) -> dict[str, int]:
        """Layers with at least one group holding more than ``n`` nonzeros, and how many such groups."""
        return {name: bad for name, (_, bad) in self.layers.items() if bad}

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        total = sum(g for g, _ in self.layers.values())
        bad = sum(self.violations.values())
        head = (
            f"{self.n}:{self.m} check: {len(self.layers)} layers, {total:,} groups, {bad:,} violating groups"
        )
        kinds: dict[str, int] = {}
        for kind in self.values.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        if kinds:
            head += "; kept values: " + ", ".join(f"{kind} ({count} layers)" for kind, count in kinds.items())
        for name, kind in self.embeddings.items():
            head += f"; {name}: {kind}"
        return "\n".join(
            [head, *(f"  {name}: {v:,} violating groups" for name, v in self.violations.items())]
        )


def check_nm(
    model: nn.Module,
    n: int = 2,
    m: int = 4,
    target_modules: str | list[str] = "all-linear",
    exclude_modules: str | list[str] | None = None,
    raise_on_violation: bool = True,
) -> NMReport:
    """Check every targeted weight (default: all linears but the output embedding) for the N:M pattern.

    A group violates N:M when more than ``n`` of its ``m`` consecutive input weights are nonzero.
    Layers loaded from a compressed checkpoint (``SparseLinear``, ``QuantizedSparseLinear``) are always
    checked. Raises :class:`NMViolationError` listing the offending layers unless
    ``raise_on_violation=False``; returns the :class:`NMReport` either way it completes (its ``values``
    say how each layer stores its kept values: a float dtype, or ``"int8, 32 per scale"``; its ``embeddings``
    name an output embedding stored as int8 rows).
    """
    check_nm_args(n, m)
    if any(isinstance(module, MaskedLinear) for module in model.modules()):
        raise MaskLLMError(
            "check_nm needs a merged model: call mask_model.merge_and_unload() first (masked layers hold dense weights)."
        )
    from .sparse.int8_embedding import Int8Linear
    from .sparse.linear import SparseLinear
    from .sparse.quantized_linear import QuantizedSparseLinear

    report = NMReport(n, m)
    for name, module in model.named_modules():  # an int8 output embedding (not N:M): reported, not checked
        if isinstance(module, Int8Linear):
            tied = ", tied to the input embedding (stored once)" if module.tied else ""
            report.embeddings[name] = f"int8 output embedding, one float16 scale per row{tied}"
    for name, module in model.named_modules():  # layers loaded from a compressed checkpoint
        if isinstance(module, (SparseLinear, QuantizedSparseLinear)):
            weight = module.dense_weight()
            report.layers[name] = (weight.numel() // m, count_nm_violations(weight, n, m))
            report.values[name] = (
                f"{module.value_type}, {module.group_size} per scale"
                if isinstance(module, QuantizedSparseLinear)
                else str(module.values.dtype).removeprefix("torch.")
            )
    try:
        names = find_targets(model, target_modules, exclude_modules, m, strict=False)
    except TargetError:
        if not report.layers:
            raise
        names = []
    for name in names:
        weight = dense_weight_view(model.get_submodule(name)).detach()
        report.layers[name] = (weight.numel() // m, count_nm_violations(weight, n, m))
        report.values[name] = str(weight.dtype).removeprefix("torch.")
    if raise_on_violation and not report.ok:
        raise NMViolationError(
            f"{len(report.violations)} layer(s) are not {n}:{m} sparse: "
            + ", ".join(f"{k} ({v} groups)" for k, v in list(report.violations.items())[:5])
            + ". Merge a mask (merge_and_unload) or prune them before exporting."
        )
    return report
