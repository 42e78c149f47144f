"""PEFT LoRA on compressed N:M layers, through PEFT's custom-module dispatch (``LoraConfig._register_custom_module``).

:class:`SparseLoraLinear` is the LoRA layer PEFT builds around a :class:`SparseLinear`. Its update
is restricted to the kept positions: the layer computes ``x @ (W + P(s * B @ A))^T`` where ``P``
keeps the entries of the N:M pattern and zeroes the rest, so training, ``merge()`` and PEFT's
``merge_and_unload()`` all give a model that is exactly N:M (the merge adds ``P(s * B @ A)`` to the
kept ``values``). The price: each forward builds the ``[out, in]`` product ``B @ A`` (as DoRA does).

PEFT picks the LoRA layer for a base layer from a fixed list, and takes others only from the
config it is given, so a ``LoraConfig`` for a compressed model goes through :func:`register_lora`::

    peft_model = get_peft_model(model, register_lora(LoraConfig(r=16, target_modules=["q_proj"])))

and so does loading a saved adapter onto a compressed model::

    config = register_lora(LoraConfig.from_pretrained(adapter_dir))
    peft_model = PeftModel.from_pretrained(model, adapter_dir, config=config)

Without it PEFT refuses the layer ("Target module SparseLinear(...) is not supported"); what the layer
shows of itself in that message names ``register_lora``.

On a :class:`QuantizedSparseLinear` (int8 / int4 kept values) the adapter trains and runs the same
way, but does not merge (that would round the kept values again).

LoRA variants that cannot be restricted to the pattern (DoRA and the others PEFT implements as
variants) are refused; mixed-adapter batches (``adapter_names=``) are refused.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from ..errors import ConfigError
from .format import decompress
from .linear import SparseLinear
from .quantized_linear import QuantizedSparseLinear

__all__ = ["SparseLoraLinear", "register_lora"]


class SparseLoraLinear(LoraLinear):
    """LoRA around a :class:`SparseLinear` whose update keeps the N:M pattern (see the module docstring)."""

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: LoraConfig | None = None, **kwargs: Any
    ) -> None:
        # PEFT >= 0.19 passes the LoraConfig as ``config``; PEFT 0.18 passes its fields as keywords
        if config is not None:
            kwargs["config"] = config
        with warnings.catch_warnings():  # PEFT warns about any layer type it does not know
            warnings.filterwarnings("ignore", message="Unsupported layer type")
            super().__init__(base_layer, adapter_name, **kwargs)
        self.fan_in_fan_out = False  # SparseLinear stores [out, in] even when it replaced a GPT-2 Conv1D
        self.is_target_conv_1d_layer = False

    def resolve_lora_variant(self, **kwargs: Any) -> Any:
        """Refuse every LoRA variant PEFT would build (DoRA, aLoRA, Arrow, ...): none keeps the N:M pattern.

        PEFT resolves the variant in ``update_layer`` before creating the adapter's weights, for the first
        adapter and for any added later, whatever the PEFT version's argument style.
        """
        variant = super().resolve_lora_variant(**kwargs)
        if variant is not None:
            sparse = self.get_base_layer()
            raise ConfigError(
                f"LoRA variant {type(variant).__name__} cannot be restricted to the N:M pattern of "
                f"{type(sparse).__name__}; use plain LoRA on a compressed model, or make it dense first "
                "(model.dequantize())."
            )
        return None

    def kept_delta(self, adapter: str) -> torch.Tensor:
        """``[out, kept]``: ``s * B @ A`` at the kept positions (differentiable with respect to A and B)."""
        base = self.get_base_layer()
        delta = (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]
        return delta.gather(1, base.kept_columns())

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """The dense ``[out, in]`` weight change of ``adapter``: ``s * B @ A`` with the pruned entries zero."""
        base = self.get_base_layer()
        return decompress(self.kept_delta(adapter), base.meta, base.n, base.m, base.in_features)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add each adapter's pattern-restricted update to the kept ``values`` (the layer stays N:M)."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        base = self.get_base_layer()
        if isinstance(base, QuantizedSparseLinear):
            raise ConfigError(
                f"cannot merge a LoRA adapter into the {base.value_type} kept values of a quantized layer (it would "
                "round them again). Keep the adapter unmerged, or train it on the float compressed model (saved "
                "without `values`), merge there, then save with values='int8' / 'int4'."
            )
        for adapter in check_adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_A:
                continue
            values = base.values + self.kept_delta(adapter).to(base.values.dtype)
            bias = None
            if self.lora_bias[adapter]:
                if base.bias is None:
                    raise ConfigError("cannot merge lora_bias=True into a layer without bias.")
                bias = base.bias + (self.lora_B[adapter].bias * self.scaling[adapter]).to(base.bias.dtype)
            if safe_merge and not (
                torch.isfinite(values).all() and (bias is None or torch.isfinite(bias).all())
            ):
                raise ValueError(
                    f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken"
                )
            base.values.copy_(values)  # in place: bumps the version, so the dense cache is rebuilt
            if bias is not None:
                base.bias.copy_(bias)
            self.merged_adapters.append(adapter)

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        base = self.get_base_layer()
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter not in self.lora_A:
                continue
            base.values.sub_(self.kept_delta(adapter).to(base.values.dtype))
            if self.lora_bias[adapter]:
                base.bias.sub_((self.lora_B[adapter].bias * self.scaling[adapter]).to(base.bias.dtype))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ConfigError(
                "mixed-adapter batches (adapter_names=...) are not supported on compressed N:M layers; "
                "use model.set_adapter(name) per batch."
            )
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        base = self.get_base_layer()
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            delta = decompress(self.kept_delta(adapter), base.meta, base.n, base.m, base.in_features)
            h = self._cast_input_dtype(self.lora_dropout[adapter](x), delta.dtype)
            update = F.linear(h, delta)
            if self.lora_bias[adapter]:
                update = update + self.lora_B[adapter].bias * self.scaling[adapter]
            result = result + update.to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora.Sparse" + nn.Module.__repr__(self)


def register_lora(config: LoraConfig) -> LoraConfig:
    """Map :class:`SparseLinear` to :class:`SparseLoraLinear` in ``config`` and return it.

    Pass every ``LoraConfig`` meant for a model with compressed layers through it (PEFT's
    custom-module dispatch; the mapping is not saved with the adapter): ``get_peft_model``,
    ``PeftModel.from_pretrained(..., config=...)``, ``add_adapter``. Without it PEFT refuses the
    compressed layers ("Target module SparseLinear(...) is not supported").
    """
    if not (config._custom_modules or {}).get(SparseLinear):
        config._register_custom_module({SparseLinear: SparseLoraLinear})
    if not (config._custom_modules or {}).get(QuantizedSparseLinear):
        config._register_custom_module({QuantizedSparseLinear: SparseLoraLinear})
    return config
