"""Distributed training through a plain Trainer (torchrun, gloo on CPU): DDP replicas agree; FSDP2 shards the logits.

The save recipe of the main process (a gathered state dict) is checked in one process: adapters/test_save_and_load.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

HERE = Path(__file__).parent


def _ddp(out: Path, *args: str) -> list[dict[str, torch.Tensor]]:
    """``tests/ddp_train.py`` in 2 CPU processes (torchrun, gloo); each rank's saved tensors."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    # --standalone: torchrun picks a free local port for its own rendezvous
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(HERE / "ddp_train.py"), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    ranks = [load_file(out / f"rank{r}.safetensors") for r in (0, 1)]
    assert int(ranks[0]["world_size"]) == 2
    assert ranks[0].keys() == ranks[1].keys()
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    return ranks


@pytest.mark.slow
def test_ddp_ranks_sample_their_own_noise_and_train_the_active_named_mask_only(tmp_path):
    """DDP replicas agree on every mask, each rank samples its own masks, and only the active mask trains.

    A single mask under DDP (examples/accelerate_ddp.yaml) is covered by the tests of the ``ddp_run`` below."""
    ranks = _ddp(tmp_path, "named")  # the replicas agree on both masks
    probes = [load_file(tmp_path / f"probe{r}.safetensors")["noise_probe"] for r in (0, 1)]
    assert not torch.equal(probes[0], probes[1])  # each rank samples its own masks
    assert bytes(ranks[0]["active"].tolist()) == b"task"
    from models import tiny_llama

    from hf_maskllm import MaskConfig, get_mask_model

    init = get_mask_model(tiny_llama(seed=0), MaskConfig(prior="magnitude"))
    init.add_mask("task", MaskConfig(prior="magnitude", prior_strength=2.0))
    for name, layer in init.masked_layers().items():
        # the inactive default mask is bit-identical to its initialisation
        assert torch.equal(layer.mask_logits.detach(), ranks[0][f"default.{name}.logits"]), name
        assert torch.equal(init.hard_masks()[name].to(torch.uint8), ranks[0][f"default.{name}.mask"]), name
        # the active task mask trained
        assert not torch.equal(layer.get_logits("task").detach(), ranks[0][f"{name}.logits"]), name


# ---------------------------------------------------------------------------------------------- FSDP
def _launch(out: Path, *args: str, config: str | None = None) -> None:
    """``tests/fsdp_train.py`` in 2 CPU processes (gloo): with torchrun, or with ``accelerate launch --config_file
    examples/<config>``; see that script for what it writes."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    if config is None:  # --standalone: torchrun picks a free port for its rendezvous
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config_file = HERE.parent / "examples" / config
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
        cmd += ["--num_processes", "2", "--main_process_port", str(port)]
    result = subprocess.run(
        [*cmd, str(HERE / "fsdp_train.py"), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata (the header's key order varies from save to save)."""
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _stats(evidence: dict) -> list[tuple[int, float, float]]:
    """``(step, mask_flip_rate, mask_max_prob)`` of every Trainer log record that has them."""
    return [
        (r["step"], r.get("mask_flip_rate", -1.0), r["mask_max_prob"])
        for r in evidence["log_history"]
        if "mask_max_prob" in r
    ]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """One FSDP2 run at the default settings (bf16 logits, MaskAdamW) under examples/accelerate_fsdp.yaml."""
    out = tmp_path_factory.mktemp("fsdp")
    _launch(out, config="accelerate_fsdp.yaml")
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """The same run with DDP under examples/accelerate_ddp.yaml."""
    out = tmp_path_factory.mktemp("ddp")
    _launch(out, "--ddp", config="accelerate_ddp.yaml")
    return out


@pytest.mark.slow
def test_fsdp_shards_logits_with_their_layer_and_saves_the_full_mask(fsdp_run, tmp_path):
    """FSDP2 as examples/accelerate_fsdp.yaml configures it (accelerate's plugin), 2 CPU processes."""
    from models import tiny_llama

    from hf_maskllm import MaskConfig, MaskModel, get_mask_model
    from hf_maskllm.patterns import candidate_patterns

    evidence = [json.loads((fsdp_run / f"evidence{r}.json").read_text()) for r in (0, 1)]
    init = get_mask_model(tiny_llama(seed=0), MaskConfig(prior="magnitude"))
    layers = init.masked_layers()
    for ev in evidence:
        assert (ev["distributed_type"], ev["world_size"], ev["wrapped"]) == (
            "DistributedType.FSDP",
            2,
            "FSDPMaskModel",
        )
        # (a) between steps each process holds half of every layer's groups (rows) ...
        for name, layer in layers.items():
            groups, candidates = layer.mask_logits.shape
            assert ev["between_steps"][name] == {
                "type": "DTensor",
                "placements": ["S(0)"],
                "global": [groups, candidates],
                "local": [groups // 2, candidates],
            }
        # ... and while a decoder layer runs, its logits are gathered with it; the other layer's stay sharded
        assert set(ev["during_forward"]) == set(layers)
        for name, seen in ev["during_forward"].items():
            for other, where in seen.items():
                same_unit = other.split(".")[2] == name.split(".")[2]  # model.layers.<i>....
                assert (where["type"] != "DTensor") == same_unit, (name, other, where)
                assert where["local"][0] == where["global"][0] // (1 if same_unit else 2)
    # the mask statistics are summed over the shards: every process logs the same values
    assert _stats(evidence[0]) == _stats(evidence[1]) and len(_stats(evidence[0])) >= 2

    # (b) the mask saved from the gathered state dict loads in one process: its logits and hard masks are the
    # trained ones, as every process gathers them shard by shard
    full = [load_file(fsdp_run / f"full{r}.safetensors") for r in (0, 1)]
    saved = MaskModel.from_pretrained(tiny_llama(seed=0), fsdp_run / "mask")
    saved_masks = saved.hard_masks()
    candidates = candidate_patterns(2, 4, dtype=torch.bool)
    for name, layer in layers.items():
        assert torch.equal(full[0][name], full[1][name])
        assert not torch.equal(full[0][name], layer.mask_logits.detach())  # trained
        assert torch.equal(saved.masked_layers()[name].mask_logits.detach(), full[0][name])
        expected = candidates[full[0][name].argmax(dim=-1)].reshape(layer.out_features, layer.in_features)
        assert torch.equal(saved_masks[name], expected)
    last = evidence[0]["log_history"][-1]  # statistics of the final logits, at the final kappa
    groups = sum(t.shape[0] for t in full[0].values())
    expected_prob = (
        sum(float((last["kappa"] * t.float()).softmax(-1).amax(-1).sum()) for t in full[0].values()) / groups
    )
    assert last["mask_max_prob"] == pytest.approx(expected_prob, abs=1e-5)

    # (c) the mask saved before the first step is the one a single process saves for the same config and prior
    init.save_pretrained(tmp_path / "single", save_logits=True)
    folders = (fsdp_run / "mask_step0", tmp_path / "single")
    assert (folders[0] / "mask_config.json").read_text() == (folders[1] / "mask_config.json").read_text()
    for file in ("mask_model.safetensors", "mask_logits.safetensors"):
        (fsdp_saved, metadata), (single_saved, single_metadata) = (_read(folder / file) for folder in folders)
        assert metadata == single_metadata and fsdp_saved.keys() == single_saved.keys()
        assert all(torch.equal(fsdp_saved[k], single_saved[k]) for k in single_saved), file


@pytest.mark.slow
def test_fsdp_learns_the_same_mask_as_ddp(ddp_run, tmp_path):
    """Same data, seeds and per-rank noise, default settings (bf16 logits, MaskAdamW): FSDP2 set up through
    ``TrainingArguments(fsdp=True, fsdp_config=...)`` under torchrun ends with the same logits as DDP under
    examples/accelerate_ddp.yaml, bit for bit."""
    _launch(tmp_path / "fsdp")
    runs = {"fsdp": tmp_path / "fsdp", "ddp": ddp_run}
    evidence = {mode: json.loads((folder / "evidence0.json").read_text()) for mode, folder in runs.items()}
    # the torchrun run really sharded (accelerate falls back to DDP on CPU unless told otherwise)
    assert (evidence["fsdp"]["distributed_type"], evidence["fsdp"]["world_size"]) == (
        "DistributedType.FSDP",
        2,
    )
    assert all(where["type"] == "DTensor" for where in evidence["fsdp"]["between_steps"].values())
    assert (evidence["ddp"]["distributed_type"], evidence["ddp"]["world_size"]) == (
        "DistributedType.MULTI_CPU",
        2,
    )
    logits = {mode: load_file(folder / "mask" / "mask_logits.safetensors") for mode, folder in runs.items()}
    initial = load_file(ddp_run / "mask_step0" / "mask_logits.safetensors")
    assert logits["fsdp"].keys() == logits["ddp"].keys() == initial.keys()
    for name in initial:
        assert torch.equal(logits["fsdp"][name], logits["ddp"][name]), name
        assert not torch.equal(logits["ddp"][name], initial[name])
    masks = {mode: load_file(folder / "mask" / "mask_model.safetensors") for mode, folder in runs.items()}
    assert all(torch.equal(masks["fsdp"][k], masks["ddp"][k]) for k in masks["ddp"])
    stats = [_stats(evidence[mode]) for mode in runs]
    assert [s[0] for s in stats[0]] == [s[0] for s in stats[1]] and len(stats[0]) >= 2
    for fsdp_record, ddp_record in zip(*stats):
        assert fsdp_record == pytest.approx(ddp_record, rel=1e-6)


@pytest.mark.slow
def test_ddp_replicas_stay_identical_with_mask_adamw(ddp_run):
    """Default settings (bf16 logits, MaskAdamW) under examples/accelerate_ddp.yaml: replicas stay identical."""
    replicas = [load_file(ddp_run / f"full{r}.safetensors") for r in (0, 1)]
    initial = load_file(ddp_run / "mask_step0" / "mask_logits.safetensors")
    assert initial.keys() == {f"{name}.logits" for name in replicas[0]}
    for name in replicas[0]:
        assert not torch.equal(replicas[0][name], initial[f"{name}.logits"])
        assert torch.equal(replicas[0][name], replicas[1][name]), name
