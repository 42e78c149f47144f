"""One-shot reconstruction with a fixed mask: SparseGPT's OBS weight update for the mask a model already has.

The mask is not changed (bit for bit); only the kept weights move, layer by layer on calibration
data, so that each layer's output on its (already reconstructed) inputs stays close to the dense
layer's. The solve is :func:`hf_maskllm.priors.sparsegpt_reconstruct` (the SparseGPT code, with the
mask given instead of chosen).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..modules import dense_weight_view
from ..priors.calibration import sparsegpt_reconstruct
from .linear import sparse_layer_names

__all__ = ["reconstruct"]


def _carries_masks(model: nn.Module) -> bool:
    """A model with learnable masks (a :class:`~hf_maskllm.MaskModel`): it has ``masked_layers()`` and ``hard_masks()``."""
    return callable(getattr(model, "masked_layers", None)) and callable(getattr(model, "hard_masks", None))


@torch.no_grad()
def reconstruct(
    model: nn.Module,
    calibration: torch.LongTensor,
    masks: dict[str, torch.Tensor] | None = None,
    dense_model: nn.Module | None = None,
    n: int = 2,
    m: int = 4,
    batch_size: int = 1,
    progress: bool = True,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> list[str]:
    """Update the kept weights of ``model`` for its fixed N:M mask (SparseGPT's OBS update), in place.

    The update compensates, with the kept weights, for the pruned weights' contribution to each
    layer's output, so it needs the dense weights. Layers are solved block by block; each block sees
    the already-updated blocks before it.

    Args:
        model: a :class:`~hf_maskllm.MaskModel` (its hard masks; its frozen base weights are the dense
            weights; only their kept positions change, so mask learning can go on); a model with
            :class:`SparseLinear` layers (``values`` change, ``meta`` does not) together with
            ``dense_model``; or a plain dense model together with ``masks`` (pruned in place). A
            model is taken for a MaskModel by what it offers: ``masked_layers()`` (``{name: layer}``,
            each layer with its dense ``base_layer`` and its ``n``, ``m``), ``hard_masks()``
            (``{name: bool [out, in]}``) and ``get_base_model()`` (the model that holds the layers).
        calibration: ``[num_samples, seqlen]`` token ids.
        masks: ``{module name: bool [out, in]}``, for a plain model only.
        dense_model: for a model with SparseLinear layers: the dense model it was pruned from (same
            module names), which holds the pruned weights the update needs.
        n, m: the pattern of ``masks`` (taken from the model otherwise).
        batch_size, progress, blocksize, percdamp: as in :func:`hf_maskllm.priors.sparsegpt_prune`.

    Returns:
        The names of the updated layers.
    """
    solve = dict(batch_size=batch_size, progress=progress, blocksize=blocksize, percdamp=percdamp)
    if _carries_masks(model):
        if masks is not None or dense_model is not None:
            raise ConfigError(
                "a MaskModel is reconstructed for its own hard masks and base weights; pass neither masks nor dense_model."
            )
        layers = model.masked_layers()
        patterns = {(layer.n, layer.m) for layer in layers.values()}
        if len(patterns) != 1:
            raise ConfigError(
                f"the masked layers have N:M patterns {sorted(patterns)}; reconstruct needs one pattern."
            )
        (n, m), masks = patterns.pop(), model.hard_masks()
        originals = {
            name: dense_weight_view(layer.base_layer).detach().to("cpu", copy=True)
            for name, layer in layers.items()
        }
        base = model.get_base_model()
        try:
            for name, layer in layers.items():  # the plain dense layers in place of the wrappers
                base.set_submodule(name, layer.base_layer)
            sparsegpt_reconstruct(base, masks, calibration, n, m, **solve)
        finally:
            for name, layer in layers.items():
                base.set_submodule(name, layer)
                weight = dense_weight_view(layer.base_layer)  # updated, zero where pruned
                original = originals.pop(name).to(weight.device)
                weight.copy_(torch.where(masks[name].to(weight.device), weight, original))  # pruned ones back
        return list(masks)

    names = sparse_layer_names(model)
    if names:
        if masks is not None:
            raise ConfigError(
                "a model with SparseLinear layers is reconstructed for its stored masks; do not pass masks."
            )
        if dense_model is None:
            raise ConfigError(
                "compressed layers no longer hold the pruned weights, which the update compensates for; pass "
                "dense_model= (the dense model this one was pruned from), or reconstruct the MaskModel before merging."
            )
        layers = {name: model.get_submodule(name) for name in names}
        patterns = {(layer.n, layer.m) for layer in layers.values()}
        if len(patterns) > 1:
            raise ConfigError(
                f"the SparseLinear layers mix N:M patterns {sorted(patterns)}; reconstruct them one pattern at a time."
            )
        (n, m), masks = patterns.pop(), {name: layer.keep_mask() for name, layer in layers.items()}
        dense = {}
        for name, layer in layers.items():
            source = dense_model.get_submodule(name)
            weight = dense_weight_view(source)
            if tuple(weight.shape) != (layer.out_features, layer.in_features):
                raise ConfigError(
                    f"dense_model's {name} has shape {list(weight.shape)}, not {[layer.out_features, layer.in_features]}; pass the model this one was pruned from."
                )
            copy = layer.to_dense()
            dense_weight_view(copy).copy_(weight.to(layer.values.dtype))
            dense[name] = copy
        try:
            for name, copy in dense.items():
                model.set_submodule(name, copy)
            sparsegpt_reconstruct(model, masks, calibration, n, m, **solve)
            for name, layer in layers.items():
                layer.values.copy_(
                    dense_weight_view(dense[name]).gather(1, layer.kept_columns()).to(layer.values.dtype)
                )
        finally:
            for name, layer in layers.items():
                model.set_submodule(name, layer)
        return names

    if masks is None:
        raise ConfigError(
            f"{type(model).__name__} has no mask: pass masks={{name: bool [out, in]}}, or call reconstruct on a "
            "MaskModel or a model with SparseLinear layers."
        )
    sparsegpt_reconstruct(model, masks, calibration, n, m, **solve)
    return list(masks)
