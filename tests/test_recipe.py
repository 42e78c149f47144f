"""The documented Trainer path is the recipe, departures are said out loud, and the run ends in eval mode."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from test_training import TokenDataset, cyclic_language, training_args
from transformers import Trainer, TrainerCallback

from hf_maskllm import MaskAdamW, MaskAnnealCallback, MaskConfig, MaskTrainingArguments, get_mask_model
from hf_maskllm.errors import ConfigError
from hf_maskllm.learn import learn_mask
from hf_maskllm.memory import training_state_bytes

STEPS = 4


class Recorder(TrainerCallback):
    """Per optimizer step: the learning rate the scheduler set and the tau / kappa of the masked layers."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float]] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        layer = next(iter(model.masked_layers().values()))
        self.steps.append((optimizer.param_groups[0]["lr"], layer.tau, layer.kappa))


def _groups(trainer: Trainer) -> list[dict]:
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return [
        {k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])} for g in inner.param_groups
    ]


def _no_departure_warning(run) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    assert not [w for w in caught if "departs from the MaskLLM recipe" in str(w.message)]


def test_readme_snippet_and_learn_mask_run_the_same_recipe(tmp_path):
    ids = cyclic_language(16, seed=3)
    # learn_mask, the recipe
    a = get_mask_model(tiny_llama(), MaskConfig())
    rec_a = Recorder()
    holder = {}
    _no_departure_warning(
        lambda: holder.setdefault(
            "trainer",
            learn_mask(a, TokenDataset(ids), max_steps=STEPS, output_dir=str(tmp_path / "a"), compile_sampling=False,
                       disable_tqdm=True, callbacks=[rec_a]),
        )
    )  # fmt: skip
    trainer_a = holder["trainer"]
    # the README's snippet: MaskTrainingArguments + MaskAdamW + MaskAnnealCallback on a plain Trainer
    b = get_mask_model(tiny_llama(), MaskConfig())
    args = MaskTrainingArguments(output_dir=str(tmp_path / "b"), max_steps=STEPS, per_device_train_batch_size=2,
                                 seed=0, data_seed=0, use_cpu=True, disable_tqdm=True, report_to="none",
                                 save_strategy="no", logging_steps=10)  # fmt: skip
    rec_b = Recorder()
    trainer_b = Trainer(
        model=b,
        args=args,
        train_dataset=TokenDataset(ids),
        optimizer_cls_and_kwargs=(MaskAdamW, {"lr": args.learning_rate, "compile": False}),
        callbacks=[MaskAnnealCallback(compile_sampling=False), rec_b],
    )
    _no_departure_warning(trainer_b.train)
    assert _groups(trainer_a) == _groups(trainer_b)
    assert {g["weight_decay"] for g in _groups(trainer_a) if g["n"]} == {0.1}
    assert _groups(trainer_a)[0]["betas"] == (0.9, 0.95) and _groups(trainer_a)[0]["initial_lr"] == 5e-4
    assert rec_a.steps == rec_b.steps and len(rec_a.steps) == STEPS
    lrs = [lr for lr, _, _ in rec_a.steps]
    assert lrs[0] < 5e-4 and lrs[-1] == pytest.approx(5e-5)  # cosine from 5e-4 to its 10% floor
    assert [tau for _, tau, _ in rec_a.steps][-1] < 4.0  # annealed
    for name, layer in a.masked_layers().items():  # same seeds, same data: the same masks
        assert torch.equal(layer.mask_logits, b.masked_layers()[name].mask_logits)


def test_plain_training_arguments_are_named_as_departures(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=1, learning_rate=5e-5, lr_scheduler_type="linear"),
        train_dataset=TokenDataset(cyclic_language(8, seed=0)),
        optimizer_cls_and_kwargs=(MaskAdamW, {"lr": 5e-4, "compile": False}),
        callbacks=[MaskAnnealCallback(compile_sampling=False)],
    )
    with pytest.warns(UserWarning, match="departs from the MaskLLM recipe") as caught:
        trainer.train()
    message = next(str(w.message) for w in caught if "departs" in str(w.message))
    for words in ("weight decay on the logits [0.0]", "LR schedule 'linear'", "learning rate [0.0005] differs",
                  "MaskTrainingArguments", "check_recipe=False"):  # fmt: skip
        assert words in message
    quiet = Trainer(
        model=get_mask_model(tiny_llama(), MaskConfig()),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=TokenDataset(cyclic_language(8, seed=0)),
        callbacks=[MaskAnnealCallback(compile_sampling=False, check_recipe=False)],
    )
    _no_departure_warning(quiet.train)


def test_model_evaluates_deterministically_after_training(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    ids = cyclic_language(8, seed=0)
    Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=TokenDataset(ids),
        callbacks=[MaskAnnealCallback(compile_sampling=False, check_recipe=False)],
    ).train()
    assert not mm.training and not any(layer.training for layer in mm.masked_layers().values())
    with torch.no_grad():
        first, second = mm(input_ids=ids[:2]).logits, mm(input_ids=ids[:2]).logits
    assert torch.equal(first, second)


def test_state_held_across_steps_is_counted_and_within_8_bytes(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = learn_mask(mm, TokenDataset(cyclic_language(8, seed=0)), max_steps=2, output_dir=str(tmp_path),
                         compile_sampling=False, disable_tqdm=True)  # fmt: skip
    sizes = training_state_bytes(mm, trainer.optimizer, trainer.callback_handler.callbacks)
    layers = mm.masked_layers().values()
    groups = sum(layer.mask_logits.shape[0] for layer in layers)
    masked = sum(layer.out_features * layer.in_features for layer in layers)
    # one byte per group (the previous hard choice, for the flip rate) and the [C, C] uint8 Hamming table
    assert sizes["callbacks"] == groups + 6 * 6
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total")
    # 3 + 3 + 1.5 + 0.25, plus a few fixed bytes (step counters, the table) on this tiny model
    assert sizes["total"] / masked == pytest.approx(7.75, abs=2e-3)
    assert sizes["total"] / masked <= 8
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MaskAnnealCallback))
    assert all(t.dtype == torch.uint8 for t in callback._previous.values())


def test_a_misspelt_prior_lists_the_methods():
    with pytest.raises(ConfigError, match=r"Did you mean prior='sparsegpt'\?") as info:
        get_mask_model(tiny_llama(), MaskConfig(prior="sparsegtp"))
    assert "magnitude" in str(info.value) and "owner/name" in str(info.value)
    with pytest.raises(ConfigError, match="not a one-shot method"):
        get_mask_model(tiny_llama(), MaskConfig(prior="no-such-folder"))


def test_compilation_announces_itself_with_its_time(tmp_path, caplog, monkeypatch):
    from hf_maskllm.adapters.model import MaskModel

    monkeypatch.setattr(
        MaskModel, "set_compiled_sampling", lambda self, enabled: False
    )  # announce, run eager
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=TokenDataset(cyclic_language(8, seed=0)),
        callbacks=[MaskAnnealCallback(compile_sampling=True, check_recipe=False)],
    )
    with caplog.at_level(logging.WARNING, logger="hf_maskllm"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(lines) == 2
    assert "compile_sampling=False" in lines[0]
    assert "first training step took" in lines[1] and " s," in lines[1]


def test_training_without_the_callback_is_said_once(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=TokenDataset(cyclic_language(8, seed=0)),
    )
    with pytest.warns(UserWarning, match="without MaskAnnealCallback") as caught:
        trainer.train()
    assert sum("without MaskAnnealCallback" in str(w.message) for w in caught) == 1
    scheduled = get_mask_model(tiny_llama(), MaskConfig()).train()  # a custom loop that sets the schedule
    scheduled.set_schedule_values(2.0, 200.0)
    ids = cyclic_language(2, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduled(input_ids=ids, labels=ids).loss.backward()
