"""The MaskLLM reference implementation's ``mask_compressed.npz``: read wherever a mask source is taken
(``from_pretrained``, ``MaskConfig(prior=...)``, a list of priors, a Hub repo id), written by
``save_pretrained(format="npz")``, and every malformed file refused with the key or layer at fault."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from models import single_thread, tiny_gpt2, tiny_llama  # noqa: F401  (autouse fixture)
from torch import nn

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.adapters.mask_source import open_mask_source
from hf_maskllm.adapters.reference_file import REFERENCE_NAME
from hf_maskllm.errors import ConfigError, MaskFileError
from hf_maskllm.modules import dense_weight_view, is_conv1d, is_linear
from hf_maskllm.patterns import candidate_patterns

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _random_nm(out_f: int, in_f: int, n: int, m: int, generator: torch.Generator) -> torch.Tensor:
    cand = candidate_patterns(n, m, dtype=torch.bool)
    idx = torch.randint(0, cand.shape[0], (out_f * in_f // m,), generator=generator)
    return cand[idx].reshape(out_f, in_f)


def reference_masks(model: nn.Module, n: int = 2, m: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """``{'<param name>.mask': mask in the parameter's shape}`` for every decoder linear, as the reference's
    mask checkpoint holds them (the state-dict name of the weight plus ``.mask``)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if is_linear(module) and name.endswith(DECODER_LINEARS + ("c_attn", "c_proj", "c_fc")):
            out_f, in_f = dense_weight_view(module).shape
            mask = _random_nm(out_f, in_f, n, m, generator)
            out[f"{name}.weight.mask"] = mask.t() if is_conv1d(module) else mask
    return out


def write_like_the_reference(path, masks: dict[str, torch.Tensor]) -> None:
    """What NVlabs/MaskLLM's tool_compress_mask.py does with a loaded mask checkpoint."""
    compressed = {k: np.packbits(mask.cpu().numpy().astype(bool)) for k, mask in masks.items()}
    np.savez_compressed(path, **compressed)


def apply_like_the_reference(model: nn.Module, path) -> None:
    """What NVlabs/MaskLLM's eval_llama_ppl.py does with a mask_compressed.npz."""
    state = model.state_dict()
    for k, v in np.load(path).items():
        original = k.replace(".mask", "")
        mask = torch.from_numpy(np.unpackbits(v)).float().view(*state[original].shape)
        state[original] *= mask
    model.load_state_dict(state)


def layer_masks(masks: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's masks keyed and shaped as ``hard_masks()`` returns them (layer name, ``[out, in]``)."""
    out = {}
    for key, mask in masks.items():
        name = key[: -len(".weight.mask")]
        out[name] = mask.t() if is_conv1d(model.get_submodule(name)) else mask
    return out


def assert_masks_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, mask in expected.items():
        assert torch.equal(got[name].cpu().bool(), mask.bool()), name


# ---------------------------------------------------------------------------------------------- reading
@pytest.mark.parametrize("form", ["file", "folder"])
def test_from_pretrained_restores_the_reference_masks_exactly(tmp_path, form):
    model = tiny_llama()
    masks = reference_masks(model)
    write_like_the_reference(tmp_path / REFERENCE_NAME, masks)
    source = tmp_path / REFERENCE_NAME if form == "file" else tmp_path
    mm = MaskModel.from_pretrained(tiny_llama(), source)
    assert_masks_equal(mm.hard_masks(), layer_masks(masks, model))
    assert mm.training_summary["source"] == f"MaskLLM reference {REFERENCE_NAME}"
    # the same product as the reference's own evaluation applies
    dense = tiny_llama()
    apply_like_the_reference(dense, tmp_path / REFERENCE_NAME)
    merged = mm.merge_and_unload()
    for name, module in dense.named_modules():
        if name in mm.masked_names:
            assert torch.equal(merged.get_submodule(name).weight, module.weight), name


def test_gpt2_conv1d_masks_are_read_in_the_parameters_layout(tmp_path):
    model = tiny_gpt2()
    masks = reference_masks(model)
    write_like_the_reference(tmp_path / REFERENCE_NAME, masks)
    config = MaskConfig(target_modules=["c_attn", "c_proj", "c_fc"])
    mm = MaskModel.from_pretrained(tiny_gpt2(), tmp_path, config=config)
    assert_masks_equal(mm.hard_masks(), layer_masks(masks, model))


def test_reference_file_as_a_prior_and_in_a_list_of_priors(tmp_path):
    model = tiny_llama()
    masks = layer_masks(reference_masks(model, seed=3), model)
    write_like_the_reference(tmp_path / REFERENCE_NAME, reference_masks(model, seed=3))
    prior = get_mask_model(tiny_llama(), MaskConfig(prior=str(tmp_path / REFERENCE_NAME), seed=11))
    assert_masks_equal(prior.hard_masks(), masks)  # the prior rule starts every group at the file's pattern
    fresh = get_mask_model(tiny_llama(), MaskConfig(seed=11, logits_dtype="float32"))
    assert not torch.equal(next(iter(fresh.hard_masks().values())), next(iter(masks.values())))
    # transfer: the file's masks and a one-shot mask add their terms
    combined = get_mask_model(
        tiny_llama(), MaskConfig(prior=[str(tmp_path), "magnitude"], seed=11, logits_dtype="float32")
    )
    cand = candidate_patterns(2, 4)
    for name, layer in combined.masked_layers().items():
        init = fresh.masked_layers()[name].mask_logits.detach().float()
        overlap = masks[name].reshape(-1, 4).float() @ cand.t()
        delta = layer.mask_logits.detach() - init  # both terms, 3 sigma each
        assert float((delta * (overlap - 1)).sum()) > 0, name  # the file's term is in it


def test_a_hub_repo_holding_the_reference_file(tmp_path, local_hub):
    from huggingface_hub import HfApi

    model = tiny_llama()
    masks = reference_masks(model, seed=5)
    (tmp_path / "repo").mkdir()
    write_like_the_reference(tmp_path / "repo" / REFERENCE_NAME, masks)
    api = HfApi()
    api.create_repo("user/llama-2of4-reference")
    api.upload_folder(repo_id="user/llama-2of4-reference", folder_path=tmp_path / "repo")
    mm = MaskModel.from_pretrained(tiny_llama(), "user/llama-2of4-reference")
    assert_masks_equal(mm.hard_masks(), layer_masks(masks, model))
    prior = get_mask_model(tiny_llama(), MaskConfig(prior="user/llama-2of4-reference", seed=2))
    assert_masks_equal(prior.hard_masks(), layer_masks(masks, model))
    # an hf_maskllm repo is still read as one
    mm.push_to_hub("user/ours")
    assert open_mask_source("user/ours").format == "hf_maskllm"


def test_load_mask_adds_a_reference_mask_beside_others(tmp_path):
    model = tiny_llama()
    masks = reference_masks(model, seed=9)
    write_like_the_reference(tmp_path / REFERENCE_NAME, masks)
    mm = get_mask_model(tiny_llama(), MaskConfig(prior="magnitude"))
    mm.load_mask(tmp_path / REFERENCE_NAME, mask_name="reference")
    assert_masks_equal(mm.hard_masks("reference"), layer_masks(masks, model))


# ---------------------------------------------------------------------------------------------- writing
@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2])
def test_save_npz_round_trips_and_matches_what_the_reference_writes(tmp_path, factory):
    config = MaskConfig(seed=4, init_std=1.0)
    if factory is tiny_gpt2:
        config = MaskConfig(seed=4, init_std=1.0, target_modules=["c_attn", "c_proj", "c_fc"])
    mm = get_mask_model(factory(), config)
    mm.save_pretrained(tmp_path / "out", format="npz")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [REFERENCE_NAME]
    hard = mm.hard_masks()
    base = factory()
    expected = {}
    for name, mask in hard.items():
        module = base.get_submodule(name)
        expected[f"{name}.weight.mask"] = mask.t() if is_conv1d(module) else mask
    stored = np.load(tmp_path / "out" / REFERENCE_NAME, allow_pickle=False)
    assert sorted(stored.files) == sorted(expected)
    for key, mask in expected.items():  # the same bytes np.packbits gives, key for key
        np.testing.assert_array_equal(stored[key], np.packbits(mask.numpy().astype(bool)))
    loaded = MaskModel.from_pretrained(factory(), tmp_path / "out", config=config)
    assert_masks_equal(loaded.hard_masks(), hard)


def test_save_npz_replaces_an_earlier_save_in_the_other_format(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig(seed=1))
    mm.save_pretrained(tmp_path / "m", save_logits=True)
    mm.save_pretrained(tmp_path / "m", format="npz")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [REFERENCE_NAME]
    mm.save_pretrained(tmp_path / "m")
    assert REFERENCE_NAME not in {p.name for p in (tmp_path / "m").iterdir()}
    assert open_mask_source(tmp_path / "m").format == "hf_maskllm"


def test_save_npz_refuses_logits_a_merged_save_and_an_unknown_format(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    with pytest.raises(ConfigError, match="hard masks only"):
        mm.save_pretrained(tmp_path / "a", format="npz", save_logits=True)
    with pytest.raises(ConfigError, match="format"):
        mm.save_pretrained(tmp_path / "b", format="npz", merged=True)
    with pytest.raises(ConfigError, match="not one of"):
        mm.save_pretrained(tmp_path / "c", format="pt")


# ---------------------------------------------------------------------------------------------- refusals
def _write(tmp_path, masks) -> str:
    write_like_the_reference(tmp_path / REFERENCE_NAME, masks)
    return str(tmp_path / REFERENCE_NAME)


def test_a_key_naming_no_layer_is_refused(tmp_path):
    masks = reference_masks(tiny_llama())
    masks["model.layers.0.self_attn.qq_proj.weight.mask"] = masks.pop(
        "model.layers.0.self_attn.q_proj.weight.mask"
    )
    path = _write(tmp_path, masks)
    with pytest.raises(MaskFileError, match=r"qq_proj.weight.mask'.*names no layer.*Did you mean"):
        MaskModel.from_pretrained(tiny_llama(), path)
    with pytest.raises(MaskFileError, match="names no layer"):
        get_mask_model(tiny_llama(), MaskConfig(prior=path))


def test_a_key_that_is_not_a_weight_mask_is_refused(tmp_path):
    masks = reference_masks(tiny_llama())
    masks["model.layers.0.self_attn.q_proj.bias"] = masks["model.layers.0.self_attn.q_proj.weight.mask"]
    with pytest.raises(MaskFileError, match=r"q_proj.bias' is not a mask of a weight"):
        MaskModel.from_pretrained(tiny_llama(), _write(tmp_path, masks))


def test_uncovered_layers_are_refused_unless_left_dense(tmp_path):
    model = tiny_llama()
    masks = {k: v for k, v in reference_masks(model).items() if "down_proj" not in k}
    path = _write(tmp_path, masks)
    with pytest.raises(MaskFileError, match=r"no mask for \d+ masked layer.*down_proj.*exclude_modules"):
        MaskModel.from_pretrained(tiny_llama(), path)
    with pytest.raises(MaskFileError, match="no mask for"):
        get_mask_model(tiny_llama(), MaskConfig(prior=path))
    config = MaskConfig(exclude_modules=["down_proj"])
    mm = MaskModel.from_pretrained(tiny_llama(), path, config=config)
    assert not any("down_proj" in name for name in mm.masked_names)
    assert_masks_equal(mm.hard_masks(), layer_masks(masks, model))
    assert config.base_model_name_or_path is None  # the caller's config is left as it was
    prior = get_mask_model(tiny_llama(), MaskConfig(prior=path, exclude_modules=["down_proj"]))
    assert_masks_equal(prior.hard_masks(), layer_masks(masks, model))


def test_a_file_masking_a_layer_the_config_leaves_dense_is_refused(tmp_path):
    path = _write(tmp_path, reference_masks(tiny_llama()))
    with pytest.raises(MaskFileError, match=r"down_proj.weight.mask' masks layer .* leaves dense"):
        MaskModel.from_pretrained(tiny_llama(), path, config=MaskConfig(exclude_modules=["down_proj"]))


def test_a_wrong_length_is_refused(tmp_path):
    masks = reference_masks(tiny_llama())
    key = "model.layers.1.mlp.up_proj.weight.mask"
    masks[key] = masks[key][:, :-8]
    with pytest.raises(MaskFileError, match=r"up_proj.weight.mask' holds \d+ uint8 values.*another model"):
        MaskModel.from_pretrained(tiny_llama(), _write(tmp_path, masks))


def test_a_mask_that_is_not_n_m_is_refused(tmp_path):
    masks = reference_masks(tiny_llama())
    key = "model.layers.0.mlp.gate_proj.weight.mask"
    masks[key][3, 4:8] = True  # one group keeps 4 of 4
    with pytest.raises(MaskFileError, match=r"gate_proj .* is not 2:4.*keeps 4"):
        MaskModel.from_pretrained(tiny_llama(), _write(tmp_path, masks))
    # a 4:8 file read as 2:4 is refused too; with its N:M it loads
    model = tiny_llama()
    masks48 = reference_masks(model, n=4, m=8)
    path = _write(tmp_path, masks48)
    with pytest.raises(MaskFileError, match="is not 2:4"):
        MaskModel.from_pretrained(tiny_llama(), path)
    mm = MaskModel.from_pretrained(tiny_llama(), path, config=MaskConfig(n=4, m=8))
    assert_masks_equal(mm.hard_masks(), layer_masks(masks48, model))


def test_pickled_content_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    called = []

    class Boom:
        def __reduce__(self):
            return (called.append, ("unpickled",))

    masks = {k: np.packbits(v.numpy()) for k, v in reference_masks(tiny_llama()).items()}
    key = next(iter(masks))
    masks[key] = np.array([Boom()], dtype=object)
    np.savez(tmp_path / "objects.npz", **masks)
    with pytest.raises(MaskFileError, match="pickled objects.*never unpickles"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "objects.npz")
    (tmp_path / "plain.npz").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(MaskFileError, match="(pickled data|not a readable).*"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "plain.npz")
    assert called == []


def test_a_corrupt_or_single_array_file_is_refused(tmp_path):
    (tmp_path / "broken.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(MaskFileError, match="not a readable .npz"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "broken.npz")
    with open(tmp_path / "single.npz", "wb") as f:
        np.save(f, np.zeros(4, dtype=np.uint8))
    with pytest.raises(MaskFileError, match="single .npy array"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "single.npz")


class _Odd(nn.Module):
    """One layer of 3 x 4 weights: 12 bits, so its packed mask ends in 4 padding bits."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)


def test_set_padding_bits_are_refused(tmp_path):
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    packed = np.packbits(mask.numpy())
    config = MaskConfig(target_modules=["proj"])
    np.savez(tmp_path / "ok.npz", **{"proj.weight.mask": packed})
    mm = MaskModel.from_pretrained(_Odd(), tmp_path / "ok.npz", config=config)
    assert torch.equal(mm.hard_masks()["proj"], mask)
    packed[-1] |= 1
    np.savez(tmp_path / "padded.npz", **{"proj.weight.mask": packed})
    with pytest.raises(MaskFileError, match="set bits past the end"):
        MaskModel.from_pretrained(_Odd(), tmp_path / "padded.npz", config=config)


def test_config_is_only_for_files_without_one(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    mm.save_pretrained(tmp_path / "ours")
    with pytest.raises(ConfigError, match="carries none"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "ours", config=MaskConfig())
    write_like_the_reference(tmp_path / REFERENCE_NAME, reference_masks(tiny_llama()))
    with pytest.raises(ConfigError, match="no prior"):
        MaskModel.from_pretrained(
            tiny_llama(), tmp_path / REFERENCE_NAME, config=MaskConfig(prior="magnitude")
        )


def test_named_masks_saved_as_npz_load_by_subfolder(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig(seed=1))
    mm.add_mask("code", MaskConfig(seed=2, init_std=1.0))
    mm.save_pretrained(tmp_path / "masks", format="npz")
    assert (tmp_path / "masks" / REFERENCE_NAME).is_file() and (
        tmp_path / "masks" / "code" / REFERENCE_NAME
    ).is_file()
    served = MaskModel.from_pretrained(tiny_llama(), tmp_path / "masks")
    served.load_mask(tmp_path / "masks", mask_name="code", subfolder="code")
    assert_masks_equal(served.hard_masks("code"), mm.hard_masks("code"))
    with pytest.raises(MaskFileError, match="subfolder='code'"):  # not the default mask under the name "code"
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "masks", mask_name="code")
