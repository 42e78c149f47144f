"""Nothing is lost when a process dies: saves are atomic, and a killed training run resumes exactly.

- A child process saves a mask folder, a merged compressed checkpoint and a ``MaskConfig`` over and over;
  the test kills it with SIGKILL at seeded random moments, many times. After every kill each target is a
  complete save, the last one finished or the one in flight, and loads into exactly what was saved.
- A seeded Trainer run is killed with SIGKILL mid-training; a new process resumes it from its last
  checkpoint and ends with exactly the hard masks and logits of an uninterrupted run.

Children are forked from a ``multiprocessing`` forkserver that has imported torch, transformers and
hf_maskllm once, so each start costs milliseconds rather than seconds.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread: autouse)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging as transformers_logging

from hf_maskllm import MaskAnnealCallback, MaskConfig, MaskModel, SparseLinear, get_mask_model
from hf_maskllm.adapters.config import CONFIG_NAME
from hf_maskllm.adapters.mask_file import LOGITS_NAME, MASKS_NAME

KILLS = 80
SEED = 0
TARGETS = ("mask", "ckpt", "config")
IDS = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def forkserver() -> multiprocessing.context.BaseContext:
    """A forkserver that has imported this module (and so torch, transformers, hf_maskllm) once."""
    from multiprocessing import forkserver as server

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["test_crash_safety"])
    # Python < 3.12 does not give the server our sys.path, so it could not preload this module: pass it on.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), old]))
    try:
        server.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


# ---------------------------------------------------------------------------------------------- what save i holds
def base_model() -> torch.nn.Module:
    return tiny_llama(hidden=16, intermediate=32)


def mask_model(i: int, base: torch.nn.Module | None = None) -> MaskModel:
    """The mask model of save ``i``: logits seeded by ``i``, the index in its summary and config."""
    mm = get_mask_model(base_model() if base is None else base, MaskConfig(seed=0))
    generator = torch.Generator().manual_seed(1000 + i)
    with torch.no_grad():
        for layer in mm.masked_layers().values():
            layer.mask_logits.copy_(torch.randn(layer.mask_logits.shape, generator=generator))
    mm.training_summary = {"save": i}
    mm.base_model.config.hf_maskllm_test_save = i  # travels in the compressed checkpoint's config.json
    return mm


def save_all(root: Path, i: int, done: Any = None) -> None:
    """Save number ``i`` of each target; even saves carry logits, odd compressed saves are sharded."""
    mm = mask_model(i)
    mm.save_pretrained(root / "mask", save_logits=i % 2 == 0)
    if done is not None:
        done[0] = i
    mm.save_pretrained(root / "ckpt", merged=True, max_shard_size="4KB" if i % 2 else "2GB")
    if done is not None:
        done[1] = i
    MaskConfig(seed=i, sparse_reg=i * 1e-6).save_pretrained(root / "config")
    if done is not None:
        done[2] = i


def save_forever(root: str, start: int, done: Any) -> None:
    """Child process: save ``start``, ``start + 1``, ... until killed."""
    torch.set_num_threads(1)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    done[3] = 1  # ready
    i = start
    while True:
        save_all(Path(root), i, done)
        i += 1


# ---------------------------------------------------------------------------------------------- checks
def check_mask(folder: Path, allowed: set[int]) -> int:
    loaded = MaskModel.from_pretrained(base_model(), folder)
    i = loaded.training_summary["save"]
    assert i in allowed, (i, allowed)
    expected = mask_model(i)
    for name, mask in expected.hard_masks().items():
        assert torch.equal(loaded.hard_masks()[name], mask), name
    assert (folder / LOGITS_NAME).exists() == (i % 2 == 0)  # never stale logits of another save
    if i % 2 == 0:
        for name, layer in expected.masked_layers().items():
            assert torch.equal(loaded.masked_layers()[name].mask_logits, layer.mask_logits.detach()), name
    return i


def check_checkpoint(folder: Path, allowed: set[int]) -> int:
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    i = loaded.config.hf_maskllm_test_save
    assert i in allowed, (i, allowed)
    assert sum(isinstance(mod, SparseLinear) for mod in loaded.modules()) == 14
    shards = sorted(p.name for p in folder.glob("model*.safetensors"))
    assert (len(shards) > 1) == (i % 2 == 1), shards  # no stale shard of another save
    merged = mask_model(i).merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, merged(IDS).logits, rtol=0, atol=0)
    return i


def check_config(folder: Path, allowed: set[int]) -> int:
    config = MaskConfig.from_pretrained(folder)
    assert config.seed in allowed, (config.seed, allowed)
    assert config.to_dict() == MaskConfig(seed=config.seed, sparse_reg=config.seed * 1e-6).to_dict()
    return config.seed


CHECKS = {"mask": check_mask, "ckpt": check_checkpoint, "config": check_config}


def temporaries(root: Path) -> list[str]:
    """Leftovers of interrupted saves: hidden temporaries beside or inside the targets."""
    found = [p.name for p in root.iterdir() if p.name.startswith(".")]
    for target in root.iterdir():
        if target.is_dir() and not target.name.startswith("."):
            found += [f"{target.name}/{p.name}" for p in target.iterdir() if p.name.startswith(".")]
    return found


# ---------------------------------------------------------------------------------------------- the tests
def test_sigkill_during_saves_never_loses_the_previous_save(tmp_path, forkserver):
    """SIGKILL at random moments of repeated saves: every target always loads, complete, as saved."""
    transformers_logging.disable_progress_bar()
    rng = random.Random(SEED)
    root = tmp_path
    save_all(root, 0)
    start = time.perf_counter()
    save_all(root, 1)
    cycle = time.perf_counter() - start  # one round of the three saves, on this machine, now
    last = dict.fromkeys(TARGETS, 1)  # the save each target held at the last check
    mid_save = 0
    for _ in range(KILLS):
        first = max(last.values()) + 1
        done = forkserver.Array("q", [last["mask"], last["ckpt"], last["config"], 0], lock=False)
        child = forkserver.Process(target=save_forever, args=(str(root), first, done), daemon=True)
        child.start()
        while not done[3] and child.is_alive():
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 3 * cycle))  # kills land anywhere in the first three rounds
        child.kill()
        child.join()
        assert child.exitcode == -signal.SIGKILL
        mid_save += bool(temporaries(root))
        for k, target in enumerate(TARGETS):
            # Finished saves are reported; the one in flight may have completed just before the kill.
            allowed = {done[k], done[k] + 1} if done[k] >= first else {last[target], first}
            last[target] = CHECKS[target](root / target, allowed)
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted(TARGETS)
    assert max(last.values()) > KILLS // 4  # the children did save, many times
    assert mid_save >= KILLS // 4, mid_save  # many kills interrupted a save half way
    save_all(root, max(last.values()) + 1)  # the next save removes what killed saves left behind
    assert temporaries(root) == []


def test_save_keeps_the_users_other_files_and_drops_stale_ones(tmp_path):
    folder = tmp_path / "mask"
    mask_model(0).save_pretrained(folder, save_logits=True)
    (folder / "notes.txt").write_text("mine")
    mask_model(1).save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [CONFIG_NAME, MASKS_NAME, "README.md", "notes.txt"]
    )
    assert (folder / "notes.txt").read_text() == "mine"
    assert check_mask(folder, {1}) == 1


def test_folder_with_subfolders_is_replaced_file_by_file(tmp_path):
    """A sub-folder cannot be carried into an atomically swapped folder: files are replaced one by one instead,
    the config removed first and written last, and the sub-folder stays."""
    folder = tmp_path / "ckpt"
    mask_model(0).save_pretrained(folder, merged=True, max_shard_size="4KB")
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("mine")
    mask_model(2).save_pretrained(folder, merged=True)
    assert (folder / "runs" / "log.txt").read_text() == "mine"
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]  # stale shards removed
    assert check_checkpoint(folder, {2}) == 2
    assert temporaries(tmp_path) == []


def test_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path, forkserver):
    host = socket.gethostname()
    child = forkserver.Process(target=time.sleep, args=(0,))
    child.start()
    child.join()  # a pid that no longer runs
    dead = tmp_path / f".{CONFIG_NAME}.tmp-{host}-{child.pid}-abc.tmp"
    live = tmp_path / f".{CONFIG_NAME}.tmp-{host}-{os.getppid()}-abc.tmp"
    other_host = tmp_path / f".{CONFIG_NAME}.tmp-elsewhere-{child.pid}-abc.tmp"
    for path in (dead, live, other_host):
        path.write_text("partial")
    MaskConfig().save_pretrained(tmp_path)
    assert not dead.exists() and live.exists() and other_host.exists()


# ---------------------------------------------------------------------------------------------- training
class KillAtStep(TrainerCallback):
    """SIGKILL this process at the end of optimizer step ``step``: no handler, no cleanup, like a crash."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def train(root: str, kill_at: int | None, resume: bool) -> None:
    """Child process: the seeded run of the resume test in adapters/test_callback.py, saving every 3 steps."""
    from trainer_helpers import TokenDataset, random_tokens, training_args

    torch.set_num_threads(1)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    folder = Path(root)
    mm = get_mask_model(tiny_llama(), MaskConfig(seed=0))
    args = training_args(
        folder,
        max_steps=8,
        lr_scheduler_type="linear",
        weight_decay=0.1,
        save_strategy="steps",
        save_steps=3,
        logging_steps=100,
    )
    callbacks = [MaskAnnealCallback()] + ([KillAtStep(kill_at)] if kill_at else [])
    trainer = Trainer(
        model=mm, args=args, train_dataset=TokenDataset(random_tokens(64, 5)), callbacks=callbacks
    )
    checkpoint = get_last_checkpoint(args.output_dir) if resume else None
    assert (checkpoint is not None) == resume
    trainer.train(resume_from_checkpoint=checkpoint)
    mm.training_summary = {"resumed_from": Path(checkpoint).name if checkpoint else None}
    mm.save_pretrained(folder / "final", save_logits=True)


@pytest.mark.slow
def test_training_killed_with_sigkill_resumes_to_the_same_masks(tmp_path, forkserver):
    def run(folder: Path, kill_at: int | None, resume: bool) -> int:
        child = forkserver.Process(target=train, args=(str(folder), kill_at, resume))
        child.start()
        child.join(timeout=300)
        return child.exitcode

    assert run(tmp_path / "full", None, False) == 0
    assert run(tmp_path / "crash", 7, False) == -signal.SIGKILL  # after checkpoint-6, before the end
    assert sorted(p.name for p in (tmp_path / "crash" / "out").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    assert not (tmp_path / "crash" / "final").exists()
    assert run(tmp_path / "crash", None, True) == 0  # a new process, from the last checkpoint
    resumed = MaskModel.from_pretrained(tiny_llama(), tmp_path / "crash" / "final")
    full = MaskModel.from_pretrained(tiny_llama(), tmp_path / "full" / "final")
    assert resumed.training_summary == {"resumed_from": "checkpoint-6"}
    for name, mask in full.hard_masks().items():
        assert torch.equal(resumed.hard_masks()[name], mask), name
    full_logits = load_file(tmp_path / "full" / "final" / LOGITS_NAME)
    resumed_logits = load_file(tmp_path / "crash" / "final" / LOGITS_NAME)
    assert full_logits.keys() == resumed_logits.keys()
    for key, value in full_logits.items():
        assert torch.equal(resumed_logits[key], value), key
    # The last steps changed the masks, so the equality above is not trivial.
    checkpoint = load_file(tmp_path / "full" / "out" / "checkpoint-6" / "model.safetensors")
    key = next(k for k in checkpoint if "logits" in k)  # base_model.<layer>.logits.<mask name>
    layer = re.sub(r"\.(mask_)?logits(\.[^.]+)?$", "", key.removeprefix("base_model."))
    assert not torch.equal(checkpoint[key], full_logits[f"{layer}.logits"])
