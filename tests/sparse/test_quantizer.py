"""The hf_maskllm_nm quantizer on a loaded compressed model: Trainer trains it directly (it stays N:M and
round-trips exactly), and dequantize() gives the dense model back."""

from __future__ import annotations

import json

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file
from sparse_helpers import NMEveryStep, args, merged_model, tokens, values_of
from trainer_helpers import TokenDataset
from transformers import AutoModelForCausalLM, Trainer

from hf_maskllm.sparse import SparseLinear, save_compressed


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_trainer_trains_a_loaded_compressed_model_and_it_stays_nm(kind, tmp_path):
    save_compressed(merged_model(kind), tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    before = values_of(model)
    metas = {n: mod.meta.clone() for n, mod in model.named_modules() if isinstance(mod, SparseLinear)}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dense_equivalent = sum(
        mod.in_features * mod.out_features - mod.values.numel()
        for mod in model.modules()
        if isinstance(mod, SparseLinear)
    )
    assert dense_equivalent > 0 and trainable > 0  # the pruned half is not a parameter at all
    recorder = NMEveryStep(model)
    trainer = Trainer(
        model=model, args=args(tmp_path), train_dataset=TokenDataset(tokens(32, 0)), callbacks=[recorder]
    )
    trainer.train()
    assert recorder.violations == [0, 0, 0, 0]
    after = values_of(model)
    assert all(not torch.equal(after[n], before[n]) for n in before)  # every compressed layer learned
    assert all(
        torch.equal(mod.meta, metas[n]) for n, mod in model.named_modules() if isinstance(mod, SparseLinear)
    )
    # save, load, re-save: the trained model round-trips exactly
    model.save_pretrained(tmp_path / "t1")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "t1")
    again.save_pretrained(tmp_path / "t2")
    first, second = (
        load_file(tmp_path / "t1" / "model.safetensors"),
        load_file(tmp_path / "t2" / "model.safetensors"),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    ids = tokens(2, 9)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_dequantize_gives_the_dense_model_with_zeros(tmp_path):
    reference = merged_model("gpt2")
    save_compressed(reference, tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    dense = model.dequantize()
    assert not any(isinstance(mod, SparseLinear) for mod in dense.modules())
    assert (
        getattr(dense, "hf_quantizer", None) is None and "quantization_config" not in dense.config.to_dict()
    )
    ref_state, state = reference.state_dict(), dense.state_dict()
    assert ref_state.keys() == state.keys() and all(torch.equal(ref_state[k], state[k]) for k in ref_state)
    dense.save_pretrained(tmp_path / "d")  # the plain transformers save again
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())
