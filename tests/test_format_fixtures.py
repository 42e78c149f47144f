"""Files written by hf_maskllm's format version 1 keep loading identically (format fixtures).

``tests/fixtures/format_v1/`` was written once, by ``tests/fixtures/make_format_fixtures.py`` run
against a clean checkout of the commit recorded in its ``MANIFEST.json`` (with the versions, the date
and what each fixture is), and committed. Never regenerate it to make this file pass: a failure here
means files users already have would load differently. A deliberate format change gets a new
``format_v2/`` beside it (and a loader that still reads v1).

Each fixture is loaded through the public API onto the same seeded tiny model it was written from
(``tests/models.py``) and compared with its ``<fixture>.expected.safetensors``: hard masks, mask
logits and dense-with-zeros weights bit for bit. Re-saving what was loaded and loading that must give
the same tensors again; the re-saved files must also hold the fixture files' tensors and checksums
(the writer is unchanged; for checkpoints docs/checkpoint_format.md promises that a save, load and
re-save round-trips bit for bit).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from models import (
    single_thread,  # noqa: F401  (autouse fixture)
    tiny_gpt2,
    tiny_llama,
)
from safetensors import safe_open
from sparse_helpers import assert_logits_close
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from hf_maskllm import MaskConfig, MaskModel, check_nm
from hf_maskllm.adapters.config import ADDED_DEFAULTS, ADDED_FIELDS
from hf_maskllm.sparse import SparseLinear

FIXTURES = Path(__file__).parent / "fixtures" / "format_v1"
MASK_FILES = ("mask_model.safetensors", "mask_logits.safetensors")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def llama() -> torch.nn.Module:
    return tiny_llama(seed=0, hidden=32, intermediate=64)


def gpt2() -> torch.nn.Module:
    return tiny_gpt2(seed=0)


# ------------------------------------------------------------------------------------------- helpers
def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _expected(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and (JSON-decoded) metadata of ``<name>.expected.safetensors``."""
    tensors, raw = _read(FIXTURES / f"{name}.expected.safetensors")
    meta = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return tensors, meta


def _same_numerics(meta: dict) -> bool:
    """Whether floating-point results computed here can be compared bit for bit with the fixture's.

    Loading stores and copies tensors, which is exact everywhere. But some expected values were
    *computed* when the fixtures were written (logits rebuilt from hard masks use a ``std`` reduction;
    model outputs use matmuls and the transformers model code): torch's CPU kernels are chosen per
    instruction set (AVX2 / AVX-512) and, like the model code, change between versions, and so can
    their last bits. With the torch, transformers and CPU capability that wrote the fixtures (recorded
    in each expected file) those are compared exactly; otherwise (e.g. ``make test-floors``, or an AVX2
    CPU) within a tolerance (:func:`sparse_helpers.assert_logits_close`).
    """
    return (
        meta["torch"] == torch.__version__
        and meta["transformers"] == transformers.__version__
        and meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    )


def _assert_computed_equal(actual: torch.Tensor, expected: torch.Tensor, meta: dict, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if _same_numerics(meta):
        assert torch.equal(actual, expected), what
    else:
        assert_logits_close(actual, expected, what)


def _sha256(tensor: torch.Tensor) -> str:
    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _assert_masks(
    mask_model: MaskModel,
    expected: dict[str, torch.Tensor],
    prefix: str,
    layers: list[str],
    mask_name: str | None = None,
) -> None:
    """The hard masks (of ``mask_name``, default the active one) equal ``expected[prefix + layer]``."""
    masks = mask_model.hard_masks(mask_name)
    assert list(masks) == layers
    assert sorted(k[len(prefix) :] for k in expected if k.startswith(prefix)) == sorted(layers)
    for name, mask in masks.items():
        assert mask.dtype == torch.bool
        assert torch.equal(mask.to(torch.uint8), expected[prefix + name]), f"{mask_name} {name}"


def _logits(mask_model: MaskModel) -> dict[str, torch.Tensor]:
    return {name: layer.mask_logits.detach() for name, layer in mask_model.masked_layers().items()}


def _assert_same_mask_files(written: Path, fixture: Path) -> None:
    """A re-save writes the fixture's tensors and metadata again (file bytes differ: safetensors orders
    the metadata keys at random), plus the metadata written since (each layer's logits dtype, which older
    versions ignore), and the same config apart from the library version."""
    for file in MASK_FILES:
        assert (written / file).is_file() == (fixture / file).is_file(), file
        if (fixture / file).is_file():
            (t1, m1), (t2, m2) = _read(written / file), _read(fixture / file)
            if file == "mask_logits.safetensors" and "dtypes" not in m2:
                dtypes = {
                    k.removesuffix(".logits"): str(t.dtype).removeprefix("torch.") for k, t in t1.items()
                }
                assert json.loads(m1.pop("dtypes")) == dtypes, file
            assert m1 == m2, file
            assert list(t1) == list(t2) and all(torch.equal(t1[k], t2[k]) for k in t1), file
    c1, c2 = (json.loads((f / "mask_config.json").read_text()) for f in (written, fixture))
    c1.pop("hf_maskllm_version"), c2.pop("hf_maskllm_version")
    assert c1 == c2  # fields added since, at their defaults, are left out: older versions read it


# ------------------------------------------------------------------------------------------- manifest
def test_fixture_files_are_the_committed_ones():
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    assert manifest["format_version"] == 1
    on_disk = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*") if p.is_file())
    assert on_disk == sorted([*manifest["files"], "MANIFEST.json"])
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((FIXTURES / rel).read_bytes()).hexdigest() == digest, (
            f"{rel} changed: the fixtures are frozen; restore them with git (never regenerate them)."
        )


def _v1_fields(config: MaskConfig) -> dict:
    """The config's fields that files of the fixtures' time hold; the fields added since (``ADDED_FIELDS``)
    must read as what those masks were learned with: the paper's objective, no Wanda order (not today's
    defaults)."""
    d = config.to_dict()
    for name in ADDED_FIELDS:
        assert d.pop(name) == ADDED_DEFAULTS[name], name
    return d


# ------------------------------------------------------------------------------------------- masks
def test_single_mask_loads_exactly():
    """2:4, default config, bf16 logits saved with the mask: masks and logits restored bit for bit."""
    folder = FIXTURES / "llama_mask_2of4"
    expected, meta = _expected("llama_mask_2of4")
    mm = MaskModel.from_pretrained(llama(), folder)
    assert list(mm.masked_layers()) == meta["layers"]
    assert mm.list_masks() == ["default"] and mm.active_mask == "default"
    _assert_masks(mm, expected, "mask.", meta["layers"])
    for name, logits in _logits(mm).items():
        assert logits.dtype == torch.bfloat16
        assert torch.equal(logits, expected[f"logits.{name}"]), name
    assert _v1_fields(mm.mask_config) == meta["config"]
    assert _v1_fields(MaskConfig.from_pretrained(folder)) == meta["config"]
    assert mm.training_summary == meta["summary"]
    check_nm(mm.merge_and_unload(), n=2, m=4)


def test_single_mask_resave_round_trip(tmp_path):
    folder = FIXTURES / "llama_mask_2of4"
    expected, meta = _expected("llama_mask_2of4")
    MaskModel.from_pretrained(llama(), folder).save_pretrained(tmp_path, save_logits=True)
    _assert_same_mask_files(tmp_path, folder)
    again = MaskModel.from_pretrained(llama(), tmp_path)
    _assert_masks(again, expected, "mask.", meta["layers"])
    for name, logits in _logits(again).items():
        assert torch.equal(logits, expected[f"logits.{name}"]), name
    assert again.training_summary == meta["summary"]


def _load_named(folder: Path) -> MaskModel:
    mm = MaskModel.from_pretrained(llama(), folder)  # "default": the folder itself
    mm.load_mask(folder / "code", mask_name="code")  # held packed until set_mask
    return mm


def test_named_masks_load_exactly():
    """Two named masks saved without logits: "default" in the folder, "code" in its subfolder."""
    folder = FIXTURES / "llama_named_masks"
    expected, meta = _expected("llama_named_masks")
    mm = _load_named(folder)
    assert mm.list_masks() == meta["masks"] == ["default", "code"] and mm.active_mask == "default"
    assert list(mm.masked_layers()) == meta["layers"]
    assert {name: _v1_fields(cfg) for name, cfg in mm.mask_configs.items()} == meta["configs"]
    _assert_masks(mm, expected, "default.mask.", meta["layers"])
    # "code" is held packed (loaded with is_trainable=False): its hard masks are decoded from the file's.
    _assert_masks(mm, expected, "code.mask.", meta["layers"], mask_name="code")
    # Logits rebuilt from the hard masks (the prior rule on the config's seeded init).
    for name, logits in _logits(mm).items():
        _assert_computed_equal(logits, expected[f"default.logits.{name}"], meta, f"default {name}")
    assert mm.training_summary == meta["summaries"]["default"]

    mm.set_mask("code")
    _assert_masks(mm, expected, "code.mask.", meta["layers"])
    for name, logits in _logits(mm).items():  # one-hot logits of the decoded hard mask
        assert torch.equal(logits, expected[f"code.logits.{name}"]), f"code {name}"
    assert mm.training_summary == meta["summaries"]["code"]

    mm.load_mask(folder, mask_name="code_again", subfolder="code")
    _assert_masks(mm, expected, "code.mask.", meta["layers"], mask_name="code_again")


def test_named_masks_resave_round_trip(tmp_path):
    folder = FIXTURES / "llama_named_masks"
    expected, meta = _expected("llama_named_masks")
    _load_named(folder).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in (tmp_path / "code").iterdir()) == sorted(
        p.name for p in (folder / "code").iterdir()
    )
    _assert_same_mask_files(tmp_path, folder)
    _assert_same_mask_files(tmp_path / "code", folder / "code")
    again = _load_named(tmp_path)
    _assert_masks(again, expected, "default.mask.", meta["layers"])
    _assert_masks(again, expected, "code.mask.", meta["layers"], mask_name="code")
    assert {name: _v1_fields(cfg) for name, cfg in again.mask_configs.items()} == meta["configs"]


def test_gpt2_4of8_mask_loads_exactly(tmp_path):
    """4:8 on GPT-2 Conv1D layers (masks in the transposed ``[out, in]`` view), saved without logits."""
    folder = FIXTURES / "gpt2_mask_4of8"
    expected, meta = _expected("gpt2_mask_4of8")
    mm = MaskModel.from_pretrained(gpt2(), folder)
    assert list(mm.masked_layers()) == meta["layers"]
    _assert_masks(mm, expected, "mask.", meta["layers"])
    assert _v1_fields(mm.mask_config) == meta["config"]
    assert mm.training_summary == meta["summary"]
    for name, logits in _logits(mm).items():
        assert str(logits.dtype) == meta["logits_dtype"], name
        if _same_numerics(meta):  # rebuilt with the prior rule (70 candidates: stored as SHA-256 only)
            assert _sha256(logits) == meta["logits_sha256"][name], name

    mm.save_pretrained(tmp_path)
    _assert_same_mask_files(tmp_path, folder)
    _assert_masks(MaskModel.from_pretrained(gpt2(), tmp_path), expected, "mask.", meta["layers"])


# ------------------------------------------------------------------------------------------- checkpoints
# name: (base model factory, dtype, n, m, check_nm targets, the mask fixture it was merged from)
CHECKPOINTS = {
    "llama_merged_fp32": (llama, torch.float32, 2, 4, "all-linear", ("llama_mask_2of4", "mask.")),
    "llama_merged_bf16": (llama, torch.bfloat16, 2, 4, ATTENTION, ("llama_named_masks", "code.mask.")),
    "gpt2_merged_4of8_bf16": (gpt2, torch.bfloat16, 4, 8, "all-linear", ("gpt2_mask_4of8", "mask.")),
}


def _expected_checkpoint(
    name: str,
) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor], torch.nn.Module]:
    """Expected tensors and metadata, the dense-with-zeros ``[out, in]`` weight of every compressed
    module, and the base model (cast) whose other tensors the checkpoint stores unchanged."""
    factory, dtype, n, m, targets, (mask_fixture, prefix) = CHECKPOINTS[name]
    expected, meta = _expected(name)
    assert (meta["n"], meta["m"], meta["dtype"], meta["check_nm_targets"]) == (n, m, str(dtype), targets)
    masks, _ = _expected(mask_fixture)
    base = factory().to(dtype)
    weights = {}
    for module_name in meta["modules"]:
        module = base.get_submodule(module_name)
        dense = module.weight.detach().t() if isinstance(module, Conv1D) else module.weight.detach()
        # Independent of the library: the base weight times the mask fixture's expected mask (exact).
        derived = (dense * masks[prefix + module_name].to(dtype)).contiguous()
        if f"weight.{module_name}" in expected:
            assert torch.equal(expected[f"weight.{module_name}"], derived), module_name
        else:  # stored as SHA-256 only (size)
            assert _sha256(derived) == meta["weight_sha256"][module_name], module_name
        weights[module_name] = derived
    return expected, meta, weights, base


@torch.no_grad()
def _forward(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits


def _assert_sparse_layers(
    model: torch.nn.Module, meta: dict, weights: dict[str, torch.Tensor], dtype
) -> None:
    sparse = {k: mod for k, mod in model.named_modules() if isinstance(mod, SparseLinear)}
    assert list(sparse) == meta["modules"]
    for module_name, module in sparse.items():
        assert (module.n, module.m) == (meta["n"], meta["m"]), module_name
        assert module.values.dtype == dtype and module.meta.dtype == torch.uint8, module_name
        assert torch.equal(module.weight, weights[module_name]), module_name


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoint_loads_exactly(name):
    _, dtype, n, m, targets, _ = CHECKPOINTS[name]
    expected, meta, weights, base = _expected_checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name)
    assert model.dtype == dtype
    _assert_sparse_layers(model, meta, weights, dtype)
    assert check_nm(model, n=n, m=m, target_modules=targets).ok
    # The compressed layers' forward may take another route (a CPU kernel summing in another order)
    # without any change to the format, so their logits are compared within a tolerance; the bit-exact
    # comparison is the dense-with-zeros model's below.
    assert_logits_close(_forward(model, expected["input_ids"]), expected["logits"])

    plain = model.dequantize()  # the dense-with-zeros model
    assert not any(isinstance(mod, SparseLinear) for mod in plain.modules())
    state, base_state = plain.state_dict(), base.state_dict()
    assert sorted(state) == sorted(base_state)
    for key, tensor in state.items():
        module_name, _, leaf = key.rpartition(".")
        if module_name in weights and leaf == "weight":
            module = base.get_submodule(module_name)
            want = weights[module_name].t() if isinstance(module, Conv1D) else weights[module_name]
        else:  # embeddings, norms, biases, layers that are not N:M: stored as transformers stores them
            want = base_state[key]
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), key
    _assert_computed_equal(_forward(plain, expected["input_ids"]), expected["logits"], meta, f"{name} logits")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoint_resave_round_trip(name, tmp_path):
    _, dtype, _, _, _, _ = CHECKPOINTS[name]
    expected, meta, weights, _ = _expected_checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name)
    model.save_pretrained(tmp_path)
    # The same tensors and checksums as the fixture's weight file.
    (t1, m1), (t2, m2) = _read(tmp_path / "model.safetensors"), _read(FIXTURES / name / "model.safetensors")
    assert sorted(t1) == sorted(t2) and all(torch.equal(t1[k], t2[k]) for k in t1)
    assert json.loads(m1["hf_maskllm_crc32"]) == json.loads(m2["hf_maskllm_crc32"])
    q1, q2 = (
        json.loads((f / "config.json").read_text())["quantization_config"]
        for f in (tmp_path, FIXTURES / name)
    )
    q1.pop("hf_maskllm_version"), q2.pop("hf_maskllm_version")
    assert q1 == q2

    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_sparse_layers(again, meta, weights, dtype)
    assert torch.equal(_forward(again, expected["input_ids"]), _forward(model, expected["input_ids"]))


# ------------------------------------------------------------------------------------------- version 2
# Compressed checkpoints with int8 / int4 kept values (``tests/fixtures/format_v2/``, written by
# ``make_format_fixtures.py --format-version 2``). The dequantized weights are derived here, independently
# of the library: the base weight times the mask, then round-to-nearest in float64 per row and per
# ``group_size`` kept values (scale = float16(absmax / qmax), code = round(value / scale) clamped).
FIXTURES_V2 = Path(__file__).parent / "fixtures" / "format_v2"
# name: (base model factory, dtype, n, m, values, group size, check_nm targets)
QUANTIZED = {
    "llama_merged_int8": (llama, torch.float32, 2, 4, "int8", 16, "all-linear"),
    "llama_merged_int4_bf16": (llama, torch.bfloat16, 2, 4, "int4", 8, ATTENTION),
    "gpt2_merged_4of8_int4": (gpt2, torch.bfloat16, 4, 8, "int4", 16, "all-linear"),
}


def _expected_v2(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, raw = _read(FIXTURES_V2 / f"{name}.expected.safetensors")
    meta = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value)
        except json.JSONDecodeError:
            meta[key] = value
    return tensors, meta


def _rtn_dense(
    dense: torch.Tensor, mask: torch.Tensor, n: int, m: int, values: str, group: int
) -> torch.Tensor:
    """float64 ``[out, in]``: ``dense * mask`` with its kept values quantized by round-to-nearest."""
    top = 127 if values == "int8" else 7
    w = dense.double() * mask.double()
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        kept: list[int] = []  # the stored positions: the mask's, padded with the lowest others to n
        for g in range(0, w.shape[1], m):
            cols = [c for c in range(g, g + m) if mask[r, c]]
            cols += [c for c in range(g, g + m) if not mask[r, c]][: n - len(cols)]
            kept += sorted(cols)
        for i in range(0, len(kept), group):
            idx = kept[i : i + group]
            scale = torch.tensor(float(w[r, idx].abs().max()) / top, dtype=torch.float32).half()
            if float(scale) > 0:
                q = torch.round(w[r, idx].float() / scale.float()).clamp(-top, top)
                out[r, idx] = q.double() * float(scale)
    return out + 0.0  # -0.0 (a code rounded to zero from below) as the library's +0.0


def _expected_quantized_weights(name: str) -> tuple[dict, dict, dict[str, torch.Tensor], torch.nn.Module]:
    factory, dtype, n, m, values, group, targets = QUANTIZED[name]
    expected, meta = _expected_v2(name)
    assert (meta["n"], meta["m"], meta["dtype"], meta["values"], meta["group_size"]) == (
        n, m, str(dtype), values, group,
    )  # fmt: skip
    v1_masks, _ = _expected("gpt2_mask_4of8") if name.startswith("gpt2") else (expected, None)
    base = factory().to(dtype)
    weights = {}
    for module_name in meta["modules"]:
        module = base.get_submodule(module_name)
        dense = module.weight.detach().t() if isinstance(module, Conv1D) else module.weight.detach()
        mask = v1_masks[f"mask.{module_name}"].bool()
        if "mask_sha256" in meta:
            assert _sha256(mask.to(torch.uint8)) == meta["mask_sha256"][module_name], module_name
        derived = _rtn_dense(dense, mask, n, m, values, group).float()
        if f"weight.{module_name}" in expected:
            assert torch.equal(expected[f"weight.{module_name}"], derived), module_name
        else:
            assert _sha256(derived) == meta["weight_sha256"][module_name], module_name
        weights[module_name] = derived
    return expected, meta, weights, base


def test_v2_fixture_files_are_the_committed_ones():
    manifest = json.loads((FIXTURES_V2 / "MANIFEST.json").read_text())
    assert manifest["format_version"] == 2
    on_disk = sorted(str(p.relative_to(FIXTURES_V2)) for p in FIXTURES_V2.rglob("*") if p.is_file())
    assert on_disk == sorted([*manifest["files"], "MANIFEST.json"])
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((FIXTURES_V2 / rel).read_bytes()).hexdigest() == digest, (
            f"{rel} changed: the fixtures are frozen; restore them with git (never regenerate them)."
        )


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_checkpoint_loads_exactly(name):
    from hf_maskllm.sparse import QuantizedSparseLinear

    _, dtype, n, m, values, group, targets = QUANTIZED[name]
    expected, meta, weights, base = _expected_quantized_weights(name)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES_V2 / name)
    assert model.dtype == dtype
    layers = {k: mod for k, mod in model.named_modules() if isinstance(mod, QuantizedSparseLinear)}
    assert list(layers) == meta["modules"]
    for module_name, layer in layers.items():
        assert (layer.n, layer.m, layer.value_type, layer.group_size) == (n, m, values, group), module_name
        assert layer.scales.dtype == torch.float16 and layer.meta.dtype == torch.uint8
        assert torch.equal(layer.dense_weight(torch.float32), weights[module_name]), module_name
    report = check_nm(model, n=n, m=m, target_modules=targets)
    assert report.ok and {report.values[k] for k in layers} == {f"{values}, {group} per scale"}
    # the compressed layers' forward may take another route (a kernel summing in another order)
    assert_logits_close(_forward(model, expected["input_ids"]), expected["logits"])

    plain = model.dequantize()  # the dense model: dequantized weights in the model's dtype
    state, base_state = plain.state_dict(), base.state_dict()
    assert sorted(state) == sorted(base_state)
    for key, tensor in state.items():
        module_name, _, leaf = key.rpartition(".")
        if module_name in weights and leaf == "weight":
            module = base.get_submodule(module_name)
            want = weights[module_name].t() if isinstance(module, Conv1D) else weights[module_name]
            want = want.to(dtype)
        else:
            want = base_state[key]
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), key


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_checkpoint_resave_round_trip(name, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES_V2 / name)
    model.save_pretrained(tmp_path)
    (t1, m1), (t2, m2) = (
        _read(tmp_path / "model.safetensors"),
        _read(FIXTURES_V2 / name / "model.safetensors"),
    )
    assert sorted(t1) == sorted(t2) and all(torch.equal(t1[k], t2[k]) for k in t1)
    assert json.loads(m1["hf_maskllm_crc32"]) == json.loads(m2["hf_maskllm_crc32"])
    q1, q2 = (
        json.loads((f / "config.json").read_text())["quantization_config"]
        for f in (tmp_path, FIXTURES_V2 / name)
    )
    q1.pop("hf_maskllm_version"), q2.pop("hf_maskllm_version")
    assert q1 == q2 and q1["format_version"] == 2
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = _expected_v2(name)[0]["input_ids"]
    assert torch.equal(_forward(again, ids), _forward(model, ids))
