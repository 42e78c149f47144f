"""Several named masks on one base model: PEFT's multi-adapter conventions, what is kept per mask, the
three states of a mask, training one of them, and the checks made when a mask is added or loaded."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch
from mask_states import same, saved_mask, two_masks
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from trainer_helpers import random_tokens

from hf_maskllm import MaskConfig, MaskedLinear, MaskModel, get_mask_model
from hf_maskllm.errors import MaskFileError, MaskLLMError
from hf_maskllm.learn import learn_mask


def _eval_logits(mm: MaskModel, ids: torch.Tensor) -> torch.Tensor:
    mm.eval()
    with torch.no_grad():
        return mm(input_ids=ids).logits


def _active_logits(mm: MaskModel) -> list[torch.Tensor]:
    return [layer.mask_logits for layer in mm.masked_layers().values()]


# ---------------------------------------------------------------------------------------------- the API
def test_first_mask_is_named_default_and_add_mask_does_not_activate():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    assert mm.active_mask == "default" and mm.list_masks() == ["default"]
    before = mm.hard_masks()
    mm.add_mask("code", MaskConfig(prior="magnitude"))
    assert mm.list_masks() == ["default", "code"] and mm.active_mask == "default"
    assert same(mm.hard_masks(), before)
    assert set(mm.mask_configs) == {"default", "code"} and mm.mask_configs["code"].prior == "magnitude"
    named = get_mask_model(tiny_llama(), MaskConfig(), mask_name="general")
    assert named.list_masks() == ["general"] and named.active_mask == "general"


def test_set_mask_switches_the_forward_and_the_trainable_parameters():
    mm = two_masks()
    ids = random_tokens(2, 0)
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
    mm = two_masks()
    pointers = {name: p.data_ptr() for name, p in mm.base_model.named_parameters() if ".logits." not in name}
    for name in ("b", "default", "b"):
        mm.set_mask(name)
    after = {name: p.data_ptr() for name, p in mm.base_model.named_parameters() if ".logits." not in name}
    assert after == pointers
    weights = sum(p.numel() for n, p in mm.base_model.named_parameters() if ".logits." not in n)
    assert weights == sum(p.numel() for p in tiny_llama().parameters())  # one copy of the base weights


def test_delete_mask_refuses_the_active_one_and_unknown_names():
    mm = two_masks()
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
    mm = two_masks(sparse_reg=1e-3)
    mm.load_mask(saved_mask(tmp_path), mask_name="frozen")
    mm.set_mask("b")
    before = {name: mm.hard_indices(name) for name in ("default", "frozen")}
    default_logits = {k: v.get_logits("default").detach().clone() for k, v in mm.masked_layers().items()}
    b_before = {k: v.mask_logits.detach().clone() for k, v in mm.masked_layers().items()}
    ids = random_tokens(16, 3)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    trainer = learn_mask(
        mm, dataset, max_steps=3, learning_rate=5e-2, output_dir=str(tmp_path / "run"), compile_sampling=False
    )
    assert trainer.state.global_step == 3
    layers = mm.masked_layers()
    assert all(torch.equal(v, layers[k].get_logits("default")) for k, v in default_logits.items())
    assert same(before["default"], mm.hard_indices("default")) and same(
        before["frozen"], mm.hard_indices("frozen")
    )
    assert any(not torch.equal(b_before[k], v.mask_logits) for k, v in mm.masked_layers().items())
    assert mm.training_summary["optimizer_steps"] == 3
    assert "optimizer_steps" not in mm.mask_info("default").summary


def test_state_dict_holds_every_mask_and_a_checkpoint_resumes_the_active_one():
    mm = two_masks()
    keys = {f"base_model.{name}.logits.{mask}" for name in mm.masked_names for mask in ("default", "b")}
    assert set(mm.state_dict()) == keys
    mm.set_mask("b")
    state = mm.state_dict()
    assert set(state) == keys  # switching changes no key
    for name, layer in mm.masked_layers().items():
        assert torch.equal(state[f"base_model.{name}.logits.b"], layer.mask_logits)
        assert torch.equal(state[f"base_model.{name}.logits.default"], layer.get_logits("default"))
    # a checkpoint of "b" resumes into "b", and the inactive "default" comes back too
    fresh = two_masks()
    fresh.set_mask("b")
    with torch.no_grad():
        for layer in fresh.masked_layers().values():
            layer.mask_logits.zero_()
            layer.get_logits("default").zero_()
    fresh.load_state_dict(state, strict=False)  # as the Trainer resumes: the base weights are not in it
    assert same(fresh.hard_masks(), mm.hard_masks())
    assert same(fresh.hard_masks("default"), mm.hard_masks("default"))


def test_state_dict_with_the_unnamed_logits_key_loads_into_the_active_mask():
    """A checkpoint written when a layer held one unnamed mask (``<layer>.mask_logits``) still resumes."""
    mm = two_masks()
    mm.set_mask("b")
    old = {
        f"base_model.{name}.mask_logits": layer.mask_logits.detach().clone()
        for name, layer in mm.masked_layers().items()
    }
    fresh = two_masks()
    fresh.set_mask("b")
    default_before = fresh.hard_masks("default")
    with torch.no_grad():
        for layer in fresh.masked_layers().values():
            layer.mask_logits.zero_()
    result = fresh.load_state_dict(old, strict=False)
    assert not result.unexpected_keys
    assert same(fresh.hard_masks(), mm.hard_masks())
    assert same(fresh.hard_masks("default"), default_before)  # the inactive mask is untouched


# ---------------------------------------------------------------------------------------------- states


def test_loaded_frozen_mask_is_packed_when_inactive_and_decodes_exactly(tmp_path):
    folder = saved_mask(tmp_path)
    reference = MaskModel.from_pretrained(tiny_llama(), folder)
    mm = get_mask_model(tiny_llama(), MaskConfig())
    mm.load_mask(folder, mask_name="frozen")
    state = mm.mask_state("frozen")
    assert state.state == "packed" and state.bits_per_weight <= 0.7
    assert mm.mask_state("default").state == "active"
    mm.set_mask("frozen")
    assert same(mm.hard_masks(), reference.hard_masks())
    ids = random_tokens(2, 5)
    assert torch.equal(_eval_logits(mm, ids), _eval_logits(reference, ids))
    assert not any(p.requires_grad for p in mm.parameters())
    mm.set_mask("default")
    assert mm.mask_state("frozen").state == "packed"  # its decoded logits were dropped again
    assert mm.mask_state("default").state == "active"


def test_kept_and_trainable_masks_hold_logits_while_inactive(tmp_path):
    folder = saved_mask(tmp_path)
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
    folder = saved_mask(tmp_path)
    mm = MaskModel.from_pretrained(tiny_llama(), folder, mask_name="general")
    expected = mm.hard_masks()
    mm.add_mask("task", MaskConfig(prior=str(folder)))  # transfer: starts from the general mask
    assert same(mm.hard_masks("task"), expected)
    mm.set_mask("task")
    assert mm.mask_state("general").state == "packed"
    assert same(mm.hard_masks("general"), expected)
    assert all(p.requires_grad for p in _active_logits(mm))


# ---------------------------------------------------------------------------------------------- per mask
def test_mask_info_holds_what_is_kept_per_mask(tmp_path):
    mm = two_masks()
    mm.load_mask(saved_mask(tmp_path), mask_name="frozen")
    mm.load_mask(saved_mask(tmp_path), mask_name="kept", keep_logits=True)
    assert mm.mask_info() == mm.mask_info("default")  # the active mask by default
    assert mm.mask_info("b").config is mm.mask_configs["b"] and mm.mask_info("b").config.seed == 5
    flags = {name: (mm.mask_info(name).trainable, mm.mask_info(name).keep_logits) for name in mm.list_masks()}
    assert flags == {
        "default": (True, False),
        "b": (True, False),
        "frozen": (False, False),
        "kept": (False, True),
    }
    assert mm.mask_info("frozen").summary == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        mm.mask_info("b").trainable = False
    mm.training_summary = {"optimizer_steps": 5}  # the active mask's
    assert mm.mask_info().summary == {"optimizer_steps": 5} and mm.mask_info("b").summary == {}
    with pytest.raises(MaskLLMError, match="No mask named 'nope'"):
        mm.mask_info("nope")


def test_state_dict_holds_packed_masks_and_to_moves_every_mask(tmp_path):
    mm = two_masks()
    mm.load_mask(saved_mask(tmp_path), mask_name="frozen")
    state = mm.state_dict()
    name = mm.masked_names[0]
    assert {f"base_model.{name}.logits.b", f"base_model.{name}.packed_masks.frozen"} <= set(state)
    assert not any(f"base_model.{name}.logits.frozen" == key for key in state)  # held packed only
    fresh = two_masks()
    fresh.load_mask(saved_mask(tmp_path, seed=3), mask_name="frozen")  # other hard masks
    assert not same(fresh.hard_indices("frozen"), mm.hard_indices("frozen"))
    fresh.load_state_dict(state, strict=False)
    assert same(fresh.hard_indices("frozen"), mm.hard_indices("frozen"))
    mm.to("meta")
    for layer in mm.masked_layers().values():
        tensors = [layer.mask_logits, layer.get_logits("b"), layer.get_packed("frozen")]
        assert all(t.device.type == "meta" for t in tensors)


def test_every_layer_reads_the_schedule_of_the_active_mask():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    mm.add_mask("sharp", MaskConfig(tau=(1.0, 0.1), kappa=(50.0, 500.0), hard=True))
    assert (mm.schedule.tau, mm.schedule.kappa, mm.schedule.hard) == (2.0, 100.0, False)
    mm.set_mask("sharp")  # the schedule starts where the new mask's config starts
    assert (mm.schedule.tau, mm.schedule.kappa, mm.schedule.hard) == (1.0, 50.0, True)
    assert all(layer.schedule is mm.schedule for layer in mm.masked_layers().values())
    mm.set_schedule_values(0.5, 300.0)
    mm.set_mask("sharp")  # activating the active mask again keeps the values a training loop set
    assert (mm.schedule.tau, mm.schedule.kappa) == (0.5, 300.0)


@pytest.mark.slow
def test_switching_costs_milliseconds():
    """Timed, so slow-only: a switch flips ``requires_grad`` (and decodes a packed mask); see also
    ``benchmarks/downstream.py --switching-only``."""
    mm = two_masks()
    mm.set_mask("b")
    start = time.perf_counter()
    for _ in range(10):
        mm.set_mask("default")
        mm.set_mask("b")
    per_switch = (time.perf_counter() - start) / 20
    assert per_switch < 0.05, per_switch


# ---------------------------------------------------------------------------------------------- checks on load
def _default_and_code(tmp_path):
    """A folder holding a default mask at the top and a mask saved as "code" in ``code/``."""
    mm = two_masks()
    mm.add_mask("code", MaskConfig(seed=11, init_std=1.0))
    mm.save_pretrained(tmp_path / "both", selected_masks=["default", "code"])
    return mm, tmp_path / "both"


def test_a_mask_name_that_names_a_subfolder_needs_subfolder(tmp_path):
    mm, folder = _default_and_code(tmp_path)
    model = tiny_llama()
    with pytest.raises(MaskFileError, match=r"holds its default mask at the top.*Pass subfolder='code'"):
        MaskModel.from_pretrained(model, folder, mask_name="code")
    assert not any(isinstance(mod, MaskedLinear) for mod in model.modules())  # the model is left as it was
    other = get_mask_model(tiny_llama(), MaskConfig())
    with pytest.raises(MaskFileError, match=r"Pass subfolder='code'"):
        other.load_mask(folder, mask_name="code")
    assert other.list_masks() == ["default"]
    other.load_mask(folder, mask_name="code", subfolder="code")
    loaded = MaskModel.from_pretrained(model, folder, mask_name="code", subfolder="code")
    assert same(loaded.hard_indices(), mm.hard_indices("code"))
    assert same(other.hard_indices("code"), mm.hard_indices("code"))
    other.load_mask(folder, mask_name="general")  # another name: the default mask, no ambiguity
    assert same(other.hard_indices("general"), mm.hard_indices("default"))


def _named(model, name: str):
    model.config._name_or_path = name
    return model


def test_a_mask_learned_on_another_base_model_is_loaded_with_a_warning(tmp_path):
    source = get_mask_model(_named(tiny_llama(), "org/base-a"), MaskConfig())
    assert source.mask_config.base_model_name_or_path == "org/base-a"
    source.save_pretrained(tmp_path / "mask")
    with pytest.warns(
        UserWarning, match=r"learned on 'org/base-a' and is loaded onto 'org/base-b'"
    ) as caught:
        MaskModel.from_pretrained(_named(tiny_llama(), "org/base-b"), tmp_path / "mask")
    assert [w.filename for w in caught if "learned on" in str(w.message)] == [__file__]  # the caller's line
    other = get_mask_model(_named(tiny_llama(), "org/base-b"), MaskConfig())
    with pytest.warns(UserWarning, match="learned on 'org/base-a'") as caught:
        other.load_mask(tmp_path / "mask", mask_name="a")
    assert [w.filename for w in caught if "learned on" in str(w.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskModel.from_pretrained(_named(tiny_llama(), "org/base-a"), tmp_path / "mask")  # the same model
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "mask")  # a model that records no name


@pytest.mark.slow
def test_downstream_benchmark_switching_mode_on_smollm2(tmp_path):
    """`benchmarks/downstream.py --switching-only` on the real SmolLM2: its table and the 0.7-bit bound."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "downstream.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1]), "OMP_NUM_THREADS": "1"}
    args = ["--switching-only", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")]
    run = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"downstream.py exited {run.returncode}:\n{run.stderr[-4000:]}"
    results = json.loads((tmp_path / "downstream_switching.json").read_text())
    states = results["mask_states"]
    assert states["packed-copy"]["state"] == "packed" and states["packed-copy"]["bits_per_weight"] <= 0.7
    assert states["random"]["state"] == "logits"
    assert results["switching"]["packed_copy_identical"] is True
    assert "| packed-copy | packed |" in (tmp_path / "downstream_switching.md").read_text()
