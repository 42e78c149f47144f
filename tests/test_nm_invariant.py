"""The N:M invariant: every export path verifies the pattern before it writes, every load path after it reads.

Exports (mask ``save_pretrained``, ``push_to_hub``, merged compressed and dense saves, ``save_compressed``,
``merge_and_unload``, the logits file) are fed a mask or weight that breaks N:M (or is not finite) and
must refuse before anything is written. Loads (mask folder, compressed checkpoint) are fed files whose
content breaks N:M behind valid checksums and must refuse after reading.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread: autouse)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, MaskModel, check_nm, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME, write_logits
from hf_maskllm.adapters.packing import chunk_plan
from hf_maskllm.errors import CheckpointError, MaskFileError, NMViolationError
from hf_maskllm.sparse import save_compressed
from hf_maskllm.sparse.checkpoint import write_checkpoint_file


def mask_model(n: int = 2, m: int = 4) -> MaskModel:
    mm = get_mask_model(tiny_llama(), MaskConfig(n=n, m=m))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    return mm


def break_one_mask(mm: MaskModel) -> str:
    """Make the first layer's hard mask keep every weight (as a corrupt or hand-made mask would); returns its name."""
    name = mm.masked_names[0]
    layer = mm.masked_layers()[name]
    dense = torch.ones(layer.out_features, layer.in_features, dtype=torch.bool)
    layer.hard_mask = lambda: dense  # instance attribute shadows the method
    return name


# ---------------------------------------------------------------------------------------------- exports
def packed_mask_model(tmp_path) -> MaskModel:
    """A model whose "default" mask is held as a packed hard mask (a loaded, frozen, inactive mask): saving it
    writes its hard indices as they are, not an argmax of logits."""
    mask_model().save_pretrained(tmp_path / "source")
    mm = MaskModel.from_pretrained(tiny_llama(), tmp_path / "source")
    mm.add_mask("other", MaskConfig())
    mm.set_mask("other")
    assert mm.mask_state("default").state == "packed"
    return mm


@pytest.mark.parametrize("problem", ["index-out-of-range", "wrong-group-count"])
def test_mask_save_verifies_indices_before_writing(tmp_path, problem):
    mm = packed_mask_model(tmp_path)
    good = mm.hard_indices("default")
    name = mm.masked_names[0]
    bad = dict(good)
    if problem == "index-out-of-range":
        bad[name] = good[name].clone()
        bad[name][7] = math.comb(4, 2)  # candidate 6 of 0..5 does not exist
    else:
        bad[name] = good[name][:-1]
    mm.hard_indices = lambda mask_name=None: bad
    with pytest.raises(NMViolationError, match=name):
        mm.save_pretrained(tmp_path / "mask", selected_masks=["default"])
    assert not (tmp_path / "mask").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # no temporary left either


def test_push_to_hub_verifies_before_creating_the_repo(local_hub, tmp_path):
    mm = packed_mask_model(tmp_path)
    bad = mm.hard_indices("default")
    bad[mm.masked_names[0]][0] = 99
    mm.hard_indices = lambda mask_name=None: bad
    with pytest.raises(NMViolationError):
        mm.push_to_hub("user/broken-mask", selected_masks=["default"])
    assert not local_hub.repo_exists("user/broken-mask")


@pytest.mark.parametrize("dense", [False, True], ids=["compressed", "dense"])
def test_merged_save_verifies_before_writing(tmp_path, dense):
    mm = mask_model()
    name = break_one_mask(mm)
    with pytest.raises(NMViolationError, match=name):
        mm.save_pretrained(tmp_path / "merged", merged=True, dense=dense)
    assert list(tmp_path.iterdir()) == []
    # the wrapper is intact afterwards: the unbroken layers still hold their masks, weights unchanged
    assert all(type(layer).__name__ == "MaskedLinear" for layer in mm.masked_layers().values())


def test_merge_and_unload_verifies_every_mask_before_writing_any_weight():
    mm = mask_model()
    name = break_one_mask(mm)
    with pytest.raises(NMViolationError, match=name):
        mm.merge_and_unload()
    dense = tiny_llama().state_dict()  # the same seeded weights
    for key, value in mm.base_model.state_dict().items():
        if ".logits." not in key:  # the mask's own tensors are not base weights
            assert torch.equal(value, dense[key.replace(".base_layer.", ".")]), key  # nothing was written
    check_nm(mask_model().merge_and_unload())  # the normal path still merges to exact N:M


def test_save_compressed_refuses_non_finite_weights(tmp_path):
    model = mask_model().merge_and_unload()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match="up_proj.*NaN or inf"):
        save_compressed(model, tmp_path / "c", modules=["model.layers.0.mlp.up_proj"])
    assert list(tmp_path.iterdir()) == []


def test_logits_writer_refuses_non_finite_logits(tmp_path):
    with pytest.raises(MaskFileError, match="NaN or inf"):
        write_logits(tmp_path / LOGITS_NAME, {"layer": torch.tensor([[0.0, float("nan")]])})
    assert not (tmp_path / LOGITS_NAME).exists()


# ---------------------------------------------------------------------------------------------- loads
def _rewrite_mask_file(folder, change) -> None:
    """Change the packed masks and refresh their checksums, as a buggy writer would."""
    import zlib

    with safe_open(str(folder / MASKS_NAME), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    change(tensors)
    crc = {
        k[: -len(".mask")]: zlib.crc32(t.numpy().tobytes()) for k, t in tensors.items() if k.endswith(".mask")
    }
    save_file(tensors, folder / MASKS_NAME, metadata={**metadata, "crc32": json.dumps(crc)})


@pytest.mark.parametrize("problem", ["chunk-out-of-range", "nonzero-padding"])
def test_mask_load_verifies_every_group_is_a_candidate(tmp_path, problem):
    mm = mask_model()
    mm.save_pretrained(tmp_path)
    name = "model.layers.0.self_attn.q_proj"  # 64 x 64: 1024 groups = 60 chunks of 17 + 4 groups
    k, bits = chunk_plan(6)
    assert 1024 % k and bits % 8 == 4

    def change(tensors):
        packed = tensors[f"{name}.mask"]
        if problem == "chunk-out-of-range":
            packed[:6] = 0xFF  # the first 44-bit chunk is 2**44 - 1 >= 6**17
        else:  # the last chunk holds 4 groups; set its top digit (a padding group) to 1: value += 6**16
            last = (1024 // k) * bits
            value = sum(((int(packed[(last + j) // 8]) >> ((last + j) % 8)) & 1) << j for j in range(bits))
            value += 6**16
            for j in range(bits):
                byte, bit = (last + j) // 8, (last + j) % 8
                packed[byte] = (int(packed[byte]) & ~(1 << bit)) | (((value >> j) & 1) << bit)

    _rewrite_mask_file(tmp_path, change)
    expected = "out-of-range|no valid N:M candidate" if problem == "chunk-out-of-range" else "nonzero padding"
    with pytest.raises(MaskFileError, match=expected):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


def test_mask_load_verifies_the_restored_masks_equal_the_saved_ones(tmp_path):
    """Config values that overflow the rebuilt logits would silently change the masks: refused instead."""
    mask_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    config["init_std"] = 1e308
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(MaskFileError, match="overflows"):
        MaskModel.from_pretrained(tiny_llama(), tmp_path)


@pytest.mark.parametrize(("n", "m", "byte"), [(2, 4, 0x00), (3, 6, 0xFF)], ids=["repeated", "out-of-range"])
def test_compressed_load_verifies_positions(tmp_path, n, m, byte):
    """Positions of a group must be distinct, increasing and < m (m=6 stores 3 bits, so 6 and 7 are possible)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    mm = get_mask_model(LlamaForCausalLM(cfg), MaskConfig(n=n, m=m, prior="magnitude"))
    mm.save_pretrained(tmp_path, merged=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.meta"][0, 0] = byte
    write_checkpoint_file(
        tensors, tmp_path / "model.safetensors"
    )  # valid checksums: the pattern check must act
    with pytest.raises(CheckpointError, match="down_proj.*>= m=.*or not strictly increasing"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
