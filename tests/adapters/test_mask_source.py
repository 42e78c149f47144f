"""One reader for every mask source, and PATCH's published ``mask.npz``: read as hard masks, as a prior, by
the streaming merge and by ``hf-maskllm merge``, from a file, a folder or a Hub repo id; the three formats
give the same masks; every malformed or mismatched file is refused naming the layer and what is wrong.

The masks are written exactly as PATCH's release script writes them: for every 2-D weight under
``.layers.`` of the trained masked model, ``np.packbits`` of ``weight != 0`` flattened, its shape as int64
under ``<name>.__shape__``, and ``__meta__`` a JSON string, all through ``np.savez_compressed``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from models import model_inputs, single_thread  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_maskllm import MaskConfig, MaskModel, get_mask_model, merge_checkpoint
from hf_maskllm.adapters.mask_source import PATCH_NAME, open_mask_source, read_mask, source_targets
from hf_maskllm.adapters.reference_file import REFERENCE_NAME
from hf_maskllm.errors import MaskFileError
from hf_maskllm.modules import dense_weight_view
from hf_maskllm.patterns import candidate_patterns
from hf_maskllm.sparse import SparseLinear

_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 128,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_llama32(seed: int = 0) -> LlamaForCausalLM:
    """Llama-3.2-1B's architecture, small: tied embeddings, llama3 rope scaling."""
    torch.manual_seed(seed)
    config = LlamaConfig(**_DECODER, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0)
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    """Gemma-3-1B's architecture (``google/gemma-3-1b-pt``), small: one KV head, q/k norms, sliding window."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(**{**_DECODER, "num_key_value_heads": 1}, head_dim=16, sliding_window=16)
    return Gemma3ForCausalLM(config).eval()


def tiny_qwen25(seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2.5-0.5B's architecture, small: q/k/v biases, tied embeddings."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**_DECODER, tie_word_embeddings=True)).eval()


MODELS = {"llama-3.2": tiny_llama32, "gemma-3": tiny_gemma3, "qwen-2.5": tiny_qwen25}
META = {  # the fields PATCH's release script writes
    "repo": "llama_3.2_1b-MaskLLM-50Sparse",
    "base_model": "meta-llama/Llama-3.2-1B",
    "method": "MaskLLM",
    "variant": "MaskLLM",
    "sparsity": "50%",
    "pattern": "2:4",
    "format": "bit-packed uint8 (np.packbits); unpack with np.unpackbits",
    "measured_sparsity": 0.5,
}


def _masked_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What PATCH masks: every 2-D parameter under ``.layers.``."""
    return {name: p for name, p in model.named_parameters() if p.dim() == 2 and ".layers." in name}


def learned_masks(model: nn.Module, seed: int = 0, zero_kept: float = 0.0) -> dict[str, torch.Tensor]:
    """A random exact 2:4 mask per masked weight (``{parameter name: bool [out, in]}``); ``zero_kept`` of
    the kept weights of the dense ``model`` are set to exactly 0, as a checkpoint's zeros are."""
    generator = torch.Generator().manual_seed(seed)
    cand = candidate_patterns(2, 4, dtype=torch.bool)
    out = {}
    for name, weight in _masked_weights(model).items():
        idx = torch.randint(0, cand.shape[0], (weight.numel() // 4,), generator=generator)
        mask = cand[idx].reshape(weight.shape)
        if zero_kept:
            drop = mask & (torch.rand(weight.shape, generator=generator) < zero_kept)
            with torch.no_grad():
                weight[drop] = 0.0
        out[name] = mask
    return out


def write_like_patch(
    path: Path, trained: nn.Module, meta: dict | None = None, only: set[str] | None = None
) -> None:
    """What PATCH's release script does with a trained masked model (weights already multiplied by the
    mask); ``only``: the parameters it masked, when not all."""
    arrays = {"__meta__": np.array(json.dumps(META if meta is None else meta))}
    for name, weight in _masked_weights(trained).items():
        if only is not None and name not in only:
            continue
        keep = (weight.detach() != 0).contiguous().view(-1).numpy()
        arrays[name] = np.packbits(keep)
        arrays[name + ".__shape__"] = np.array(tuple(weight.shape), dtype=np.int64)
    np.savez_compressed(path, **arrays)


def masked_copy(build, masks: dict[str, torch.Tensor], seed: int = 0) -> nn.Module:
    """``build(seed)`` with ``W * mask`` in every masked weight: the masked model PATCH trains."""
    model = build(seed)
    state = model.state_dict()
    for name, mask in masks.items():
        state[name] = state[name] * mask
    model.load_state_dict(state)
    return model


def patch_setup(tmp_path: Path, build, seed: int = 0, zero_kept: float = 0.0, meta: dict | None = None):
    """A dense model (some kept weights exactly zero), its masks, the masked model and PATCH's file of it."""
    dense = build(seed)
    masks = learned_masks(dense, seed, zero_kept)
    trained = build(seed)
    trained.load_state_dict(dense.state_dict())
    state = trained.state_dict()
    for name, mask in masks.items():
        state[name] = state[name] * mask
    trained.load_state_dict(state)
    (tmp_path / "patch").mkdir(parents=True, exist_ok=True)
    write_like_patch(tmp_path / "patch" / PATCH_NAME, trained, meta)
    return dense, masks, trained, tmp_path / "patch" / PATCH_NAME


def _layer(name: str) -> str:
    return name[: -len(".weight")]


# ---------------------------------------------------------------------------------------------- reading
@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("form", ["file", "folder"])
def test_patch_mask_gives_exactly_the_masked_model(tmp_path, arch, form):
    build = MODELS[arch]
    # a tenth of the kept weights are exact zeros: their groups are stored keeping fewer than 2 of 4
    dense, masks, trained, path = patch_setup(tmp_path, build, zero_kept=0.1)
    keep = {name: weight.detach() != 0 for name, weight in _masked_weights(trained).items()}
    assert any(bool((k.reshape(-1, 4).sum(1) < 2).any()) for k in keep.values())
    mm = MaskModel.from_pretrained(dense, path if form == "file" else path.parent)
    assert sorted(mm.masked_names) == sorted(_layer(name) for name in masks)
    assert mm.training_summary["source"] == f"PATCH {PATCH_NAME}"
    assert mm.training_summary["method"] == "MaskLLM" and mm.training_summary["pattern"] == "2:4"
    hard = mm.hard_masks()
    for name, kept in keep.items():
        groups = hard[_layer(name)].reshape(-1, 4)
        assert bool((groups.sum(1) == 2).all()), name  # exactly 2:4
        assert bool(hard[_layer(name)][kept].all()), name  # every weight the file keeps is kept
    # the hard masks give the trained masked model's weights exactly (completed groups add only zeros)
    merged = mm.merge_and_unload()
    reference = dict(trained.named_parameters())
    for name, param in merged.named_parameters():
        assert torch.equal(param, reference[name]), name
    inputs = model_inputs(merged)
    with torch.no_grad():
        assert torch.equal(merged(**inputs).logits, trained(**inputs).logits)


def test_patch_mask_as_a_prior_and_in_a_list_of_priors(tmp_path):
    dense, masks, _, path = patch_setup(tmp_path, tiny_llama32, seed=3)
    prior = get_mask_model(dense, MaskConfig(prior=str(path), seed=11))
    for name, mask in masks.items():
        assert torch.equal(prior.hard_masks()[_layer(name)], mask), name
    fresh = get_mask_model(tiny_llama32(3), MaskConfig(seed=11, logits_dtype="float32"))
    combined = get_mask_model(
        tiny_llama32(3), MaskConfig(prior=[str(path.parent), "magnitude"], seed=11, logits_dtype="float32")
    )
    cand = candidate_patterns(2, 4)
    for name, mask in masks.items():
        layer = combined.masked_layers()[_layer(name)]
        init = fresh.masked_layers()[_layer(name)].mask_logits.detach().float()
        overlap = mask.reshape(-1, 4).float() @ cand.t()
        delta = layer.mask_logits.detach() - init
        assert float((delta * (overlap - 1)).sum()) > 0, name  # the file's term is in it


def test_a_hub_repo_holding_patch_mask(tmp_path, local_hub):
    from huggingface_hub import HfApi

    dense, masks, trained, path = patch_setup(tmp_path, tiny_gemma3, seed=5)
    (path.parent / "README.md").write_text("MaskLLM 2:4 mask of a tiny Gemma-3\n")
    api = HfApi()
    api.create_repo("user/gemma_3_tiny-MaskLLM-50Sparse")
    api.upload_folder(repo_id="user/gemma_3_tiny-MaskLLM-50Sparse", folder_path=path.parent)
    source = open_mask_source("user/gemma_3_tiny-MaskLLM-50Sparse")
    assert source.format == "patch" and source.meta == META
    mm = MaskModel.from_pretrained(dense, "user/gemma_3_tiny-MaskLLM-50Sparse")
    for name, mask in masks.items():
        assert torch.equal(mm.hard_masks()[_layer(name)], mask), name
    prior = get_mask_model(tiny_gemma3(5), MaskConfig(prior="user/gemma_3_tiny-MaskLLM-50Sparse", seed=2))
    for name, mask in masks.items():
        assert torch.equal(prior.hard_masks()[_layer(name)], mask), name
    # the streaming merge from the repo id, onto the dense checkpoint's folder
    tiny_gemma3(5).save_pretrained(tmp_path / "dense")
    with pytest.warns(UserWarning, match="learned on 'meta-llama/Llama-3.2-1B'"):
        merge_checkpoint(
            tmp_path / "dense", "user/gemma_3_tiny-MaskLLM-50Sparse", tmp_path / "out", progress=False
        )
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    inputs = model_inputs(sparse)
    with torch.no_grad():
        assert torch.allclose(sparse(**inputs).logits, trained(**inputs).logits, atol=1e-5, rtol=1e-5)


def test_the_three_formats_read_the_same_masks(tmp_path):
    dense, masks, _, patch = patch_setup(tmp_path, tiny_qwen25, seed=7)
    mm = MaskModel.from_pretrained(dense, patch)
    mm.save_pretrained(tmp_path / "hf_maskllm")
    mm.save_pretrained(tmp_path / "nvlabs", format="npz")
    sources = {
        "hf_maskllm": tmp_path / "hf_maskllm",
        "nvlabs": tmp_path / "nvlabs" / REFERENCE_NAME,
        "patch": patch,
    }
    model = tiny_qwen25(7)
    layers = {name: model.get_submodule(name) for name in mm.masked_names}
    shapes = {name: tuple(dense_weight_view(layer).shape) for name, layer in layers.items()}
    model_layers = {name for name, _ in model.named_modules()}
    read = {}
    for fmt, where in sources.items():
        source = open_mask_source(where)
        assert source.format == fmt
        assert source_targets(model, source) == mm.masked_names
        read[fmt] = read_mask(source, shapes, (), model_layers).indices
    for fmt in ("nvlabs", "patch"):
        assert all(torch.equal(read[fmt][name], read["hf_maskllm"][name]) for name in shapes), fmt
    # the same masks through every entry point
    tiny_qwen25(7).save_pretrained(tmp_path / "dense")  # `dense` is wrapped by now
    outputs = {}
    for fmt, where in sources.items():
        loaded = MaskModel.from_pretrained(tiny_qwen25(7), where)
        prior = get_mask_model(tiny_qwen25(7), MaskConfig(prior=str(where), seed=1))
        for name, mask in masks.items():
            assert torch.equal(loaded.hard_masks()[_layer(name)], mask), (fmt, name)
            assert torch.equal(prior.hard_masks()[_layer(name)], mask), (fmt, name)
        merge_checkpoint(tmp_path / "dense", where, tmp_path / f"merged-{fmt}", progress=False)
        outputs[fmt] = {}
        for file in sorted((tmp_path / f"merged-{fmt}").glob("*.safetensors")):
            outputs[fmt].update(load_file(file))
    for fmt in ("nvlabs", "patch"):
        assert set(outputs[fmt]) == set(outputs["hf_maskllm"])
        assert all(torch.equal(outputs[fmt][k], v) for k, v in outputs["hf_maskllm"].items()), fmt


# ---------------------------------------------------------------------------------------------- merging
def test_one_command_from_patch_mask_to_a_compressed_model(tmp_path, capsys):
    from hf_maskllm.cli import main

    dense, _, trained, path = patch_setup(tmp_path, tiny_llama32, zero_kept=0.1)
    dense.to(torch.bfloat16).save_pretrained(tmp_path / "dense", max_shard_size="60KB")
    args = ["merge", "--model", str(tmp_path / "dense"), "--mask", str(path.parent)]
    with pytest.warns(
        UserWarning, match=r"learned on 'meta-llama/Llama-3.2-1B' and is loaded onto '.*dense'"
    ):
        main([*args, "--output", str(tmp_path / "out")])
    assert "14 layers stored compressed" in capsys.readouterr().out
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert sum(isinstance(module, SparseLinear) for module in sparse.modules()) == 14
    # the same checkpoint as the in-memory merge of the masked model
    MaskModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "dense"), path).save_pretrained(
        tmp_path / "in_memory", merged=True
    )
    in_memory = AutoModelForCausalLM.from_pretrained(tmp_path / "in_memory").eval()
    inputs = model_inputs(sparse)
    with torch.no_grad():
        assert torch.equal(sparse(**inputs).logits, in_memory(**inputs).logits)
        masked = trained.to(torch.bfloat16)(**inputs).logits.float()
        assert torch.allclose(sparse(**inputs).logits.float(), masked, atol=2e-2, rtol=2e-2)
        ids = sparse.generate(inputs["input_ids"][:1, :4], max_new_tokens=4, do_sample=False)
    assert ids.shape == (1, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        main([*args, "--output", str(tmp_path / "int8"), "--values", "int8"])
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert "int8" in json.dumps(config["quantization_config"])
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "int8") is not None


# ---------------------------------------------------------------------------------------------- refusals
def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


def test_pickled_content_is_refused_and_never_unpickled(tmp_path):
    called = []

    class Payload:
        def __reduce__(self):
            return (called.append, ("unpickled",))

    _, _, _, path = patch_setup(tmp_path, tiny_llama32)
    arrays = _arrays(path)
    arrays["model.layers.0.mlp.up_proj.weight"] = np.array([Payload()], dtype=object)
    np.savez(tmp_path / "objects.npz", **arrays)
    with pytest.raises(MaskFileError, match="pickled objects.*never unpickles"):
        MaskModel.from_pretrained(tiny_llama32(), tmp_path / "objects.npz")
    arrays = _arrays(path)
    arrays["__meta__"] = np.array([Payload()], dtype=object)
    np.savez(tmp_path / "meta.npz", **arrays)
    with pytest.raises(MaskFileError, match="pickled objects.*never unpickles"):
        MaskModel.from_pretrained(tiny_llama32(), tmp_path / "meta.npz")
    assert called == []


def test_a_shape_that_is_not_the_models_is_refused_naming_both(tmp_path):
    _, _, _, path = patch_setup(tmp_path, tiny_llama32)
    arrays = _arrays(path)
    key = "model.layers.1.self_attn.o_proj.weight"
    arrays[key + ".__shape__"] = np.array([32, 128], dtype=np.int64)  # same number of bits, other shape
    np.savez_compressed(path, **arrays)
    with pytest.raises(
        MaskFileError, match=r"o_proj.weight' has shape \[32, 128\].*layer .*o_proj is \[64, 64\]"
    ):
        MaskModel.from_pretrained(tiny_llama32(), path)
    with pytest.raises(MaskFileError, match=r"has shape \[32, 128\]"):
        get_mask_model(tiny_llama32(), MaskConfig(prior=str(path)))


def test_hybrid_dense_and_2_4_tiles_are_refused_naming_the_layer_share_and_pattern(tmp_path):
    meta = {
        **META,
        "method": "PATCH",
        "variant": "PATCH-Joint",
        "pattern": "Dense/2:4 tiles",
        "sparsity": "35%",
    }
    dense, masks, _, _ = patch_setup(tmp_path, tiny_qwen25, meta=meta)
    name = "model.layers.0.mlp.gate_proj.weight"
    masks[name][:16, :32] = True  # one dense tile: 128 of the layer's 2048 groups keep 4 of 4
    write_like_patch(tmp_path / "patch" / PATCH_NAME, masked_copy(tiny_qwen25, masks), meta)
    path = tmp_path / "patch" / PATCH_NAME
    pattern = (
        r"gate_proj .* is not 2:4: 6\.2% of its 2048 groups keep more than 2 of 4.*pattern='Dense/2:4 tiles'"
    )
    with pytest.raises(MaskFileError, match=pattern):
        MaskModel.from_pretrained(dense, path)
    tiny_qwen25().save_pretrained(tmp_path / "dense")
    with pytest.raises(MaskFileError, match=pattern):
        merge_checkpoint(tmp_path / "dense", path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_another_base_model_warns_naming_both(tmp_path):
    dense, _, _, path = patch_setup(tmp_path, tiny_llama32)
    dense.config._name_or_path = "org/llama-3.2-1b-instruct"
    with pytest.warns(
        UserWarning, match=r"learned on 'meta-llama/Llama-3.2-1B' and is loaded onto 'org/llama-3.2-1b"
    ):
        MaskModel.from_pretrained(dense, path)
    same = tiny_llama32()
    same.config._name_or_path = "meta-llama/Llama-3.2-1B"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskModel.from_pretrained(same, path)


def test_keys_naming_no_layer_are_refused_naming_them(tmp_path):
    _, _, _, path = patch_setup(tmp_path, tiny_llama32)
    arrays = _arrays(path)
    for old, new in (("q_proj", "qq_proj"), ("k_proj", "kk_proj")):
        key = f"model.layers.0.self_attn.{old}.weight"
        arrays[key.replace(old, new)] = arrays.pop(key)
        arrays[key.replace(old, new) + ".__shape__"] = arrays.pop(key + ".__shape__")
    np.savez_compressed(path, **arrays)
    with pytest.raises(MaskFileError, match=r"kk_proj.weight', .*qq_proj.weight'\] \(2 keys\) name no layer"):
        MaskModel.from_pretrained(tiny_llama32(), path)
    arrays["model.layers.0.self_attn.q_proj.bias"] = arrays["model.layers.0.mlp.up_proj.weight"]
    np.savez_compressed(path, **arrays)
    with pytest.raises(MaskFileError, match=r"q_proj.bias' is not a mask of a weight"):
        MaskModel.from_pretrained(tiny_llama32(), path)
    arrays = _arrays(tmp_path / "patch" / PATCH_NAME)
    arrays["__meta__"] = np.array("{not json")
    np.savez_compressed(path, **arrays)
    with pytest.raises(MaskFileError, match="'__meta__' is not a JSON string"):
        MaskModel.from_pretrained(tiny_llama32(), path)


def test_layers_the_file_does_not_mask_are_said_and_stay_dense(tmp_path):
    dense, masks, _, _ = patch_setup(tmp_path, tiny_llama32)
    kept = {
        name: mask
        for name, mask in masks.items()
        if "down_proj" not in name and "layers.1.self_attn" not in name
    }
    write_like_patch(tmp_path / "patch" / PATCH_NAME, masked_copy(tiny_llama32, kept), only=set(kept))
    path = tmp_path / "patch" / PATCH_NAME
    with pytest.warns(
        UserWarning, match=r"masks no weight of 6 of the 14 layers .*layers.0.mlp.down_proj.*stay dense"
    ):
        mm = MaskModel.from_pretrained(dense, path)
    assert sorted(mm.masked_names) == sorted(_layer(name) for name in kept)
    tiny_llama32().save_pretrained(tmp_path / "dense")  # `dense` is wrapped by now
    with pytest.warns(UserWarning, match="6 of the 14 layers"):
        names = merge_checkpoint(tmp_path / "dense", path, tmp_path / "out", progress=False)
    assert sorted(names) == sorted(_layer(name) for name in kept)
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(
        tensors["model.layers.0.mlp.down_proj.weight"], tiny_llama32().model.layers[0].mlp.down_proj.weight
    )
    # a prior covers every layer it is given: the file's gaps are named, with the fix
    with pytest.raises(MaskFileError, match=r"no mask for 6 masked layer.*exclude_modules"):
        get_mask_model(tiny_llama32(), MaskConfig(prior=str(path)))


def test_damaged_files_load_exactly_or_are_refused(tmp_path):
    """Random bytes flipped anywhere in ``mask.npz``: the mask loads exactly N:M, or a MaskFileError says why."""
    _, _, _, path = patch_setup(tmp_path, tiny_llama32)
    original = path.read_bytes()
    rng = np.random.default_rng(0)
    refused = 0
    for trial in range(30):
        data = bytearray(original)
        for pos in rng.integers(0, len(data), size=1 + trial % 3):
            data[pos] ^= 1 << int(rng.integers(0, 8))
        damaged = tmp_path / f"damaged-{trial}.npz"
        damaged.write_bytes(bytes(data))
        try:
            mm = MaskModel.from_pretrained(tiny_llama32(), damaged)
        except MaskFileError:
            refused += 1
            continue
        for name, mask in mm.hard_masks().items():
            assert bool((mask.reshape(-1, 4).sum(1) == 2).all()), (trial, name)
    assert refused > 0
