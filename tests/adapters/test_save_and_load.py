"""Saving the masks of a MaskModel to folders and reading them back: the default mask on top and every
other one in its subfolder, selected masks, the Hub, names with a '.', and a save from a gathered state dict."""

from __future__ import annotations

import pytest
import torch
from mask_states import assert_same_masks, randomise, same, saved_mask, trained_like, two_masks
from models import single_thread, tiny_gpt2, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME
from hf_maskllm.errors import ConfigError, MaskFileError, MaskLLMError


# ---------------------------------------------------------------------------------------------- layout
def test_save_writes_default_on_top_and_others_in_subfolders(tmp_path):
    mm = two_masks()
    mm.load_mask(saved_mask(tmp_path), mask_name="frozen")
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
        assert same(loaded.hard_indices(name), mm.hard_indices(name)), name

    mm.save_pretrained(tmp_path / "one", selected_masks=["b"])
    assert not (tmp_path / "one" / CONFIG_NAME).exists() and (tmp_path / "one" / "b" / CONFIG_NAME).is_file()
    with pytest.raises(MaskFileError, match=r"named masks in subfolders \['b'\]"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "one")
    with pytest.raises(MaskLLMError, match="unknown masks"):
        mm.save_pretrained(tmp_path / "x", selected_masks=["nope"])


def test_single_mask_folders_load_as_before(tmp_path):
    folder = saved_mask(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == sorted([CONFIG_NAME, MASKS_NAME, "README.md"])
    loaded = MaskModel.from_pretrained(tiny_llama(), folder)
    assert loaded.list_masks() == ["default"]
    other = get_mask_model(tiny_llama(), MaskConfig())
    other.load_mask(folder, mask_name="old")
    assert same(other.hard_indices("old"), loaded.hard_indices())


def test_conv1d_models_take_several_masks(tmp_path):
    mm = get_mask_model(tiny_gpt2(), MaskConfig())
    mm.add_mask("magnitude", MaskConfig(prior="magnitude"))
    mm.set_mask("magnitude")
    mm.save_pretrained(tmp_path)
    loaded = MaskModel.from_pretrained(tiny_gpt2(), tmp_path)
    loaded.load_mask(tmp_path / "magnitude", mask_name="magnitude")
    assert same(loaded.hard_indices("magnitude"), mm.hard_indices())


def test_push_to_hub_writes_every_mask_and_loads_a_subfolder(local_hub):
    mm = two_masks()
    mm.push_to_hub("user/two-masks")
    files = set(local_hub.repo_files("user/two-masks"))
    assert {CONFIG_NAME, MASKS_NAME, f"b/{CONFIG_NAME}", f"b/{MASKS_NAME}"} <= files
    loaded = MaskModel.from_pretrained(tiny_llama(), "user/two-masks", subfolder="b", mask_name="b")
    loaded.load_mask("user/two-masks", mask_name="default")
    assert same(loaded.hard_indices(), mm.hard_indices("b"))
    assert same(loaded.hard_indices("default"), mm.hard_indices("default"))


# ---------------------------------------------------------------------------------------------- names with a '.'
def test_a_mask_name_with_a_dot_round_trips_through_state_dict_and_save(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig(logits_dtype="float32"))
    mm.add_mask("v1.2", MaskConfig(logits_dtype="float32", seed=4))
    mm.set_mask("v1.2")
    randomise(mm, 6)
    name = mm.masked_names[0]
    state = mm.state_dict()
    assert f"base_model.{name}.logits.v1:2" in state and f"base_model.{name}.logits.default" in state
    fresh = get_mask_model(tiny_llama(), MaskConfig(logits_dtype="float32"))
    fresh.add_mask("v1.2", MaskConfig(logits_dtype="float32", seed=4))
    fresh.set_mask("v1.2")
    assert not same(fresh.hard_indices(), mm.hard_indices())
    fresh.load_state_dict(state, strict=False)
    assert same(fresh.hard_indices("v1.2"), mm.hard_indices("v1.2"))

    mm.save_pretrained(tmp_path, save_logits=True)
    assert (tmp_path / "v1.2" / MASKS_NAME).is_file()  # the subfolder keeps the name as given
    loaded = MaskModel.from_pretrained(tiny_llama(), tmp_path, mask_name="v1.2", subfolder="v1.2")
    assert loaded.active_mask == "v1.2" and same(loaded.hard_indices(), mm.hard_indices("v1.2"))
    for layer_name, layer in loaded.masked_layers().items():
        assert torch.equal(layer.mask_logits, mm.masked_layers()[layer_name].mask_logits)
    loaded.load_mask(tmp_path, mask_name="first")
    assert same(loaded.hard_indices("first"), mm.hard_indices("default"))
    assert loaded.mask_state("first").state == "packed"


# ---------------------------------------------------------------------------------------------- from a state dict
def test_save_pretrained_from_a_gathered_state_dict(tmp_path):
    """What the main process does under FSDP: save the logits of a (gathered) state dict, not the layers' own."""
    mm = get_mask_model(tiny_llama(seed=0), MaskConfig(prior="magnitude"))
    state_dict = {k: v.clone() for k, v in mm.state_dict().items()}
    name = mm.masked_names[0]
    key = f"base_model.{name}.logits.default"
    state_dict[key] = -state_dict[key]  # other logits than the layer's: the saved mask must follow them
    mm.save_pretrained(tmp_path / "mask", state_dict=state_dict, save_logits=True)
    loaded = MaskModel.from_pretrained(tiny_llama(seed=0), tmp_path / "mask")
    for layer_name, layer in loaded.masked_layers().items():
        assert torch.equal(layer.mask_logits, state_dict[f"base_model.{layer_name}.logits.default"])
    assert not torch.equal(loaded.hard_masks()[name], mm.hard_masks()[name])

    with pytest.raises(ConfigError, match="lacks"):
        mm.save_pretrained(tmp_path / "missing", state_dict={k: v for k, v in state_dict.items() if k != key})
    with pytest.raises(ConfigError, match="one shard"):
        mm.save_pretrained(tmp_path / "shard", state_dict={**state_dict, key: state_dict[key][:8]})
    with pytest.raises(ConfigError, match="mask saves only"):
        mm.save_pretrained(tmp_path / "merged", merged=True, state_dict=state_dict)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask"]


# ---------------------------------------------------------------------------------------------- exact restore
@pytest.mark.parametrize("save_logits", [False, True], ids=["masks-only", "with-logits"])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (3, 4), (4, 8), (3, 8), (2, 8)])
def test_from_pretrained_restores_exact_hard_masks(tmp_path, n, m, save_logits):
    mm = trained_like(n=n, m=m)
    saved = mm.hard_masks()
    mm.save_pretrained(tmp_path, save_logits=save_logits)
    fresh = tiny_llama(seed=9)  # other weights: masks do not depend on them
    untrained = get_mask_model(tiny_llama(), MaskConfig(n=n, m=m)).hard_masks()
    assert not any(torch.equal(saved[k], untrained[k]) for k in saved)  # the restore cannot pass by chance
    loaded = MaskModel.from_pretrained(fresh, tmp_path)
    assert (loaded.mask_config.n, loaded.mask_config.m) == (n, m)
    assert not loaded.training  # inference by default
    assert not any(p.requires_grad for p in loaded.parameters())
    assert_same_masks(loaded.hard_masks(), saved)
    if save_logits:
        for name, layer in loaded.masked_layers().items():
            assert torch.equal(layer.mask_logits, mm.masked_layers()[name].mask_logits.detach())


@pytest.mark.parametrize("save_logits", [False, True], ids=["masks-only", "with-logits"])
def test_restore_with_bfloat16_logits(tmp_path, save_logits):
    mm = trained_like(n=2, m=4, logits_dtype="bfloat16")
    mm.save_pretrained(tmp_path, save_logits=save_logits)
    loaded = MaskModel.from_pretrained(tiny_llama(), tmp_path)
    assert all(layer.mask_logits.dtype == torch.bfloat16 for layer in loaded.masked_layers().values())
    assert_same_masks(loaded.hard_masks(), mm.hard_masks())


def test_from_pretrained_trainable_and_conv1d(tmp_path):
    mm = trained_like(tiny_gpt2, n=2, m=4)
    mm.save_pretrained(tmp_path)
    loaded = MaskModel.from_pretrained(tiny_gpt2(seed=4), tmp_path, is_trainable=True)
    assert all(layer.mask_logits.requires_grad for layer in loaded.masked_layers().values())
    assert_same_masks(loaded.hard_masks(), mm.hard_masks())


def test_loaded_mask_gives_identical_eval_outputs(tmp_path):
    mm = trained_like()
    mm.eval()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = mm(input_ids=ids).logits
    mm.save_pretrained(tmp_path)
    loaded = MaskModel.from_pretrained(tiny_llama(), tmp_path)  # same base weights (seed 0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- loading into another model
def test_loading_into_a_model_without_the_targets_raises(tmp_path):
    trained_like(target_modules=["q_proj"]).save_pretrained(tmp_path)
    with pytest.raises(MaskLLMError):
        MaskModel.from_pretrained(tiny_gpt2(), tmp_path)


def test_logits_that_disagree_with_the_masks_raise(tmp_path):
    trained_like(seed=1).save_pretrained(tmp_path / "a", save_logits=True)
    trained_like(seed=2).save_pretrained(tmp_path / "b", save_logits=True)
    (tmp_path / "a" / LOGITS_NAME).write_bytes((tmp_path / "b" / LOGITS_NAME).read_bytes())
    with pytest.raises(MaskFileError, match="disagree"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "a")
