"""The mask files on disk: what a save writes (config, packed masks, logits, card) and their size; masks that do
not fit the model or the config; corrupt, truncated, bit-flipped, pickled and non-finite files; missing files."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from mask_states import trained_like
from models import (
    single_thread,  # noqa: F401  (autouse fixture)
    tiny_llama,
    tiny_opt,
)
from safetensors import safe_open
from safetensors.torch import save_file

from hf_maskllm import MaskConfig, MaskModel, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME, load_mask_config
from hf_maskllm.errors import MaskFileError, MaskLLMError


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


# ---------------------------------------------------------------------------------------------- files
def test_save_writes_config_masks_and_card(tmp_path):
    mm = trained_like(base_model_name_or_path="org/tiny-llama", target_modules=["q_proj", "up_proj"])
    mm.training_summary = {"optimizer_steps": 7, "final_tau": 0.05}
    mm.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, MASKS_NAME, "README.md"])
    card = (tmp_path / "README.md").read_text()
    assert "base_model: org/tiny-llama" in card and "2:4" in card
    assert "q_proj" in card and "up_proj" in card
    assert "optimizer steps | 7" in card and "final tau | 0.05" in card
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["target_modules"] == ["q_proj", "up_proj"] and config["n"] == 2
    tensors, metadata = _read(tmp_path / MASKS_NAME)
    assert metadata["n"] == "2" and metadata["m"] == "4"
    assert json.loads(metadata["summary"]) == mm.training_summary
    assert {k.rsplit(".", 1)[0] for k in tensors} == set(mm.masked_names)
    assert all(t.dtype == torch.uint8 for k, t in tensors.items() if k.endswith(".mask"))
    # the summary travels with the mask
    loaded = MaskModel.from_pretrained(tiny_llama(), tmp_path)
    assert loaded.training_summary == mm.training_summary


def test_base_model_name_is_taken_from_the_model_config(tmp_path):
    base = tiny_llama()
    base.config._name_or_path = "org/from-config"
    mm = get_mask_model(base, MaskConfig())
    mm.save_pretrained(tmp_path)
    assert "base_model: org/from-config" in (tmp_path / "README.md").read_text()
    assert MaskConfig.from_pretrained(tmp_path).base_model_name_or_path == "org/from-config"


def test_save_logits_writes_and_later_removes_the_logits_file(tmp_path):
    mm = trained_like()
    mm.save_pretrained(tmp_path, save_logits=True)
    tensors, _ = _read(tmp_path / LOGITS_NAME)
    for name, layer in mm.masked_layers().items():
        assert torch.equal(tensors[f"{name}.logits"], layer.mask_logits.detach())
    mm.save_pretrained(tmp_path)  # a save without logits must not leave stale ones behind
    assert not (tmp_path / LOGITS_NAME).exists()


@pytest.mark.parametrize(("n", "m", "limit"), [(2, 4, 0.66), (1, 4, 0.51), (4, 8, 0.78), (2, 8, 0.62)])
def test_packed_mask_size_from_file(tmp_path, n, m, limit):
    mm = trained_like(n=n, m=m)
    mm.save_pretrained(tmp_path)
    tensors, _ = _read(tmp_path / MASKS_NAME)
    mask_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.endswith(".mask"))
    weights = sum(layer.in_features * layer.out_features for layer in mm.masked_layers().values())
    bits = mask_bytes * 8 / weights
    assert math.log2(math.comb(m, n)) / m <= bits <= limit
    if (n, m) == (2, 4):
        assert bits <= 0.70 and bits == pytest.approx(0.647, abs=0.01)  # small layers round up a bit


# ---------------------------------------------------------------------------------------------- mismatches
@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        (lambda: tiny_llama(hidden=128), "shape"),
        (lambda: tiny_llama(intermediate=256), "shape"),
        (tiny_opt, "other layers"),
    ],
    ids=["other-hidden", "other-intermediate", "other-architecture"],
)
def test_loading_into_another_model_raises(tmp_path, factory, needle):
    trained_like().save_pretrained(tmp_path)
    with pytest.raises(MaskFileError, match=needle):
        MaskModel.from_pretrained(factory(), tmp_path)


def test_masks_of_another_nm_than_the_config_raise(tmp_path):
    trained_like(n=2, m=4).save_pretrained(tmp_path / "a")
    trained_like(n=1, m=4).save_pretrained(tmp_path / "b")
    # the 1:4 mask file beside the 2:4 config
    (tmp_path / "a" / MASKS_NAME).write_bytes((tmp_path / "b" / MASKS_NAME).read_bytes())
    with pytest.raises(MaskFileError, match="1:4"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "a")


def test_prior_of_another_nm_raises(tmp_path):
    trained_like(n=2, m=4).save_pretrained(tmp_path)
    with pytest.raises(MaskFileError, match="2:4"):
        get_mask_model(tiny_llama(), MaskConfig(n=1, m=4, prior=str(tmp_path)))


def test_missing_files_raise(tmp_path):
    trained_like().save_pretrained(tmp_path)
    (tmp_path / MASKS_NAME).unlink()
    with pytest.raises(MaskFileError, match=MASKS_NAME):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)
    with pytest.raises(MaskFileError, match="neither an existing folder"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path / "no" / "such" / "folder")


# ---------------------------------------------------------------------------------------------- corruption
def _rewrite(path: Path, change) -> None:
    tensors, metadata = _read(path)
    change(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)


def _first_mask_key(path: Path) -> str:
    tensors, _ = _read(path)
    return sorted(k for k in tensors if k.endswith(".mask"))[0]


@pytest.mark.parametrize(
    "corruption",
    [
        "all-ones",
        "truncated-tensor",
        "wrong-dtype",
        "wrong-shape-record",
        "future-version",
        "other-format",
        "no-metadata",
    ],
)
def test_corrupted_mask_file_raises(tmp_path, corruption):
    trained_like().save_pretrained(tmp_path)
    path = tmp_path / MASKS_NAME
    key = _first_mask_key(path)
    layer = key[: -len(".mask")]

    def change(tensors, metadata):
        if corruption == "all-ones":  # every chunk out of range
            tensors[key] = torch.full_like(tensors[key], 0xFF)
        elif corruption == "truncated-tensor":
            tensors[key] = tensors[key][:-1].clone()
        elif corruption == "wrong-dtype":
            tensors[key] = tensors[key].to(torch.int16)
        elif corruption == "wrong-shape-record":
            tensors[f"{layer}.shape"] = torch.tensor([64, 32])
        elif corruption == "future-version":
            metadata["format_version"] = "99"
        elif corruption == "other-format":
            metadata["format"] = "something.else"
        elif corruption == "no-metadata":
            metadata.clear()

    _rewrite(path, change)
    with pytest.raises(MaskFileError):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


def _tensor_byte_range(path: Path, key: str) -> tuple[int, int]:
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    start, end = header[key]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


def test_flipped_bit_in_packed_mask_is_detected(tmp_path):
    """A single flipped bit usually still decodes to a valid mask: only a checksum can catch it."""
    trained_like().save_pretrained(tmp_path)
    path = tmp_path / MASKS_NAME
    start, end = _tensor_byte_range(path, _first_mask_key(path))
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x01  # low bit of a chunk value: stays in range
    path.write_bytes(bytes(raw))
    with pytest.raises(MaskFileError):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


def test_truncated_file_raises(tmp_path):
    trained_like().save_pretrained(tmp_path)
    path = tmp_path / MASKS_NAME
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(MaskFileError, match="corrupt or truncated"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


@pytest.mark.parametrize("file_name", [MASKS_NAME, LOGITS_NAME])
def test_pickle_in_place_of_safetensors_is_refused(tmp_path, file_name):
    mm = trained_like()
    mm.save_pretrained(tmp_path, save_logits=True)
    payload = {k: v for k, v in mm.state_dict().items()}
    torch.save(payload, tmp_path / file_name)  # a zip pickle
    with pytest.raises(MaskFileError, match="pickle"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)
    torch.save(payload, tmp_path / file_name, _use_new_zipfile_serialization=False)  # a legacy pickle
    with pytest.raises(MaskFileError, match="pickle"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


def test_non_finite_logits_are_not_saved_or_loaded(tmp_path):
    mm = trained_like()
    mm.save_pretrained(tmp_path, save_logits=True)
    with torch.no_grad():
        next(iter(mm.masked_layers().values())).mask_logits[0, 0] = float("nan")
    with pytest.raises(MaskLLMError, match="NaN"):
        mm.save_pretrained(tmp_path / "bad")

    def change(tensors, metadata):
        key = sorted(tensors)[0]
        tensors[key][0, 0] = float("inf")

    _rewrite(tmp_path / LOGITS_NAME, change)
    with pytest.raises(MaskFileError, match="not finite"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


def test_logits_relabelled_to_another_dtype_of_their_width_are_refused(tmp_path):
    """bfloat16 <-> float16 keeps every byte (the CRC passes) and reads other numbers: the saved dtype is
    checked too. A file without the recorded dtypes (older saves) still loads."""
    mm = trained_like()
    mm.save_pretrained(tmp_path, save_logits=True)
    path = tmp_path / LOGITS_NAME
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + header_len]
    assert b'"BF16"' in header  # the default logits dtype
    path.write_bytes(raw[:8] + header.replace(b'"BF16"', b'"F16" ', 1) + raw[8 + header_len :])
    with pytest.raises(MaskFileError, match=r"fail their checksum \(stored as float16, saved as bfloat16\)"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)

    mm.save_pretrained(tmp_path, save_logits=True)
    _rewrite(path, lambda tensors, metadata: metadata.pop("dtypes"))
    loaded = MaskModel.from_pretrained(tiny_llama(), tmp_path)
    for name, layer in loaded.masked_layers().items():
        assert torch.equal(layer.mask_logits, mm.masked_layers()[name].mask_logits)


def test_a_mask_config_of_the_wrong_kind_names_the_fix(tmp_path):
    (tmp_path / CONFIG_NAME).write_text("[1, 2]")
    with pytest.raises(MaskFileError, match=rf"JSON object.* Fix {CONFIG_NAME}, or save the mask again"):
        load_mask_config(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"format_version": 99}))
    with pytest.raises(MaskFileError, match="upgrade") as info:
        load_mask_config(tmp_path)
    assert "Fix" not in str(info.value)  # the file is fine, this hf_maskllm is old
