"""``merge_checkpoint``: a saved mask applied to a dense checkpoint on disk, shard by shard, writes the same
compressed checkpoint as the in-memory path (``MaskModel.from_pretrained(...).save_pretrained(merged=True)``),
and refuses what it cannot merge before writing anything."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from models import model_inputs, single_thread, tiny_gemma, tiny_gpt2, tiny_llama, tiny_llama_tied  # noqa: F401
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_maskllm import MaskConfig, MaskModel, get_mask_model, merge_checkpoint
from hf_maskllm.errors import CheckpointError, ConfigError, MaskFileError
from hf_maskllm.sparse import SparseLinear


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _setup(tmp_path: Path, build, shard: str | None = "40KB", fmt: str = "hf_maskllm") -> tuple[Path, Path]:
    """A dense bf16 checkpoint of ``build()`` (sharded when ``shard``) and a magnitude mask saved for it."""
    model = build().to(torch.bfloat16)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / "dense", **kwargs)
    get_mask_model(model, MaskConfig(prior="magnitude")).save_pretrained(tmp_path / "mask", format=fmt)
    return tmp_path / "dense", tmp_path / "mask"


def _in_memory(dense: Path, mask: Path, out: Path, config: MaskConfig | None = None) -> None:
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    MaskModel.from_pretrained(model, mask, config=config).save_pretrained(out, merged=True)


@pytest.mark.parametrize(
    ("build", "fmt"),
    [(tiny_llama, "hf_maskllm"), (tiny_llama_tied, "npz"), (tiny_gpt2, "npz"), (tiny_gemma, "hf_maskllm")],
    ids=["llama-folder", "llama-tied-npz", "gpt2-conv1d-npz", "gemma-folder"],
)
def test_streamed_merge_equals_the_in_memory_merge(tmp_path, build, fmt):
    dense, mask = _setup(tmp_path, build, fmt=fmt)
    assert len(list(dense.glob("*.safetensors"))) > 2  # really sharded
    names = merge_checkpoint(dense, mask, tmp_path / "streamed", max_shard_size="30KB", progress=False)
    _in_memory(dense, mask, tmp_path / "in_memory")
    for file in (tmp_path / "streamed").glob("*.safetensors"):  # a file over the limit holds one tensor
        assert file.stat().st_size <= 30_000 + 2_000 or len(load_file(file)) == 1, file.name

    streamed, in_memory = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "in_memory")
    assert set(streamed) == set(in_memory)
    for key, tensor in in_memory.items():
        assert torch.equal(streamed[key], tensor), key
        assert (
            streamed[key].dtype == tensor.dtype == (torch.uint8 if key.endswith(".meta") else torch.bfloat16)
        )
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert config == json.loads((tmp_path / "in_memory" / "config.json").read_text())
    assert config["quantization_config"]["modules"] == names
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(streamed)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in streamed.values())

    a = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "in_memory").eval()
    assert sum(isinstance(mod, SparseLinear) for mod in a.modules()) == len(names) > 0
    inputs = model_inputs(a)
    with torch.no_grad():
        assert torch.equal(a(**inputs).logits, b(**inputs).logits)


def test_single_file_checkpoint_and_copied_files(tmp_path):
    dense, mask = _setup(tmp_path, tiny_llama, shard=None)
    (dense / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (dense / "notes.txt").write_text("not a file of the model")
    merge_checkpoint(dense, mask, tmp_path / "out", progress=False)
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert files == {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "README.md",
    }
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    card = (tmp_path / "out" / "README.md").read_text()
    assert "2:4 sparse model" in card and "prior: magnitude" in card


def test_a_second_merge_replaces_the_folder_and_its_stale_shards(tmp_path):
    dense, mask = _setup(tmp_path, tiny_llama)
    out = tmp_path / "out"
    merge_checkpoint(dense, mask, out, progress=False)
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    dense_single, _ = _setup(tmp_path / "single", tiny_llama, shard=None)
    merge_checkpoint(dense_single, mask, out, progress=False)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_a_failure_leaves_the_previous_save_untouched(tmp_path):
    dense, mask = _setup(tmp_path, tiny_llama)
    out = tmp_path / "out"
    merge_checkpoint(dense, mask, out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    index = json.loads((dense / "model.safetensors.index.json").read_text())
    key = "model.layers.1.mlp.down_proj.weight"
    shard = dense / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key][0, :] = float("nan")  # a late layer: earlier shards are already written when it fails
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="NaN or inf"):
        merge_checkpoint(dense, mask, out, max_shard_size="30KB", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob("*.tmp"))


def test_pickled_weights_are_refused_and_never_loaded(tmp_path):
    model = tiny_llama()
    model.config.save_pretrained(tmp_path / "dense")
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (ran, "unpickled"))

    (tmp_path / "dense" / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    get_mask_model(model, MaskConfig(prior="magnitude")).save_pretrained(tmp_path / "mask")
    with pytest.raises(CheckpointError, match="never unpickles"):
        merge_checkpoint(tmp_path / "dense", tmp_path / "mask", tmp_path / "out", progress=False)
    assert not ran.exists() and not (tmp_path / "out").exists()


def test_refusals_name_the_problem(tmp_path):
    dense, mask = _setup(tmp_path, tiny_llama, shard=None)
    with pytest.raises(CheckpointError, match="dense checkpoint's folder"):
        merge_checkpoint(dense, mask, dense, progress=False)
    with pytest.raises(CheckpointError, match="neither an existing folder"):
        merge_checkpoint(tmp_path / "nowhere", mask, tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="Drop config="):
        merge_checkpoint(dense, mask, tmp_path / "out", config=MaskConfig(), progress=False)

    # a mask learned on another model (other shapes)
    other, other_mask = _setup(tmp_path / "other", lambda: tiny_llama(intermediate=192), shard=None)
    with pytest.raises(MaskFileError, match="belongs to another model"):
        merge_checkpoint(dense, other_mask, tmp_path / "out", progress=False)

    # the checkpoint names a masked weight otherwise than the model does
    tensors = load_file(dense / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.kernel"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, dense / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stores no tensor 'model.layers.0.self_attn.q_proj.weight'"):
        merge_checkpoint(dense, mask, tmp_path / "out", progress=False)

    # config.json disagrees with the weights
    dense2, _ = _setup(tmp_path / "two", tiny_llama, shard=None)
    (dense2 / "config.json").write_text((other / "config.json").read_text())
    with pytest.raises(CheckpointError, match="but config.json gives"):
        merge_checkpoint(dense2, other_mask, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_reference_file_config_says_which_layers_stay_dense(tmp_path):
    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "dense")
    config = MaskConfig(prior="magnitude", exclude_modules=["down_proj"])
    get_mask_model(model, config).save_pretrained(tmp_path / "npz", format="npz")
    with pytest.raises(MaskFileError, match="exclude_modules"):  # the default config masks down_proj too
        merge_checkpoint(tmp_path / "dense", tmp_path / "npz", tmp_path / "out", progress=False)
    names = merge_checkpoint(
        tmp_path / "dense", tmp_path / "npz", tmp_path / "out", config=MaskConfig(exclude_modules=["down_proj"]),
        progress=False,
    )  # fmt: skip
    assert names and not any("down_proj" in name for name in names)
    tensors = _tensors(tmp_path / "out")
    assert "model.layers.0.mlp.down_proj.weight" in tensors and "model.layers.0.mlp.up_proj.values" in tensors


def test_the_merge_command(tmp_path, capsys):
    from hf_maskllm.cli import main

    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "dense")
    config = MaskConfig(prior="magnitude", exclude_modules=["down_proj"])
    get_mask_model(model, config).save_pretrained(tmp_path / "npz", format="npz")
    args = ["merge", "--model", str(tmp_path / "dense"), "--mask", str(tmp_path / "npz"), "--output"]
    with pytest.raises(MaskFileError, match="exclude_modules"):
        main([*args, str(tmp_path / "out")])
    main([*args, str(tmp_path / "out"), "--exclude-modules", "down_proj"])
    assert "12 layers stored compressed" in capsys.readouterr().out
    merge_checkpoint(
        tmp_path / "dense", tmp_path / "npz", tmp_path / "api", config=MaskConfig(exclude_modules=["down_proj"]),
        progress=False,
    )  # fmt: skip
    cli, api = _tensors(tmp_path / "out"), _tensors(tmp_path / "api")
    assert set(cli) == set(api) and all(torch.equal(cli[k], api[k]) for k in api)
