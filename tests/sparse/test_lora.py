"""PEFT LoRA on a loaded compressed N:M model: trains, merges to exact N:M, saves compressed; MaskLLM skips adapters."""

from __future__ import annotations

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)
from peft import LoraConfig, get_peft_model
from sparse_helpers import merged_model
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, check_nm, get_mask_model
from hf_maskllm.errors import ConfigError, TargetError
from hf_maskllm.sparse import (
    QuantizedSparseLinear,
    SparseLinear,
    SparseLoraLinear,
    register_lora,
    save_compressed,
)

TARGETS = {
    "llama": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_fc"],
    "opt": ["q_proj", "fc1"],
}


def loaded_compressed(kind: str, folder) -> torch.nn.Module:
    save_compressed(merged_model(kind), folder)
    return AutoModelForCausalLM.from_pretrained(folder)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def sparse_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: mod.values.detach().clone() for n, mod in model.named_modules() if isinstance(mod, SparseLinear)
    }


@pytest.mark.parametrize("kind", list(TARGETS))
def test_lora_trains_merges_to_exact_nm_and_saves_compressed(kind, tmp_path):
    model = loaded_compressed(kind, tmp_path / "c")
    metas = {n: mod.meta.clone() for n, mod in model.named_modules() if isinstance(mod, SparseLinear)}
    base_values = sparse_state(model)
    ids = batch()
    with torch.no_grad():
        base_logits = model(ids).logits
    # register_lora maps SparseLinear to its LoRA layer in the config (PEFT's custom-module dispatch)
    peft_model = get_peft_model(
        model, register_lora(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], lora_dropout=0.1))
    )
    wrapped = [mod for mod in peft_model.modules() if isinstance(mod, SparseLoraLinear)]
    assert len(wrapped) >= len(TARGETS[kind])
    peft_model.train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for step in range(3):
        loss = peft_model(batch(step), labels=batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] != losses[0]
    # the compressed base stays frozen while the adapters train (same layers, in model order)
    assert all(
        torch.equal(a, b)
        for a, b in zip(sparse_state(peft_model).values(), base_values.values(), strict=True)
    )
    peft_model.eval()
    with torch.no_grad():
        peft_logits = peft_model(ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters changed the function
    merged = peft_model.merge_and_unload()
    assert not any(isinstance(mod, SparseLoraLinear) for mod in merged.modules())
    with torch.no_grad():
        merged_logits = merged(ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-4)  # fp32 summation order only
    report = check_nm(merged, 2, 4)
    assert report.ok and not report.violations
    after = sparse_state(merged)
    assert after.keys() == base_values.keys()
    assert sum(not torch.equal(after[n], base_values[n]) for n in after) >= len(TARGETS[kind])
    assert all(
        torch.equal(mod.meta, metas[n]) for n, mod in merged.named_modules() if isinstance(mod, SparseLinear)
    )
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, merged_logits, rtol=0, atol=0)


def test_lora_delta_is_restricted_to_the_kept_positions(tmp_path):
    model = loaded_compressed("llama", tmp_path / "c")
    peft_model = get_peft_model(
        model, register_lora(LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    )
    layer = next(mod for mod in peft_model.modules() if isinstance(mod, SparseLoraLinear))
    delta = layer.get_delta_weight("default")
    keep = layer.get_base_layer().keep_mask()
    assert bool((delta[~keep] == 0).all()) and bool((delta[keep] != 0).any())
    before = layer.get_base_layer().values.clone()
    layer.merge()
    layer.unmerge()
    torch.testing.assert_close(layer.get_base_layer().values, before)


def test_lora_variants_that_would_densify_are_refused(tmp_path):
    model = loaded_compressed("llama", tmp_path / "c")
    with pytest.raises(ConfigError, match="DoraLinearVariant"):
        get_peft_model(model, register_lora(LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)))
    # a second adapter goes through update_layer on the existing LoRA layer: refused there too
    peft_model = get_peft_model(
        loaded_compressed("llama", tmp_path / "d"), register_lora(LoraConfig(r=2, target_modules=["q_proj"]))
    )
    with pytest.raises(ConfigError, match="DoraLinearVariant"):
        peft_model.add_adapter("dora", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))


def test_get_mask_model_skips_or_refuses_lora_layers():
    peft_model = get_peft_model(merged_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.warns(UserWarning, match="PEFT adapters"):
        mm = get_mask_model(peft_model, MaskConfig(n=2, m=4, target_modules="all-linear"))
    assert mm.masked_names and not any("lora_" in name for name in mm.masked_names)
    assert any(name.endswith("q_proj.base_layer") for name in mm.masked_names)
    with pytest.raises(TargetError, match="PEFT adapter layers"):
        get_mask_model(
            get_peft_model(merged_model("llama"), LoraConfig(r=2, target_modules=["q_proj"])),
            MaskConfig(n=2, m=4, target_modules=["lora_A.default", "k_proj"]),
        )


def test_saved_adapter_reloads_onto_a_compressed_model(tmp_path):
    from peft import PeftModel

    peft_model = get_peft_model(
        loaded_compressed("llama", tmp_path / "c"),
        register_lora(LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False)),
    )
    ids = batch()
    with torch.no_grad():
        expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    config = register_lora(LoraConfig.from_pretrained(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "c"), tmp_path / "adapter", config=config
    )
    assert any(isinstance(mod, SparseLoraLinear) for mod in reloaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=0)


def test_register_lora_maps_the_sparse_layer_in_that_config_only(tmp_path):
    # importing hf_maskllm changes no PEFT class: a plain LoraConfig knows nothing of compressed layers
    plain = LoraConfig(r=2, target_modules=["q_proj"])
    assert plain._custom_modules is None
    with pytest.raises(ValueError, match=r"SparseLinear.*is not supported"):
        get_peft_model(loaded_compressed("llama", tmp_path / "c"), plain)
    config = register_lora(register_lora(LoraConfig(r=2, target_modules=["q_proj"])))  # idempotent
    assert config._custom_modules == {SparseLinear: SparseLoraLinear, QuantizedSparseLinear: SparseLoraLinear}
    assert "_custom_modules" not in config.to_dict()  # nothing of it is saved with an adapter
