"""Which layers get a mask: target_modules / exclude_modules (name suffixes, regexes, "all-linear"),
layers that cannot be masked, and list entries that match nothing, named with a close match."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import odd_net, single_thread, tiny_gpt2, tiny_llama  # noqa: F401  (single_thread: autouse)
from torch import nn

from hf_maskllm import MaskConfig, get_mask_model
from hf_maskllm.adapters.targets import find_targets
from hf_maskllm.errors import TargetError


def test_indivisible_layer_is_skipped_with_a_warning_naming_it():
    with pytest.warns(UserWarning, match=r"odd \(in_features=6\)"):
        mm = get_mask_model(odd_net(), MaskConfig(target_modules=["up", "odd", "down"]))
    assert mm.masked_names == ["up", "down"]
    assert isinstance(mm.base_model.odd, nn.Linear)
    mm.eval()
    assert mm(torch.randn(3, 8)).shape == (3, 8)


def test_indivisible_layer_with_strict_raises():
    with pytest.raises(TargetError, match="odd"):
        get_mask_model(odd_net(), MaskConfig(strict=True))


def test_all_linear_on_custom_module_masks_every_divisible_layer():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 6 is divisible by 2: no warning
        mm = get_mask_model(odd_net(), MaskConfig(n=1, m=2))
    assert mm.masked_names == ["up", "odd", "down"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"target_modules": ["q_proj"]},
            ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"],
        ),
        ({"target_modules": ["layers.1.mlp.down_proj"]}, ["model.layers.1.mlp.down_proj"]),
        (
            {"target_modules": r"model\.layers\.1\.self_attn\.[qk]_proj"},
            ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"],
        ),
        (
            {"target_modules": ["q_proj", "down_proj"], "exclude_modules": r"model\.layers\.0\..*"},
            ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"],
        ),
    ],
)
def test_target_and_exclude_selection(kwargs, expected):
    mm = get_mask_model(tiny_llama(), MaskConfig(**kwargs))
    assert mm.masked_names == expected


def test_exclude_suffix_matches_module_names_not_their_children():
    mm = get_mask_model(tiny_llama(), MaskConfig(exclude_modules=["self_attn.q_proj", "mlp"]))
    assert len(mm.masked_names) == 12  # 'mlp' names the MLP block, whose projections stay targets
    assert not any(name.endswith("q_proj") for name in mm.masked_names)


def test_excluding_everything_raises():
    with pytest.raises(TargetError, match="matched no maskable layer"):
        get_mask_model(tiny_llama(), MaskConfig(exclude_modules=r".*_proj"))


def test_list_is_suffix_match_on_dotted_names_and_regex_is_full_match():
    with pytest.raises(TargetError, match="matched no maskable layer"):
        get_mask_model(tiny_llama(), MaskConfig(target_modules=["proj"]))  # not a dotted suffix
    with pytest.raises(TargetError, match="matched no maskable layer"):
        get_mask_model(tiny_llama(), MaskConfig(target_modules="q_proj"))  # regex must match the full name
    mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=".*q_proj"))
    assert len(mm.masked_names) == 2


def test_explicit_lm_head_target_is_masked_but_all_linear_skips_it():
    mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=["lm_head"]))
    assert mm.masked_names == ["lm_head"]
    mm2 = get_mask_model(tiny_llama(), MaskConfig(exclude_modules=["q_proj"]))
    assert "lm_head" not in mm2.masked_names


@pytest.mark.parametrize(
    ("targets", "type_name"),
    [(["embed_tokens"], "Embedding"), (["mlp"], "LlamaMLP"), (["input_layernorm"], "LlamaRMSNorm")],
)
def test_unsupported_module_named_explicitly_raises(targets, type_name):
    with pytest.raises(TargetError, match=type_name):
        get_mask_model(tiny_llama(), MaskConfig(target_modules=targets))


def _marked_quantized(model, method):
    from types import SimpleNamespace

    model.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method=method))
    return model


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "torchao"])
def test_a_model_loaded_quantized_is_refused_with_the_fix(method):
    from transformers.utils.quantization_config import QuantizationMethod

    model = _marked_quantized(tiny_llama(), QuantizationMethod(method))
    with pytest.raises(TargetError, match=f"loaded quantized \\({method}\\).*full-precision checkpoint"):
        get_mask_model(model, MaskConfig())
    assert not any(type(mod).__name__ == "MaskedLinear" for mod in model.modules())
    assert all(p.requires_grad for p in model.parameters())  # the model is left as it was


def test_a_dequantized_gguf_model_is_told_how_to_unmark_it():
    model = _marked_quantized(tiny_llama(), "gguf")
    with pytest.raises(TargetError, match=r"GGUF.*remove_quantization_config\(model\)"):
        get_mask_model(model, MaskConfig())


def test_a_saved_mask_loaded_onto_a_quantized_model_names_the_quantization(tmp_path):
    from hf_maskllm import MaskModel

    get_mask_model(tiny_llama(), MaskConfig(prior="magnitude")).save_pretrained(tmp_path)
    model = _marked_quantized(tiny_llama(), "bitsandbytes")
    with pytest.raises(TargetError, match=r"loaded quantized \(bitsandbytes\)"):
        MaskModel.from_pretrained(model, tmp_path)


def test_a_compressed_nm_checkpoint_takes_masks_on_its_dense_layers():
    from hf_maskllm.sparse.format import QUANT_METHOD

    model = _marked_quantized(tiny_llama(), QUANT_METHOD)
    assert len(get_mask_model(model, MaskConfig()).masked_names) == 7 * model.config.num_hidden_layers


class _QuantizingTensor(torch.Tensor):
    """Stands for a quantizing tensor subclass (torchao's) that reports a float dtype."""


@pytest.mark.parametrize("storage", ["int8", "float8", "subclass"])
@pytest.mark.parametrize("targets", ["all-linear", ["up_proj"]])
def test_a_layer_with_quantized_weights_is_refused_by_name(targets, storage):
    model = tiny_llama()
    layer = model.model.layers[0].mlp.up_proj
    weight = {
        "int8": lambda w: torch.ones_like(w, dtype=torch.int8),
        "float8": lambda w: w.to(torch.float8_e4m3fn),
        "subclass": lambda w: w.as_subclass(_QuantizingTensor),
    }[storage](layer.weight.detach())
    layer.weight = nn.Parameter(weight, requires_grad=False)
    with pytest.raises(
        TargetError, match=r"1 target layer\(s\) hold quantized weights.*layers\.0\.mlp\.up_proj"
    ):
        get_mask_model(model, MaskConfig(target_modules=targets))
    assert not any(type(mod).__name__ == "MaskedLinear" for mod in model.modules())


def test_targets_matching_nothing_raise():
    with pytest.raises(TargetError, match="nonexistent"):
        get_mask_model(tiny_llama(), MaskConfig(target_modules=["nonexistent"]))


# ---------------------------------------------------------------------------------------------- entries that match nothing
def test_a_target_entry_that_matches_nothing_is_named_with_a_close_match():
    with pytest.warns(UserWarning) as caught:
        mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=["q_proj", "k_prj"]))
    messages = [str(w.message) for w in caught if "matches no module" in str(w.message)]
    assert messages == [
        "target_modules entry 'k_prj' matches no module of LlamaForCausalLM; it selects nothing. Did you mean 'k_proj'?"
    ]
    assert [name.rsplit(".", 1)[1] for name in mm.masked_names] == [
        "q_proj",
        "q_proj",
    ]  # the rest still applies


def test_an_exclude_entry_that_matches_nothing_is_named_too():
    with pytest.warns(
        UserWarning, match=r"exclude_modules entry 'down_prj' matches no module.*'down_proj'\?"
    ):
        mm = get_mask_model(tiny_llama(), MaskConfig(exclude_modules=["q_proj", "down_prj"]))
    assert len(mm.masked_names) == 12  # down_proj stays masked: the typo excluded nothing


def test_an_entry_far_from_every_name_is_named_without_a_guess():
    with pytest.warns(UserWarning, match="'experts' matches no module of GPT2LMHeadModel") as caught:
        names = find_targets(tiny_gpt2(), ["c_attn", "experts"], None, 4)
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert not any("Did you mean" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("targets", "exclude"),
    [
        (["q_proj", "layers.1.mlp.down_proj"], ["layers.0.self_attn.q_proj"]),  # dotted suffixes match
        (r".*\.(q|k)_proj", r"model\.layers\.0\..*"),  # regexes are not checked entry by entry
        ("all-linear", None),
    ],
)
def test_entries_that_all_match_say_nothing(targets, exclude):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_mask_model(tiny_llama(), MaskConfig(target_modules=targets, exclude_modules=exclude))
