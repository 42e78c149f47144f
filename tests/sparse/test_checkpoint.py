"""save_compressed -> from_pretrained of merged N:M models, the save_pretrained a loaded one gets (and Trainer
checkpoints with it), and what happens without hf_maskllm."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sparse_helpers import (
    MODELS,
    VOCAB,
    args,
    merged_model,
    run_without_hf_maskllm,
    tiny_llama,
    tokens,
    values_of,
)
from trainer_helpers import TokenDataset
from transformers import AutoModelForCausalLM, PreTrainedModel, Trainer

import hf_maskllm.sparse  # noqa: F401  (registers the loader)
from hf_maskllm.errors import CheckpointError, NMViolationError, TargetError
from hf_maskllm.sparse import SparseLinear, find_nm_modules, save_compressed
from hf_maskllm.sparse.checkpoint import write_checkpoint_file


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(".safetensors"))


@pytest.mark.parametrize("kind", list(MODELS))
def test_round_trip_fp32_exact_and_generate(kind, tmp_path):
    model = merged_model(kind)
    modules = save_compressed(model, tmp_path / "c")
    assert len(modules) == len(find_nm_modules(model)) > 0
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["format_version"], q["n"], q["m"], q["modules"]) == (
        "hf_maskllm_nm",
        1,
        2,
        4,
        modules,
    )
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    assert all(f"{name}.weight" not in tensors and f"{name}.meta" in tensors for name in modules)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    sparse = [name for name, mod in loaded.named_modules() if isinstance(mod, SparseLinear)]
    assert sparse == modules
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    gen_kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(loaded.generate(ids[:1], **gen_kwargs), model.generate(ids[:1], **gen_kwargs))
    # Compressed is smaller than the same model saved dense.
    model.save_pretrained(tmp_path / "d")
    assert folder_bytes(tmp_path / "c") < folder_bytes(tmp_path / "d")


def test_bf16_round_trip_and_size(tmp_path):
    model = merged_model("llama", torch.bfloat16)
    save_compressed(model, tmp_path / "c", model_card={"mask": "magnitude (test)", "wikitext ppl": 123.4})
    card = (tmp_path / "c" / "README.md").read_text()
    assert "magnitude (test)" in card and "123.4" in card and "56.25%" in card
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    assert loaded.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # Same weights and ops: equal up to bf16 rounding of the (re-ordered) matmuls.
        torch.testing.assert_close(
            loaded(ids).logits.float(), model(ids).logits.float(), rtol=0.02, atol=0.02
        )
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    q = tensors["model.layers.0.self_attn.q_proj.values"]
    meta = tensors["model.layers.0.self_attn.q_proj.meta"]
    assert q.dtype == torch.bfloat16 and meta.dtype == torch.uint8
    assert (q.numel() * 2 + meta.numel()) / (64 * 64 * 2) == 0.5625


def test_sharded_and_resave_identical(tmp_path):
    model = merged_model("llama")
    save_compressed(model, tmp_path / "c", max_shard_size="100KB")
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    # The loaded model's save_pretrained writes the compressed checkpoint too (same bytes as save_compressed).
    loaded.save_pretrained(tmp_path / "x", max_shard_size="100KB")
    save_compressed(loaded, tmp_path / "r", max_shard_size="100KB")
    first = {}
    for f in sorted((tmp_path / "c").glob("*.safetensors")):
        first.update(load_file(f))
    for folder in ("r", "x"):
        again = {}
        for f in sorted((tmp_path / folder).glob("*.safetensors")):
            again.update(load_file(f))
        assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
        cfg1 = json.loads((tmp_path / "c" / "config.json").read_text())
        cfg2 = json.loads((tmp_path / folder / "config.json").read_text())
        assert cfg1["quantization_config"] == cfg2["quantization_config"]
        assert cfg1["transformers_weights"] == cfg2["transformers_weights"]
    # transformers' own writer cannot keep the no-hf_maskllm guard: called directly, it refuses.
    with pytest.raises(ValueError, match="not serializable"):
        PreTrainedModel.save_pretrained(loaded, tmp_path / "y")
    # Saving over an existing folder replaces it (stale shards removed).
    save_compressed(loaded, tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").glob("model*")) == ["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_violation_raises_before_writing(tmp_path):
    model = merged_model("llama")
    target = tmp_path / "c"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, :4] = 1.0
    with pytest.raises(NMViolationError, match="up_proj"):
        save_compressed(model, target, modules=["model.layers.1.mlp.up_proj"])
    with pytest.raises(NMViolationError):
        save_compressed(model, target, modules=["model.layers.1.mlp.up_proj"], dense=True)
    with pytest.raises(TargetError, match="does not exist"):
        save_compressed(model, target, modules=["model.layers.9.mlp.up_proj"])
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # modules=None skips the now-dense layer and compresses the rest.
    modules = save_compressed(model, target)
    assert "model.layers.1.mlp.up_proj" not in modules and len(modules) == 13


def test_load_rejects_future_version_and_corrupt_meta(tmp_path):
    model = merged_model("llama")
    save_compressed(model, tmp_path / "c")
    cfg_path = tmp_path / "c" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["format_version"] = 3
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="Upgrade hf_maskllm"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    cfg["quantization_config"]["format_version"] = 1
    cfg_path.write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.meta"][0, 0] = 0b00_00_01_01  # group 0 positions 1, 1
    write_checkpoint_file(tensors, tmp_path / "c" / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")


@pytest.mark.parametrize(
    "kind,module,part",
    [
        ("llama", "model.layers.0.mlp.down_proj", "values"),
        ("llama", "model.layers.0.mlp.down_proj", "meta"),
        ("qwen2", "model.layers.0.self_attn.q_proj", "bias"),
    ],
)
def test_load_rejects_missing_tensor(tmp_path, kind, module, part):
    """transformers alone would fill a missing tensor with uninitialised memory and only warn."""
    save_compressed(merged_model(kind), tmp_path / "c")
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    del tensors[f"{module}.{part}"]
    write_checkpoint_file(tensors, tmp_path / "c" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{module}.{part}"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")


def test_saved_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        save_compressed(merged_model("llama"), tmp_path / "c")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "c").iterdir()}
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o755
    assert set(modes.values()) == {0o644}, modes


def test_load_rejects_non_finite_values(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c")
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.values"][3, 5] = float("nan")
    write_checkpoint_file(tensors, tmp_path / "c" / "model.safetensors")
    with pytest.raises(CheckpointError, match="q_proj.values holds NaN"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")


def test_without_hf_maskllm_fails_loudly_and_dense_loads(tmp_path):
    model = merged_model("llama")
    save_compressed(model, tmp_path / "c")
    save_compressed(model, tmp_path / "d", dense=True)
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    script = textwrap.dedent(
        f"""
        import sys, torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path / "c")!r})
        except Exception as e:
            print("COMPRESSED-ERROR:", type(e).__name__, e)
        else:
            print("COMPRESSED-LOADED")
        dense = AutoModelForCausalLM.from_pretrained({str(tmp_path / "d")!r})
        with torch.no_grad():
            logits = dense(torch.tensor({ids.tolist()})).logits
        save_file({{"logits": logits.contiguous()}}, {str(tmp_path / "logits.safetensors")!r})
        assert "hf_maskllm" not in sys.modules
        """
    )
    out = run_without_hf_maskllm(script, tmp_path).stdout
    # refused before a weight is read (no random layers), naming the problem and the fix
    assert "COMPRESSED-ERROR: ValueError" in out, out
    assert "stores N:M-compressed weights" in out, out
    assert "Run `pip install hf_maskllm` and `import hf_maskllm` before from_pretrained" in out, out
    logits = load_file(tmp_path / "logits.safetensors")["logits"]
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_check_nm_reads_a_loaded_compressed_model(tmp_path):
    from hf_maskllm import check_nm

    modules = save_compressed(merged_model("llama"), tmp_path / "c")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    report = check_nm(loaded, 2, 4)
    assert set(report.layers) == set(modules) and report.ok
    sparse = next(mod for mod in loaded.modules() if isinstance(mod, SparseLinear))
    with torch.no_grad():  # positions of a group must stay distinct: plant a second kept value at a new spot
        sparse.values[0, :2] = 1.0
    assert check_nm(loaded, 1, 4, raise_on_violation=False).violations


def test_push_merged_to_hub_and_load_by_repo_id(local_hub):
    """MaskModel.push_to_hub(merged=True) -> AutoModelForCausalLM.from_pretrained(repo_id): the compressed model."""
    from hf_maskllm import MaskConfig, get_mask_model

    torch.manual_seed(0)
    mask_model = get_mask_model(tiny_llama(), MaskConfig(prior="magnitude"))
    mask_model.training_summary = {"heldout_ppl_wikipedia": 12.5}
    mask_model.eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = mask_model(input_ids=ids).logits
    mask_model.push_to_hub("user/tiny-2of4", merged=True)
    files = local_hub.repo_files("user/tiny-2of4")
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    card = files["README.md"].decode()
    assert "2:4" in card and "MaskLLM" in card and "prior: magnitude" in card and "12.5" in card
    loaded = AutoModelForCausalLM.from_pretrained("user/tiny-2of4")
    assert sum(isinstance(mod, SparseLinear) for mod in loaded.modules()) == len(mask_model.masked_names)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- the bound save_pretrained
def test_trainer_checkpoints_are_compressed(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    trainer = Trainer(
        model=model,
        args=args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=TokenDataset(tokens(16, 1)),
    )
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "hf_maskllm_nm"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(
        torch.equal(a, b)
        for a, b in zip(values_of(reloaded).values(), values_of(model).values(), strict=True)
    )


def test_save_pretrained_refuses_what_it_cannot_write(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    with pytest.raises(CheckpointError, match="safe_serialization"):
        model.save_pretrained(tmp_path / "x", safe_serialization=False)
    with pytest.raises(CheckpointError, match="state_dict"):
        model.save_pretrained(tmp_path / "x", state_dict={"x": torch.zeros(1)})
