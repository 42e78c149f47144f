"""One-shot reconstruction for a fixed mask: the mask stays bit for bit, the kept weights move closer to the
dense layers' outputs, on a MaskModel and on a loaded compressed model (with its dense source)."""

from __future__ import annotations

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)
from sparse_helpers import tokens
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, check_nm, get_mask_model
from hf_maskllm.errors import ConfigError
from hf_maskllm.modules import dense_weight_view
from hf_maskllm.sparse import SparseLinear, reconstruct, save_compressed


def layer_inputs(model, names: list[str], calibration) -> dict[str, torch.Tensor]:
    """The inputs of each named layer when ``model`` runs on ``calibration``."""
    inputs, handles = {}, []

    def record(name: str):
        def hook(module, args, output) -> None:  # returns None: the output is left alone
            inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_hook(record(name)))
    with torch.no_grad():
        model(calibration)
    for h in handles:
        h.remove()
    return inputs


def effective_weights(model, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, SparseLinear):
            out[name] = module.dense_weight().detach().clone()
        else:  # MaskedLinear in eval mode: W * hard mask
            out[name] = (dense_weight_view(module.base_layer) * module.hard_mask()).detach().clone()
    return out


def assert_reconstruction_helps(model, dense, names, calibration, mask_only, logits_mask_only) -> None:
    """Block 0 sees the same inputs in every variant (the dense model's, which SparseGPT's statistics of
    block 0 are built from): there the updated weights reproduce each dense layer's output better than
    the mask alone. End to end, the logits move closer to the dense model's."""
    dense_weights = effective_dense(dense, names)
    block0 = [n for n in names if n.startswith("model.layers.0.")]
    inputs = layer_inputs(dense, block0, calibration)
    updated = effective_weights(model, block0)
    for name in block0:
        x = inputs[name]
        err_mask = float(((x @ (dense_weights[name] - mask_only[name]).t()) ** 2).sum())
        err_rec = float(((x @ (dense_weights[name] - updated[name]).t()) ** 2).sum())
        assert err_rec < 0.9 * err_mask, (name, err_mask, err_rec)
    with torch.no_grad():
        target = dense(calibration).logits
        assert float(((model(calibration).logits - target) ** 2).mean()) < float(
            ((logits_mask_only - target) ** 2).mean()
        )


def effective_dense(model, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: dense_weight_view(model.get_submodule(n)).detach().clone() for n in names}


def test_reconstruct_keeps_the_mask_and_lowers_layer_error(tmp_path):
    dense = tiny_llama()
    calibration = tokens(8, 3)
    mm = get_mask_model(tiny_llama(), MaskConfig(n=2, m=4, prior="magnitude")).eval()
    names = list(mm.masked_names)
    masks = mm.hard_masks()
    mask_only = effective_weights(mm.base_model, names)
    with torch.no_grad():
        logits_mask_only = mm.base_model(calibration).logits
    updated = reconstruct(mm, calibration, progress=False)
    assert sorted(updated) == sorted(names)
    assert all(torch.equal(masks[n], m) for n, m in mm.hard_masks().items())  # the mask, bit for bit
    assert_reconstruction_helps(mm.base_model, dense, names, calibration, mask_only, logits_mask_only)
    # pruned positions of the base weights are untouched, so mask learning can go on
    dense_weights = effective_dense(dense, names)
    for name, layer in mm.masked_layers().items():
        assert torch.equal(
            dense_weight_view(layer.base_layer)[~masks[name]], dense_weights[name][~masks[name]]
        )

    # the same on a loaded compressed model (with its dense source): meta unchanged, values updated, N:M
    merged = get_mask_model(tiny_llama(), MaskConfig(n=2, m=4, prior="magnitude")).merge_and_unload()
    save_compressed(merged, tmp_path / "c")
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    metas = {n: mod.meta.clone() for n, mod in sparse.named_modules() if isinstance(mod, SparseLinear)}
    mask_only = effective_weights(sparse, names)
    with torch.no_grad():
        logits_mask_only = sparse(calibration).logits
    with pytest.raises(ConfigError, match="dense_model"):
        reconstruct(sparse, calibration, progress=False)
    reconstruct(sparse, calibration, dense_model=dense, progress=False)
    assert all(
        torch.equal(mod.meta, metas[n]) for n, mod in sparse.named_modules() if isinstance(mod, SparseLinear)
    )
    assert_reconstruction_helps(sparse, dense, names, calibration, mask_only, logits_mask_only)
    assert check_nm(sparse, 2, 4).ok


def test_reconstruct_needs_masks_for_a_plain_model():
    with pytest.raises(ConfigError, match="pass masks"):
        reconstruct(tiny_llama(), tokens(2, 0), progress=False)
