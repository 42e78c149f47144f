"""Compressed checkpoints with int8 / int4 kept values (format version 2): every writer (save_compressed, a
loaded model's save_pretrained, MaskModel.save_pretrained(merged=True), merge_checkpoint, the CLI), loading
into ``QuantizedSparseLinear`` with no float copy, re-saving bit for bit, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file
from sparse_helpers import VOCAB, merged_model, tokens
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import hf_maskllm.sparse  # noqa: F401  (registers the loader)
from hf_maskllm import MaskConfig, check_nm, get_mask_model, merge_checkpoint
from hf_maskllm.errors import CheckpointError, ConfigError
from hf_maskllm.sparse import QuantizedSparseLinear, SparseLinear, save_compressed
from hf_maskllm.sparse.checkpoint import write_checkpoint_file

QMAX = {"int8": 127, "int4": 7}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _quant(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@torch.no_grad()
def _rtn_dense(weight: torch.Tensor, values: str, group: int) -> torch.Tensor:
    """The float64 dense weight RTN must give, computed independently of the library's quantizer:
    per row, per ``group`` kept values (in column order), scale = float16(absmax / qmax)."""
    top = QMAX[values]
    w = weight.double()
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        cols = w[r].nonzero().flatten().tolist()
        # kept positions as compress stores them: nonzeros plus the lowest zeros of under-full groups
        kept = []
        for g in range(0, w.shape[1], 4):
            nz = [c for c in range(g, g + 4) if c in cols]
            pad = [c for c in range(g, g + 4) if c not in nz][: 2 - len(nz)]
            kept += sorted(nz + pad)
        for i in range(0, len(kept), group):
            idx = kept[i : i + group]
            chunk = w[r, idx]
            scale = torch.tensor(float(chunk.abs().max()) / top, dtype=torch.float32).half().double()
            if scale > 0:
                q = torch.round(chunk.float() / scale.float()).clamp(-top, top).double()
                out[r, idx] = q * scale
    return out


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("values", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_round_trip_loads_quantized_layers_and_resaves_bit_for_bit(kind, values, tmp_path):
    model = merged_model(kind)
    names = save_compressed(model, tmp_path / "c", values=values, group_size=16)
    q = _quant(tmp_path / "c")
    assert (q["format_version"], q["values"], q["group_size"], q["modules"]) == (2, values, 16, names)
    files = _tensors(tmp_path / "c")
    for name in names:
        assert f"{name}.values" not in files and f"{name}.weight" not in files
        assert files[f"{name}.qvalues"].dtype == (torch.int8 if values == "int8" else torch.uint8)
        assert files[f"{name}.scales"].dtype == torch.float16

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    layers = {n: mod for n, mod in loaded.named_modules() if isinstance(mod, QuantizedSparseLinear)}
    assert list(layers) == names and not any(isinstance(mod, SparseLinear) for mod in loaded.modules())
    for name, layer in layers.items():
        assert (layer.bits, layer.group_size, layer.n, layer.m) == (int(values[3:]), 16, 2, 4)
        assert layer.scales.dtype == torch.float16 and layer.weight_dtype == torch.float32
        assert torch.equal(layer.qvalues, files[f"{name}.qvalues"])
        dense = model.get_submodule(name).weight.detach()
        dense = dense.t() if isinstance(model.get_submodule(name), Conv1D) else dense
        assert torch.equal(layer.dense_weight(torch.float64), _rtn_dense(dense, values, 16)), name
        assert torch.equal(layer.keep_mask() | (dense == 0), torch.ones_like(layer.keep_mask()))

    loaded.save_pretrained(tmp_path / "again")
    again = _tensors(tmp_path / "again")
    assert again.keys() == files.keys() and all(torch.equal(again[k], files[k]) for k in files)
    assert _quant(tmp_path / "again") | {"hf_maskllm_version": 0} == q | {"hf_maskllm_version": 0}


@pytest.mark.parametrize("values", ["int8", "int4"])
def test_logits_equal_the_dequantized_dense_model_in_float64(values, tmp_path):
    model = merged_model("llama")
    save_compressed(model, tmp_path / "c", values=values)  # the default group size, 32
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c").double().eval()
    reference = merged_model("llama").double().eval()
    with torch.no_grad():
        for name in _quant(tmp_path / "c")["modules"]:
            layer = reference.get_submodule(name)
            layer.weight.copy_(_rtn_dense(layer.weight, values, 32))
        ids = tokens(2, 3)
        got, want = loaded(ids).logits, reference(ids).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dense = loaded.dequantize()  # transformers' path: plain nn.Linear layers with the dequantized weights
    assert not any(isinstance(mod, QuantizedSparseLinear) for mod in dense.modules())
    assert "quantization_config" not in dense.config.to_dict()
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("values", ["int8", "int4"])
def test_tensors_held_after_loading_stay_within_the_checkpoint_bytes(values, tmp_path):
    save_compressed(merged_model("llama", torch.bfloat16), tmp_path / "c", values=values)
    on_disk = sum(t.numel() * t.element_size() for t in _tensors(tmp_path / "c").values())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    storages = {}
    for t in [*loaded.parameters(), *loaded.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) <= 1.05 * on_disk, (sum(storages.values()), on_disk)
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        logits = loaded(tokens(1, 0)).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_dtype_casts_keep_the_float16_scales():
    layer = QuantizedSparseLinear(64, 8, bits=4, group_size=16, dtype=torch.float32)
    layer.scales.fill_(0.5)
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.bfloat16
    assert layer.weight_dtype == torch.bfloat16 and layer.dense_weight().dtype == torch.bfloat16
    layer.half()
    assert layer.scales.dtype == torch.float16 and layer.weight_dtype == torch.float16
    assert layer.qvalues.dtype == torch.uint8 and layer.meta.dtype == torch.uint8


def test_check_nm_and_the_model_card_say_the_value_type(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c", values="int4", group_size=16)
    card = (tmp_path / "c" / "README.md").read_text()
    assert "format version 2: int4 kept values with one float16 scale per 16" in card
    assert "| kept values | int4, one float16 scale per 16 kept values |" in card
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    report = check_nm(loaded, 2, 4)
    assert report.ok and len(report.layers) == 14
    assert set(report.values.values()) == {"int4, 16 per scale"}
    assert "kept values: int4, 16 per scale (14 layers)" in str(report)
    # float checkpoints: the card and the report say the float dtype, the format stays version 1
    save_compressed(merged_model("llama"), tmp_path / "f")
    assert "format version 1" in (tmp_path / "f" / "README.md").read_text()
    assert _quant(tmp_path / "f")["format_version"] == 1 and "values" not in _quant(tmp_path / "f")
    assert "float32 (14 layers)" in str(check_nm(AutoModelForCausalLM.from_pretrained(tmp_path / "f"), 2, 4))


def test_a_loaded_float_model_saves_quantized_and_a_quantized_one_refuses_requantizing(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "f")
    floats = AutoModelForCausalLM.from_pretrained(tmp_path / "f")
    floats.save_pretrained(tmp_path / "q", values="int8")
    save_compressed(merged_model("llama"), tmp_path / "direct", values="int8")
    a, b = _tensors(tmp_path / "q"), _tensors(tmp_path / "direct")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    with pytest.raises(
        ConfigError, match=r"holds int8 values with group_size=32, but the save asks for int4"
    ):
        quantized.save_pretrained(tmp_path / "x", values="int4")
    with pytest.raises(ConfigError, match=r"asks for float values"):
        save_compressed(quantized, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------- other writers
def test_mask_model_merged_save_and_merge_checkpoint_write_the_same_quantized_tensors(tmp_path):
    from models import tiny_llama

    base = tiny_llama().to(torch.bfloat16)
    base.save_pretrained(tmp_path / "dense")
    mask_model = get_mask_model(base, MaskConfig(prior="magnitude"))
    mask_model.save_pretrained(tmp_path / "mask")
    mask_model.save_pretrained(tmp_path / "in_memory", merged=True, values="int4", group_size=16)
    names = merge_checkpoint(
        tmp_path / "dense",
        tmp_path / "mask",
        tmp_path / "streamed",
        progress=False,
        values="int4",
        group_size=16,
    )
    a, b = _tensors(tmp_path / "in_memory"), _tensors(tmp_path / "streamed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(f"{name}.qvalues" in a for name in names)
    qa, qb = _quant(tmp_path / "in_memory"), _quant(tmp_path / "streamed")
    assert qa == qb and (qa["values"], qa["group_size"], qa["format_version"]) == ("int4", 16, 2)
    assert "int4 kept values" in (tmp_path / "streamed" / "README.md").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    assert sum(isinstance(mod, QuantizedSparseLinear) for mod in loaded.modules()) == len(names)


def test_merge_checkpoint_refuses_a_group_size_before_writing(tmp_path):
    from models import tiny_llama

    base = tiny_llama()
    base.save_pretrained(tmp_path / "dense")
    get_mask_model(base, MaskConfig(prior="magnitude")).save_pretrained(tmp_path / "mask")
    with pytest.raises(
        ConfigError, match=r"group_size=6 does not divide its 32 kept values .*; use group_size=4"
    ):
        merge_checkpoint(tmp_path / "dense", tmp_path / "mask", tmp_path / "out", values="int4", group_size=6)
    assert not (tmp_path / "out").exists()


def test_cli_merge_writes_int8_values(tmp_path):
    from models import tiny_llama

    from hf_maskllm.cli import main

    base = tiny_llama()
    base.save_pretrained(tmp_path / "dense")
    get_mask_model(base, MaskConfig(prior="magnitude")).save_pretrained(tmp_path / "mask")
    main(["merge", "--model", str(tmp_path / "dense"), "--mask", str(tmp_path / "mask"),
          "--output", str(tmp_path / "out"), "--values", "int8", "--group-size", "8"])  # fmt: skip
    q = _quant(tmp_path / "out")
    assert (q["values"], q["group_size"]) == ("int8", 8)
    with pytest.raises(ConfigError, match="applies to int8 / int4 values only"):
        main(["merge", "--model", str(tmp_path / "dense"), "--mask", str(tmp_path / "mask"),
              "--output", str(tmp_path / "out2"), "--group-size", "8"])  # fmt: skip


# ------------------------------------------------------------------------------------------- save refusals
def test_save_refuses_a_group_size_that_does_not_fit_naming_the_layer(tmp_path):
    with pytest.raises(ConfigError, match=r"group_size=48 does not divide its 32 kept values per row in layer "
                       r"'model.layers.0.self_attn.q_proj'; use group_size=32"):  # fmt: skip
        save_compressed(merged_model("llama"), tmp_path / "c", values="int8", group_size=48)
    with pytest.raises(ConfigError, match=r"group_size=1 is odd .*use group_size=2"):
        save_compressed(merged_model("llama"), tmp_path / "c", values="int4", group_size=1)
    with pytest.raises(ConfigError, match=r"applies to compressed checkpoints"):
        save_compressed(merged_model("llama"), tmp_path / "c", values="int8", dense=True)
    with pytest.raises(ConfigError, match=r"calibration_data is used to quantize"):
        save_compressed(merged_model("llama"), tmp_path / "c", calibration_data=tokens(2, 0))
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------------- load refusals
def _saved(tmp_path: Path, values: str = "int8") -> Path:
    save_compressed(merged_model("llama"), tmp_path / "c", values=values, group_size=16)
    return tmp_path / "c"


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    write_checkpoint_file(tensors, folder / "model.safetensors")  # valid checksums: only the loader's checks


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg["quantization_config"])
    path.write_text(json.dumps(cfg))


LAYER = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(
    ("values", "edit_tensors", "edit_config", "message"),
    [
        ("int8", lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"][:, :-1]}), None,
         rf"{LAYER}.scales \[64, 3\] \(model: \[64, 4\]\)"),
        ("int4", lambda t: t.update({f"{LAYER}.qvalues": t[f"{LAYER}.qvalues"][:, :-2]}), None,
         rf"{LAYER}.qvalues \[64, 30\] \(model: \[64, 32\]\)"),
        ("int8", lambda t: t[f"{LAYER}.scales"].__setitem__((2, 1), float("nan")), None,
         rf"'{LAYER}'.*`scales` holds NaN or inf"),
        ("int8", lambda t: t[f"{LAYER}.qvalues"].__setitem__((2, 1), -128), None, rf"'{LAYER}'.*code -128"),
        ("int8", lambda t: t.update({f"{LAYER}.qvalues": t[f"{LAYER}.qvalues"].float()}), None,
         rf"{LAYER}.qvalues is stored as F32, but config.json declares int8 values"),
        ("int8", lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"].float()}), None,
         rf"{LAYER}.scales is stored as F32"),
        ("int4", None, lambda q: q.update(values="int8"), r"qvalues is stored as U8, but config.json declares int8"),
        ("int8", None, lambda q: q.update(values="int4"), r"qvalues is stored as I8, but config.json declares int4"),
        ("int8", None, lambda q: q.update(values="fp8"), r"quantization_config.values must be one of \['int8', 'int4'\]"),
        ("int8", None, lambda q: q.pop("values"), r"quantization_config.values must be one of"),
        ("int8", None, lambda q: q.update(group_size="16"), r"group_size must be a positive int"),
        ("int8", None, lambda q: q.update(group_size=24), r"group_size=24 does not divide its 32 kept values"),
        ("int8", None, lambda q: q.update(format_version=1), r"only format version 2 has, but its format_version is 1"),
        ("int8", lambda t: t.update({f"{LAYER}.values": torch.zeros(64, 64)}), None, rf"{LAYER}.values"),
    ],
    ids=["scale-count", "int4-length", "nan-scale", "int8-minus-128", "float-qvalues", "float32-scales",
         "int4-file-int8-config", "int8-file-int4-config", "unknown-values", "no-values", "group-size-type",
         "group-size-not-dividing", "version-1-with-values", "stray-float-values"],
)  # fmt: skip
def test_load_refuses_inconsistent_files_naming_the_tensor(
    tmp_path, values, edit_tensors, edit_config, message
):
    folder = _saved(tmp_path, values)
    if edit_tensors is not None:
        _edit_tensors(folder, edit_tensors)
    if edit_config is not None:
        _edit_config(folder, edit_config)
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_float_file_whose_config_declares_int8_is_refused(tmp_path):
    """A version-2 config over version-1 (float) tensors: the quantized tensors are missing."""
    save_compressed(merged_model("llama"), tmp_path / "c")
    _edit_config(tmp_path / "c", lambda q: q.update(format_version=2, values="int8", group_size=16))
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensor\(s\).*qvalues"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")


def test_layers_hold_no_float_weight_and_do_not_train(tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path))
    layer = next(mod for mod in loaded.modules() if isinstance(mod, QuantizedSparseLinear))
    assert [name for name, _ in layer.named_parameters()] == []  # llama: no bias
    assert {name for name, _ in layer.named_buffers()} == {"qvalues", "scales", "meta"}
    assert "int8, group_size=16" in repr(layer)
    x = torch.randn(3, layer.in_features, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y.sum().backward()  # the input's gradient flows through the dequantized weight
    torch.testing.assert_close(x.grad, layer.dense_weight(torch.float64).sum(0).expand(3, -1))


def test_lora_on_quantized_layers_keeps_the_pattern_and_refuses_to_merge(tmp_path):
    from peft import LoraConfig, get_peft_model

    from hf_maskllm.sparse import register_lora

    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path, "int4"))
    config = register_lora(LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    peft_model = get_peft_model(loaded, config)
    lora = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    base = lora.get_base_layer()
    assert isinstance(base, QuantizedSparseLinear)
    x = torch.randn(2, 3, base.in_features)
    delta = (lora.lora_B["default"].weight @ lora.lora_A["default"].weight) * lora.scaling["default"]
    with torch.no_grad():  # the update only at kept positions, beside whatever route the base layer takes
        torch.testing.assert_close(lora(x) - base(x), x @ (delta * base.keep_mask()).T, rtol=1e-5, atol=1e-5)
    loss = peft_model(tokens(2, 0), labels=tokens(2, 0)).loss
    loss.backward()
    assert lora.lora_A["default"].weight.grad is not None and base.qvalues.grad is None
    with pytest.raises(ConfigError, match=r"cannot merge a LoRA adapter into the int4 kept values"):
        peft_model.merge_and_unload()


def test_calibration_data_quantizes_with_the_error_compensating_method(tmp_path):
    from hf_maskllm.sparse.format import pack_codes
    from hf_maskllm.sparse.gptq import gptq_quantize_model

    model, ids = merged_model("llama"), tokens(4, 1)
    names = save_compressed(model, tmp_path / "c", values="int4", group_size=16, calibration_data=ids)
    direct = gptq_quantize_model(merged_model("llama"), names, 4, 16, ids, n=2, m=4, progress=False)
    files = _tensors(tmp_path / "c")
    for name in names:
        codes, scales = direct[name]
        assert torch.equal(files[f"{name}.qvalues"], pack_codes(codes, 4)), name
        assert torch.equal(files[f"{name}.scales"], scales.half()), name
    save_compressed(model, tmp_path / "rtn", values="int4", group_size=16)
    rtn = _tensors(tmp_path / "rtn")
    assert any(not torch.equal(rtn[f"{n}.qvalues"], files[f"{n}.qvalues"]) for n in names)
    assert sum(
        isinstance(m, QuantizedSparseLinear)
        for m in AutoModelForCausalLM.from_pretrained(tmp_path / "c").modules()
    ) == len(names)


def test_calibration_texts_need_the_tokenizer():
    from hf_maskllm.sparse.quantize import calibration_ids

    class Tokenizer:
        def __call__(self, text, return_tensors):
            return {"input_ids": torch.tensor([[ord(c) % VOCAB for c in text]])}

    ids = calibration_ids(["hello there", "a longer text"], Tokenizer())
    assert ids.shape == (2, 11) and ids.dtype == torch.int64  # cut to the shortest text
    assert torch.equal(calibration_ids([[1, 2, 3]]), torch.tensor([[1, 2, 3]]))
    with pytest.raises(ConfigError, match="pass the model's tokenizer"):
        calibration_ids(["hello"])
    with pytest.raises(ConfigError, match="token ids"):
        calibration_ids(torch.randn(2, 3))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_to_sparse_layers_quantizes_in_memory_as_a_save_and_load_would(kind, tmp_path):
    from hf_maskllm.sparse import to_sparse_layers

    model = to_sparse_layers(merged_model(kind), values="int4", group_size=16)
    assert all(not isinstance(mod, SparseLinear) for mod in model.modules())
    model.save_pretrained(tmp_path / "a")
    save_compressed(merged_model(kind), tmp_path / "b", values="int4", group_size=16)
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    ids = tokens(2, 4)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    with pytest.raises(ConfigError, match="quantizing it again would round twice"):
        to_sparse_layers(model, values="int8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loading_with_a_dtype_keeps_the_float16_scales(dtype, tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(_saved(tmp_path), dtype=dtype)
    layer = next(mod for mod in loaded.modules() if isinstance(mod, QuantizedSparseLinear))
    assert loaded.dtype == dtype and layer.weight_dtype == dtype and layer.scales.dtype == torch.float16
    with torch.no_grad():
        assert loaded(tokens(1, 0)).logits.dtype == dtype


def test_cli_learn_refuses_a_group_size_without_a_value_type_before_loading(tmp_path):
    from hf_maskllm.cli import main

    with pytest.raises(ConfigError, match="applies to int8 / int4 values only"):
        main(["learn", "--group-size", "16", "--output", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_calibration_data_on_a_compressed_model_names_the_way(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "f")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"call model.dequantize\(\)"):
        loaded.save_pretrained(tmp_path / "q", values="int4", calibration_data=tokens(2, 0))
    assert not (tmp_path / "q").exists()
