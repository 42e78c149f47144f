"""to_sparse_layers: a MaskModel merge turned into mask-keeping SparseLinear layers trains with Trainer, stays
N:M and saves compressed; layers that are not N:M are refused."""

from __future__ import annotations

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)
from sparse_helpers import NMEveryStep, args, tokens
from trainer_helpers import TokenDataset
from transformers import AutoModelForCausalLM, Trainer

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.sparse import SparseLinear, to_sparse_layers


def test_mask_model_merge_to_mask_keeping_layers_trains_and_saves(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig(n=2, m=4, prior="magnitude"))
    names = list(mm.masked_names)
    masks = mm.hard_masks()
    model = to_sparse_layers(mm.merge_and_unload(), 2, 4, modules=names)
    assert all(isinstance(model.get_submodule(n), SparseLinear) for n in names)
    recorder = NMEveryStep(model)
    Trainer(
        model=model,
        args=args(tmp_path, max_steps=3),
        train_dataset=TokenDataset(tokens(16, 2)),
        callbacks=[recorder],
    ).train()
    assert recorder.violations == [0, 0, 0]
    assert all(
        torch.equal(model.get_submodule(n).keep_mask() | ~masks[n], torch.ones_like(masks[n])) for n in names
    )
    model.save_pretrained(tmp_path / "s")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    assert sorted(n for n, mod in loaded.named_modules() if isinstance(mod, SparseLinear)) == sorted(names)


def test_to_sparse_layers_refuses_layers_that_are_not_nm():
    from hf_maskllm.errors import NMViolationError

    with pytest.raises(NMViolationError, match="not 2:4 sparse"):
        to_sparse_layers(tiny_llama(), 2, 4, modules=["model.layers.0.mlp.up_proj"])
