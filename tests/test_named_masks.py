"""Several named masks on one base model: PEFT's multi-adapter conventions, states, saving, training."""

from __future__ import annotations

import time

import pytest
import torch
from models import single_thread, tiny_gpt2, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from safetensors.torch import load_file

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME
from hf_maskllm.errors import MaskFileError, MaskLLMError
from hf_maskllm.learn import learn_mask

SEQ = 16


def _tokens(num: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (num, SEQ), generator=torch.Generator().manual_seed(seed))


def _randomise(mm: MaskModel, seed: int) -> None:
    """Give the active mask logits far from a fresh init (as after training)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))


def _two_masks(**cfg) -> MaskModel:
    """A model with masks "default" and "b" (seeded differently, both far from init); "default" active."""
    mm = get_mask_model(tiny_llama(), MaskConfig(**{"logits_dtype": "float32", **cfg}))
    _randomise(mm, 1)
    mm.add_mask("b", MaskConfig(**{"logits_dtype": "float32", "seed": 5, **cfg}))
    mm.set_mask("b")
    _randomise(mm, 2)
    mm.set_mask("default")
    return mm


def _eval_logits(mm: MaskModel, ids: torch.Tensor) -> torch.Tensor:
    mm.eval()
    with torch.no_grad():
        return mm(input_ids=ids).logits


def _active_logits(mm: MaskModel) -> list[torch.Tensor]:
    return [layer.mask_logits for layer in mm.masked_layers().values()]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


# ---------------------------------------------------------------------------------------------- the API
def test_first_mask_is_named_default_and_add_mask_does_not_activate():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    assert mm.active_mask == "default" and mm.list_masks() == ["default"]
    before = mm.hard_masks()
    mm.add_mask("code", MaskConfig(prior="magnitude"))
    assert mm.list_masks() == ["default", "code"] and mm.active_mask == "default"
    assert _same(mm.hard_masks(), before)
    assert set(mm.mask_configs) == {"default", "code"} and mm.mask_configs["code"].prior == "magnitude"
    named = get_mask_model(tiny_llama(), MaskConfig(), mask_name="general")
    assert named.list_masks() == ["general"] and named.active_mask == "general"


def test_set_mask_switches_the_forward_and_the_trainable_parameters():
    mm = _two_masks()
    ids = _tokens(2, 0)
    out_default = _eval_logits(mm, ids)
    default_params = [layer.mask_logits for layer in mm.masked_layers().values()]
    mm.set_mask("b")
    out_b = _eval_logits(mm, ids)
    assert not torch.allclose(out_default, out_b)
    b_params = [layer.mask_logits for layer in mm.masked_layers().values()]
    assert all(p is not q for p, q in zip(default_params, b_params))
    trainable = [p for p in mm.parameters() if p.requires_grad]
    assert len(trainable) == len(b_params) and all(any(p is q for q in b_params) for p in trainable)
    assert not any(p.requires_grad for p in default_params)
    mm.set_mask("default")
    assert torch.equal(_eval_logits(mm, ids), out_default)  # the eval cache follows the switch


def test_switching_never_copies_base_weights():
    mm = _two_masks()
    pointers = {
        name: p.data_ptr() for name, p in mm.base_model.named_parameters() if "mask_logits" not in name
    }
    for name in ("b", "default", "b"):
        mm.set_mask(name)
    after = {name: p.data_ptr() for name, p in mm.base_model.named_parameters() if "mask_logits" not in name}
    assert after == pointers
    weights = sum(p.numel() for n, p in mm.base_model.named_parameters() if "mask_logits" not in n)
    assert weights == sum(p.numel() for p in tiny_llama().parameters())  # one copy of the base weights


def test_delete_mask_refuses_the_active_one_and_unknown_names():
    mm = _two_masks()
    with pytest.raises(MaskLLMError, match="'default' is the active mask.*set_mask"):
        mm.delete_mask("default")
    with pytest.raises(MaskLLMError, match="No mask named 'nope'"):
        mm.delete_mask("nope")
    with pytest.raises(MaskLLMError, match="No mask named 'nope'"):
        mm.set_mask("nope")
    mm.delete_mask("b")
    assert mm.list_masks() == ["default"]


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden", "mask_config.json", "x" * 97, 3])
def test_invalid_mask_names_are_refused(name):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    with pytest.raises(MaskLLMError, match="Invalid mask name"):
        mm.add_mask(name, MaskConfig())


def test_duplicate_names_are_refused():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    with pytest.raises(MaskLLMError, match="'default' exists already"):
        mm.add_mask("default", MaskConfig())


def test_masks_of_another_nm_or_other_layers_are_refused_naming_them(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    with pytest.raises(MaskLLMError, match=r"Mask 'wide'.*2:8.*2:4"):
        mm.add_mask("wide", MaskConfig(n=2, m=8))
    with pytest.raises(MaskLLMError, match=r"Mask 'attn'.*other layers"):
        mm.add_mask("attn", MaskConfig(target_modules=["q_proj", "v_proj"]))
    get_mask_model(tiny_llama(), MaskConfig(n=1, m=4)).save_pretrained(tmp_path / "one-of-four")
    with pytest.raises(MaskLLMError, match=r"Mask 'other'.*1:4.*2:4"):
        mm.load_mask(tmp_path / "one-of-four", mask_name="other")
    get_mask_model(tiny_llama(hidden=32, intermediate=64), MaskConfig()).save_pretrained(tmp_path / "small")
    with pytest.raises(MaskFileError, match=r"Mask 'small'.*shape"):
        mm.load_mask(tmp_path / "small", mask_name="small")
    assert mm.list_masks() == ["default"]


# ---------------------------------------------------------------------------------------------- training
def test_only_the_active_mask_trains_and_the_others_stay_bit_identical(tmp_path):
    mm = _two_masks(sparse_reg=1e-3)
    mm.load_mask(_saved(tmp_path), mask_name="frozen")
    mm.set_mask("b")
    before = {name: mm.hard_indices(name) for name in ("default", "frozen")}
    default_logits = {k: v.detach().clone() for k, v in mm._masks["default"].logits.items()}
    b_before = {k: v.mask_logits.detach().clone() for k, v in mm.masked_layers().items()}
    ids = _tokens(16, 3)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    trainer = learn_mask(
        mm, dataset, max_steps=3, learning_rate=5e-2, output_dir=str(tmp_path / "run"), compile_sampling=False
    )
    assert trainer.state.global_step == 3
    assert all(torch.equal(v, mm._masks["default"].logits[k]) for k, v in default_logits.items())
    assert _same(before["default"], mm.hard_indices("default")) and _same(
        before["frozen"], mm.hard_indices("frozen")
    )
    assert any(not torch.equal(b_before[k], v.mask_logits) for k, v in mm.masked_layers().items())
    assert (
        mm.training_summary["optimizer_steps"] == 3 and "optimizer_steps" not in mm._masks["default"].summary
    )


def test_state_dict_holds_the_active_mask_under_the_usual_keys():
    mm = _two_masks()
    keys = {f"base_model.{name}.mask_logits" for name in mm.masked_names}
    assert set(mm.state_dict()) == keys
    mm.set_mask("b")
    state = mm.state_dict()
    assert set(state) == keys
    for name, layer in mm.masked_layers().items():
        assert torch.equal(state[f"base_model.{name}.mask_logits"], layer.mask_logits)
    # a checkpoint of "b" resumes into "b"
    fresh = _two_masks()
    fresh.set_mask("b")
    with torch.no_grad():
        for layer in fresh.masked_layers().values():
            layer.mask_logits.zero_()
    fresh.load_state_dict(state, strict=False)  # as the Trainer resumes: the base weights are not in it
    assert _same(fresh.hard_masks(), mm.hard_masks())


def test_logged_loss_is_the_base_model_loss_and_the_gradient_has_the_regulariser():
    mm = get_mask_model(tiny_llama(), MaskConfig(logits_dtype="float32", sparse_reg=1e-2))
    mm.train()
    mm.sparse_reg_weight = 1e-2
    ids = _tokens(2, 4)
    logits = [layer.mask_logits for layer in mm.masked_layers().values()]
    torch.manual_seed(0)
    out = mm(input_ids=ids, labels=ids)
    torch.manual_seed(0)  # the same Gumbel noise: the base model runs with the same soft masks
    base = mm.base_model(input_ids=ids, labels=ids)
    assert torch.equal(out.loss.detach(), base.loss.detach())
    assert float(mm.last_sparse_reg_term) < 0
    grad_out = torch.autograd.grad(out.loss, logits)
    grad_base = torch.autograd.grad(base.loss, logits)
    assert any(not torch.allclose(a, b) for a, b in zip(grad_out, grad_base))


# ---------------------------------------------------------------------------------------------- states
def _saved(tmp_path, seed: int = 9):
    folder = tmp_path / f"saved-{seed}"
    mm = get_mask_model(tiny_llama(), MaskConfig(seed=seed))
    _randomise(mm, seed)
    mm.save_pretrained(folder)
    return folder


def test_loaded_frozen_mask_is_packed_when_inactive_and_decodes_exactly(tmp_path):
    folder = _saved(tmp_path)
    reference = MaskModel.from_pretrained(tiny_llama(), folder)
    mm = get_mask_model(tiny_llama(), MaskConfig())
    mm.load_mask(folder, mask_name="frozen")
    state = mm.mask_state("frozen")
    assert state.state == "packed" and state.bits_per_weight <= 0.7
    assert mm.mask_state("default").state == "active"
    mm.set_mask("frozen")
    assert _same(mm.hard_masks(), reference.hard_masks())
    ids = _tokens(2, 5)
    assert torch.equal(_eval_logits(mm, ids), _eval_logits(reference, ids))
    assert not any(p.requires_grad for p in mm.parameters())
    mm.set_mask("default")
    assert mm.mask_state("frozen").state == "packed"  # its decoded logits were dropped again
    assert mm.mask_state("default").state == "active"


def test_kept_and_trainable_masks_hold_logits_while_inactive(tmp_path):
    folder = _saved(tmp_path)
    mm = get_mask_model(tiny_llama(), MaskConfig(logits_dtype="bfloat16"))
    mm.load_mask(folder, mask_name="kept", keep_logits=True)
    mm.load_mask(folder, mask_name="trainable", is_trainable=True)
    for name in ("kept", "trainable"):
        state = mm.mask_state(name)
        assert state.state == "logits" and state.bits_per_weight == pytest.approx(8 * 2 * 6 / 4)  # bf16, 2:4
    mm.set_mask("trainable")
    assert all(p.requires_grad for p in _active_logits(mm)) and mm.mask_state("trainable").state == "active"
    mm.set_mask("kept")
    assert not any(p.requires_grad for p in mm.parameters())


def test_from_pretrained_frozen_mask_packs_when_another_is_activated(tmp_path):
    folder = _saved(tmp_path)
    mm = MaskModel.from_pretrained(tiny_llama(), folder, mask_name="general")
    expected = mm.hard_masks()
    mm.add_mask("task", MaskConfig(prior=str(folder)))  # transfer: starts from the general mask
    assert _same(mm.hard_masks("task"), expected)
    mm.set_mask("task")
    assert mm.mask_state("general").state == "packed"
    assert _same(mm.hard_masks("general"), expected)
    assert all(p.requires_grad for p in _active_logits(mm))


def test_switching_costs_milliseconds():
    mm = _two_masks()
    mm.set_mask("b")
    start = time.perf_counter()
    for _ in range(10):
        mm.set_mask("default")
        mm.set_mask("b")
    per_switch = (time.perf_counter() - start) / 20
    assert per_switch < 0.05, per_switch


# ---------------------------------------------------------------------------------------------- saving
def test_save_writes_default_on_top_and_others_in_subfolders(tmp_path):
    mm = _two_masks()
    mm.load_mask(_saved(tmp_path), mask_name="frozen")
    with pytest.warns(UserWarning, match="'frozen' is held as a packed hard mask"):
        mm.save_pretrained(tmp_path / "all", save_logits=True)
    assert {CONFIG_NAME, MASKS_NAME, LOGITS_NAME, "README.md"} <= {
        p.name for p in (tmp_path / "all").iterdir()
    }
    for name in ("b", "frozen"):
        assert (tmp_path / "all" / name / MASKS_NAME).is_file()
    assert (tmp_path / "all" / "b" / LOGITS_NAME).is_file()
    assert not (tmp_path / "all" / "frozen" / LOGITS_NAME).exists()  # a packed mask has no logits to save
    assert "mask name | b" in (tmp_path / "all" / "b" / "README.md").read_text()

    loaded = MaskModel.from_pretrained(tiny_llama(), tmp_path / "all")
    loaded.load_mask(tmp_path / "all" / "b", mask_name="b")
    loaded.load_mask(tmp_path / "all", mask_name="frozen", subfolder="frozen")
    for name in ("default", "b", "frozen"):
        assert _same(loaded.hard_indices(name), mm.hard_indices(name)), name

    mm.save_pretrained(tmp_path / "one", selected_masks=["b"])
    assert not (tmp_path / "one" / CONFIG_NAME).exists() and (tmp_path / "one" / "b" / CONFIG_NAME).is_file()
    with pytest.raises(MaskFileError, match=r"named masks in subfolders \['b'\]"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "one")
    with pytest.raises(MaskLLMError, match="unknown masks"):
        mm.save_pretrained(tmp_path / "x", selected_masks=["nope"])


def test_single_mask_folders_load_as_before(tmp_path):
    folder = _saved(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == sorted([CONFIG_NAME, MASKS_NAME, "README.md"])
    loaded = MaskModel.from_pretrained(tiny_llama(), folder)
    assert loaded.list_masks() == ["default"]
    other = get_mask_model(tiny_llama(), MaskConfig())
    other.load_mask(folder, mask_name="old")
    assert _same(other.hard_indices("old"), loaded.hard_indices())


def test_merge_and_merged_save_use_the_active_mask(tmp_path):
    mm = _two_masks()
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


def test_conv1d_models_take_several_masks(tmp_path):
    mm = get_mask_model(tiny_gpt2(), MaskConfig())
    mm.add_mask("magnitude", MaskConfig(prior="magnitude"))
    mm.set_mask("magnitude")
    mm.save_pretrained(tmp_path)
    loaded = MaskModel.from_pretrained(tiny_gpt2(), tmp_path)
    loaded.load_mask(tmp_path / "magnitude", mask_name="magnitude")
    assert _same(loaded.hard_indices("magnitude"), mm.hard_indices())


def test_push_to_hub_writes_every_mask_and_loads_a_subfolder(local_hub):
    mm = _two_masks()
    mm.push_to_hub("user/two-masks")
    files = set(local_hub.repo_files("user/two-masks"))
    assert {CONFIG_NAME, MASKS_NAME, f"b/{CONFIG_NAME}", f"b/{MASKS_NAME}"} <= files
    loaded = MaskModel.from_pretrained(tiny_llama(), "user/two-masks", subfolder="b", mask_name="b")
    loaded.load_mask("user/two-masks", mask_name="default")
    assert _same(loaded.hard_indices(), mm.hard_indices("b"))
    assert _same(loaded.hard_indices("default"), mm.hard_indices("default"))


@pytest.mark.slow
def test_downstream_benchmark_switching_mode_on_smollm2(tmp_path):
    """`benchmarks/downstream.py --switching-only` on the real SmolLM2: its table and the 0.7-bit bound."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "downstream.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1]), "OMP_NUM_THREADS": "1"}
    args = ["--switching-only", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")]
    subprocess.run([sys.executable, str(script), *args], check=True, env=env, capture_output=True)
    results = json.loads((tmp_path / "downstream_switching.json").read_text())
    states = results["mask_states"]
    assert states["packed-copy"]["state"] == "packed" and states["packed-copy"]["bits_per_weight"] <= 0.7
    assert states["random"]["state"] == "logits"
    assert results["switching"]["packed_copy_identical"] is True
    assert "| packed-copy | packed |" in (tmp_path / "downstream_switching.md").read_text()
