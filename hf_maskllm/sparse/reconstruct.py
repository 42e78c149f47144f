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
from .convert import sparse_layer_names

__all__ = ["reconstruct"]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@torch.no_grad()
def reconstruct(
    model: nn.Module,
    calibration: torch.LongTensor,
    masks: dict[str, torch.Tensor] | None = None,
    n: int = 2,
    m: int = 4,
    batch_size: int = 1,
    progress: bool = True,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> list[str]:
    """Update the kept weights of ``model`` for its fixed N:M mask (SparseGPT's OBS update), in place.

    Args:
        model: a :class:`~hf_maskllm.MaskModel` (its hard masks; only kept positions of the base
            weights change, so mask learning can go on), a model with :class:`SparseLinear` layers
            (loaded compressed, or :func:`to_sparse_layers`; ``values`` change, ``meta`` does not), or
            a plain model together with ``masks``.
        calibration: ``[num_samples, seqlen]`` token ids.
        masks: ``{module name: bool [out, in]}``, for a plain model only.
        n, m: the pattern of ``masks`` (taken from the model otherwise).
        batch_size, progress, blocksize, percdamp: as in :func:`hf_maskllm.priors.sparsegpt_prune`.

    Returns:
        The names of the updated layers.
    """
    from ..adapters.model import MaskModel

    if isinstance(model, MaskModel):
        if masks is not None:
            raise ConfigError("a MaskModel is reconstructed for its own hard masks; do not pass masks.")
        masks = model.hard_masks()
        n, m = model.mask_config.n, model.mask_config.m
        with model._merged_view() as merged:  # plain layers holding W * mask
            sparsegpt_reconstruct(merged, masks, calibration, n, m, batch_size, progress, blocksize, percdamp)
            updated = {name: dense_weight_view(merged.get_submodule(name)).detach().clone() for name in masks}
        for name, layer in model.masked_layers().items():  # the originals are back: write the kept positions
            weight = dense_weight_view(layer.base_layer)
            weight.copy_(torch.where(masks[name], updated.pop(name).to(weight.dtype), weight))
        return list(masks)

    names = sparse_layer_names(model)
    if names:
        if masks is not None:
            raise ConfigError(
                "a model with SparseLinear layers is reconstructed for its stored masks; do not pass masks."
            )
        layers = {name: model.get_submodule(name) for name in names}
        patterns = {(layer.n, layer.m) for layer in layers.values()}
        if len(patterns) > 1:
            raise ConfigError(
                f"the SparseLinear layers mix N:M patterns {sorted(patterns)}; reconstruct them one pattern at a time."
            )
        (n, m), masks = patterns.pop(), {name: layer.keep_mask() for name, layer in layers.items()}
        dense = {name: layer.to_dense() for name, layer in layers.items()}
        try:
            for name, layer in dense.items():
                _set(model, name, layer)
            sparsegpt_reconstruct(model, masks, calibration, n, m, batch_size, progress, blocksize, percdamp)
            for name, layer in layers.items():
                weight = dense_weight_view(dense[name])
                layer.values.copy_(weight.gather(1, layer.kept_columns()).to(layer.values.dtype))
        finally:
            for name, layer in layers.items():
                _set(model, name, layer)
        return names

    if masks is None:
        raise ConfigError(
            f"{type(model).__name__} has no mask: pass masks={{name: bool [out, in]}}, or call reconstruct on a "
            "MaskModel or a model with SparseLinear layers."
        )
    sparsegpt_reconstruct(model, masks, calibration, n, m, batch_size, progress, blocksize, percdamp)
    return list(masks)
