"""A compressed N:M model stays alive: direct training with Trainer, save/load/re-save, dequantize,
mask-keeping layers from a MaskModel merge, and one-shot reconstruction for a fixed mask."""

from __future__ import annotations

import json

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)
from safetensors.torch import load_file
from test_sparse_checkpoint import merged_model
from test_training import TokenDataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_maskllm import MaskConfig, check_nm, get_mask_model
from hf_maskllm.errors import CheckpointError, ConfigError
from hf_maskllm.modules import dense_weight_view
from hf_maskllm.sparse import SparseLinear, reconstruct, save_compressed, to_sparse_layers

SEQ = 16


def tokens(num: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (num, SEQ), generator=torch.Generator().manual_seed(seed))


def args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def values_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: mod.values.detach().clone() for n, mod in model.named_modules() if isinstance(mod, SparseLinear)
    }


class NMEveryStep(TrainerCallback):
    """Records, after every optimizer step, the N:M violations of the dense weights the model computes with."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.violations = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.violations.append(len(check_nm(self.model, 2, 4).violations))


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_trainer_trains_a_loaded_compressed_model_and_it_stays_nm(kind, tmp_path):
    save_compressed(merged_model(kind), tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    before = values_of(model)
    metas = {n: mod.meta.clone() for n, mod in model.named_modules() if isinstance(mod, SparseLinear)}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dense_equivalent = sum(
        mod.in_features * mod.out_features - mod.values.numel()
        for mod in model.modules()
        if isinstance(mod, SparseLinear)
    )
    assert dense_equivalent > 0 and trainable > 0  # the pruned half is not a parameter at all
    recorder = NMEveryStep(model)
    trainer = Trainer(
        model=model, args=args(tmp_path), train_dataset=TokenDataset(tokens(32, 0)), callbacks=[recorder]
    )
    trainer.train()
    assert recorder.violations == [0, 0, 0, 0]
    after = values_of(model)
    assert all(not torch.equal(after[n], before[n]) for n in before)  # every compressed layer learned
    assert all(
        torch.equal(mod.meta, metas[n]) for n, mod in model.named_modules() if isinstance(mod, SparseLinear)
    )
    # save, load, re-save: the trained model round-trips exactly
    model.save_pretrained(tmp_path / "t1")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "t1")
    again.save_pretrained(tmp_path / "t2")
    first, second = (
        load_file(tmp_path / "t1" / "model.safetensors"),
        load_file(tmp_path / "t2" / "model.safetensors"),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    ids = tokens(2, 9)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


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


def test_dequantize_gives_the_dense_model_with_zeros(tmp_path):
    reference = merged_model("gpt2")
    save_compressed(reference, tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    dense = model.dequantize()
    assert not any(isinstance(mod, SparseLinear) for mod in dense.modules())
    assert (
        getattr(dense, "hf_quantizer", None) is None and "quantization_config" not in dense.config.to_dict()
    )
    ref_state, state = reference.state_dict(), dense.state_dict()
    assert ref_state.keys() == state.keys() and all(torch.equal(ref_state[k], state[k]) for k in ref_state)
    dense.save_pretrained(tmp_path / "d")  # the plain transformers save again
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())


def test_save_pretrained_refuses_what_it_cannot_write(tmp_path):
    save_compressed(merged_model("llama"), tmp_path / "c")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    with pytest.raises(CheckpointError, match="safe_serialization"):
        model.save_pretrained(tmp_path / "x", safe_serialization=False)
    with pytest.raises(CheckpointError, match="state_dict"):
        model.save_pretrained(tmp_path / "x", state_dict={"x": torch.zeros(1)})


def test_mask_model_merge_to_mask_keeping_layers_trains_and_saves(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig(n=2, m=4, prior="magnitude"))
    names = list(mm.masked_names)
    masks = mm.hard_masks()
    model = to_sparse_layers(mm.merge_and_unload(), 2, 4, modules=names)
    assert all(isinstance(model.get_submodule(n), SparseLinear) for n in names)
    recorder = NMEveryStep(model)
    Trainer(
        model=model,
        args=args(tmp_path, max_steps=3),
        train_dataset=TokenDataset(tokens(16, 2)),
        callbacks=[recorder],
    ).train()
    assert recorder.violations == [0, 0, 0]
    assert all(
        torch.equal(model.get_submodule(n).keep_mask() | ~masks[n], torch.ones_like(masks[n])) for n in names
    )
    model.save_pretrained(tmp_path / "s")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    assert sorted(n for n, mod in loaded.named_modules() if isinstance(mod, SparseLinear)) == sorted(names)


# ------------------------------------------------------------------------------------------ reconstruction
def layer_inputs(model, names: list[str], calibration) -> dict[str, torch.Tensor]:
    """The inputs of each named layer when ``model`` runs on ``calibration``."""
    inputs, handles = {}, []

    def record(name: str):
        def hook(module, args, output) -> None:  # returns None: the output is left alone
            inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_hook(record(name)))
    with torch.no_grad():
        model(calibration)
    for h in handles:
        h.remove()
    return inputs


def effective_weights(model, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, SparseLinear):
            out[name] = module.dense_weight().detach().clone()
        else:  # MaskedLinear in eval mode: W * hard mask
            out[name] = (dense_weight_view(module.base_layer) * module.hard_mask()).detach().clone()
    return out


def assert_reconstruction_helps(model, dense, names, calibration, mask_only, logits_mask_only) -> None:
    """Block 0 sees the same inputs in every variant (the dense model's, which SparseGPT's statistics of
    block 0 are built from): there the updated weights reproduce each dense layer's output better than
    the mask alone. End to end, the logits move closer to the dense model's."""
    dense_weights = effective_dense(dense, names)
    block0 = [n for n in names if n.startswith("model.layers.0.")]
    inputs = layer_inputs(dense, block0, calibration)
    updated = effective_weights(model, block0)
    for name in block0:
        x = inputs[name]
        err_mask = float(((x @ (dense_weights[name] - mask_only[name]).t()) ** 2).sum())
        err_rec = float(((x @ (dense_weights[name] - updated[name]).t()) ** 2).sum())
        assert err_rec < 0.9 * err_mask, (name, err_mask, err_rec)
    with torch.no_grad():
        target = dense(calibration).logits
        assert float(((model(calibration).logits - target) ** 2).mean()) < float(
            ((logits_mask_only - target) ** 2).mean()
        )


def effective_dense(model, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: dense_weight_view(model.get_submodule(n)).detach().clone() for n in names}


def test_reconstruct_keeps_the_mask_and_lowers_layer_error(tmp_path):
    dense = tiny_llama()
    calibration = tokens(8, 3)
    mm = get_mask_model(tiny_llama(), MaskConfig(n=2, m=4, prior="magnitude")).eval()
    names = list(mm.masked_names)
    masks = mm.hard_masks()
    mask_only = effective_weights(mm.base_model, names)
    with torch.no_grad():
        logits_mask_only = mm.base_model(calibration).logits
    updated = reconstruct(mm, calibration, progress=False)
    assert sorted(updated) == sorted(names)
    assert all(torch.equal(masks[n], m) for n, m in mm.hard_masks().items())  # the mask, bit for bit
    assert_reconstruction_helps(mm.base_model, dense, names, calibration, mask_only, logits_mask_only)
    # pruned positions of the base weights are untouched, so mask learning can go on
    dense_weights = effective_dense(dense, names)
    for name, layer in mm.masked_layers().items():
        assert torch.equal(
            dense_weight_view(layer.base_layer)[~masks[name]], dense_weights[name][~masks[name]]
        )

    # the same on a loaded compressed model (with its dense source): meta unchanged, values updated, N:M
    merged = get_mask_model(tiny_llama(), MaskConfig(n=2, m=4, prior="magnitude")).merge_and_unload()
    save_compressed(merged, tmp_path / "c")
    sparse = AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    metas = {n: mod.meta.clone() for n, mod in sparse.named_modules() if isinstance(mod, SparseLinear)}
    mask_only = effective_weights(sparse, names)
    with torch.no_grad():
        logits_mask_only = sparse(calibration).logits
    with pytest.raises(ConfigError, match="dense_model"):
        reconstruct(sparse, calibration, progress=False)
    reconstruct(sparse, calibration, dense_model=dense, progress=False)
    assert all(
        torch.equal(mod.meta, metas[n]) for n, mod in sparse.named_modules() if isinstance(mod, SparseLinear)
    )
    assert_reconstruction_helps(sparse, dense, names, calibration, mask_only, logits_mask_only)
    assert check_nm(sparse, 2, 4).ok


def test_reconstruct_needs_masks_for_a_plain_model():
    with pytest.raises(ConfigError, match="pass masks"):
        reconstruct(tiny_llama(), tokens(2, 0), progress=False)


def test_to_sparse_layers_refuses_layers_that_are_not_nm():
    from hf_maskllm.errors import NMViolationError

    with pytest.raises(NMViolationError, match="not 2:4 sparse"):
        to_sparse_layers(tiny_llama(), 2, 4, modules=["model.layers.0.mlp.up_proj"])
