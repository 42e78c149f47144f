"""merge_and_unload and merged saves: the plain model with W * hard_mask of the active mask, equal outputs,
vanilla reload."""

from __future__ import annotations

import pytest
import torch
from mask_states import two_masks
from models import (
    model_inputs,
    output_tensor,
    single_thread,  # noqa: F401  (autouse fixture)
    tiny_bert_mlm,
    tiny_gpt2,
    tiny_llama,
    tiny_llama_tied,
    tiny_opt,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, MaskedLinear, check_nm, get_mask_model
from hf_maskllm.errors import MaskLLMError
from hf_maskllm.modules import dense_weight_view, is_conv1d

CASES = [
    ("llama-2:4", tiny_llama, {"n": 2, "m": 4}),
    ("llama_tied-1:4", tiny_llama_tied, {"n": 1, "m": 4}),
    ("llama-3:8-list", tiny_llama, {"n": 3, "m": 8, "target_modules": ["q_proj", "o_proj", "down_proj"]}),
    ("gpt2-conv1d-2:4", tiny_gpt2, {"n": 2, "m": 4}),
    ("opt-2:4", tiny_opt, {"n": 2, "m": 4}),
    ("bert_mlm-2:4", tiny_bert_mlm, {"n": 2, "m": 4}),
]


def _masked(factory, kwargs):
    base = factory()
    mm = get_mask_model(base, MaskConfig(**kwargs))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # masks away from the init, as after training
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    return mm.eval(), base


@pytest.mark.parametrize(("case_id", "factory", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_merge_and_unload(case_id, factory, kwargs):
    mm, base = _masked(factory, kwargs)
    n, m = kwargs["n"], kwargs["m"]
    inputs = model_inputs(mm)
    dense_weights = {
        name: dense_weight_view(layer.base_layer).detach().clone()
        for name, layer in mm.masked_layers().items()
    }
    masks = mm.hard_masks()
    with torch.no_grad():
        masked_out = output_tensor(mm(**inputs))
        with mm.disable_masks():
            dense_out = output_tensor(mm(**inputs))
    assert not torch.allclose(masked_out, dense_out, atol=1e-3)

    merged = mm.merge_and_unload()
    assert merged is base and type(merged) is type(factory())
    assert not any(isinstance(mod, MaskedLinear) for mod in merged.modules())
    for name, weight in dense_weights.items():
        module = merged.get_submodule(name)
        assert type(module).__name__ == ("Conv1D" if case_id.startswith("gpt2") else "Linear")
        assert torch.equal(dense_weight_view(module), weight * masks[name])
    with torch.no_grad():
        merged_out = output_tensor(merged(**inputs))
    if case_id.startswith("gpt2"):  # Conv1D runs addmm on [in, out], the masked layer F.linear: fp32 rounding
        torch.testing.assert_close(merged_out, masked_out, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(merged_out, masked_out, rtol=0, atol=0)

    report = check_nm(merged, n, m, target_modules=kwargs.get("target_modules", "all-linear"))
    assert report.ok and set(report.layers) == set(dense_weights)
    assert all(bad == 0 and groups > 0 for groups, bad in report.layers.values())


def test_merged_model_reloads_in_vanilla_transformers(tmp_path):
    mm, _ = _masked(tiny_llama_tied, {"n": 2, "m": 4})
    inputs = model_inputs(mm)
    with torch.no_grad():
        expected = mm(**inputs).logits
    merged = mm.merge_and_unload()
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(merged)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=0, atol=0)
    check_nm(reloaded, 2, 4)  # raises on any violation


def test_merge_twice_and_use_after_merge_raise():
    mm, _ = _masked(tiny_llama, {"n": 2, "m": 4})
    mm.merge_and_unload()
    with pytest.raises(MaskLLMError, match="already called"):
        mm.merge_and_unload()
    with pytest.raises(MaskLLMError, match="already called"):
        mm.hard_masks()


def test_merge_conv1d_keeps_its_layout():
    mm, base = _masked(tiny_gpt2, {"n": 2, "m": 4})
    name = mm.masked_names[0]
    layer = mm.masked_layers()[name]
    assert is_conv1d(layer.base_layer)
    stored = layer.base_layer.weight.detach().clone()  # [in, out]
    mask = layer.hard_mask()  # [out, in]
    merged = mm.merge_and_unload()
    weight = merged.get_submodule(name).weight
    assert weight.shape == stored.shape
    assert torch.equal(weight, stored * mask.t())


def test_merge_keep_mask_stays_nm_through_training():
    from hf_maskllm import SparseLinear

    mm = get_mask_model(tiny_llama(), MaskConfig(prior="magnitude"))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mm.eval()
    with torch.no_grad():
        expected = mm(input_ids=ids).logits
    sparse = mm.merge_and_unload(keep_mask=True)
    assert sum(isinstance(mod, SparseLinear) for mod in sparse.modules()) == len(mm.masked_names)
    with torch.no_grad():
        torch.testing.assert_close(sparse(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    params = [p for p in sparse.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    sparse.train()
    for _ in range(2):  # weight updates move the kept weights only: the model stays exactly 2:4
        opt.zero_grad()
        sparse(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        assert check_nm(sparse, 2, 4).ok


def test_merge_and_merged_save_use_the_active_mask(tmp_path):
    mm = two_masks()
    mm.set_mask("b")
    mask_b = mm.hard_masks()
    weights = {name: layer.base_layer.weight.detach().clone() for name, layer in mm.masked_layers().items()}
    mm.save_pretrained(tmp_path / "dense", merged=True, dense=True)
    saved = load_file(str(tmp_path / "dense" / "model.safetensors"))
    for name in mm.masked_names:
        assert torch.equal(saved[f"{name}.weight"], weights[name] * mask_b[name])
    merged = mm.merge_and_unload()
    for name in weights:
        assert torch.equal(merged.get_submodule(name).weight, weights[name] * mask_b[name])
