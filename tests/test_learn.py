"""learn_mask: the recipe (the same run as the README's Trainer snippet), and the MaskAnnealCallback a caller
passes, used with its settings."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from trainer_helpers import TokenDataset, cyclic_language
from transformers import Trainer, TrainerCallback

from hf_maskllm import MaskAdamW, MaskAnnealCallback, MaskConfig, MaskTrainingArguments, get_mask_model
from hf_maskllm.errors import ConfigError
from hf_maskllm.learn import learn_mask
from hf_maskllm.training_args import PAPER_LR_SCHEDULE

STEPS = 4


class Recorder(TrainerCallback):
    """Per optimizer step: the learning rate the scheduler set and the tau / kappa of the masked layers."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float]] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        layer = next(iter(model.masked_layers().values()))
        self.steps.append((optimizer.param_groups[0]["lr"], layer.schedule.tau, layer.schedule.kappa))


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
    args = MaskTrainingArguments(output_dir=str(tmp_path / "b"), max_steps=STEPS, seed=0, data_seed=0,
                                 use_cpu=True, disable_tqdm=True, report_to="none", save_strategy="no",
                                 logging_steps=10)  # fmt: skip
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
    assert [lr for lr, _, _ in rec_a.steps] == [5e-4] * STEPS  # the default: a constant learning rate
    assert [tau for _, tau, _ in rec_a.steps][-1] < MaskConfig().tau[0]  # annealed
    for name, layer in a.masked_layers().items():  # same seeds, same data: the same masks
        assert torch.equal(layer.mask_logits, b.masked_layers()[name].mask_logits)


def test_the_papers_lr_schedule_is_one_argument_away_and_not_a_departure(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    rec = Recorder()
    _no_departure_warning(
        lambda: learn_mask(mm, TokenDataset(cyclic_language(16, seed=3)), max_steps=STEPS, output_dir=str(tmp_path),
                           compile_sampling=False, disable_tqdm=True, callbacks=[rec], **PAPER_LR_SCHEDULE)
    )  # fmt: skip
    lrs = [lr for lr, _, _ in rec.steps]
    cosine = [5e-5 + (5e-4 - 5e-5) * (1 + math.cos(math.pi * k / STEPS)) / 2 for k in range(1, STEPS + 1)]
    assert lrs == pytest.approx(cosine)  # cosine from 5e-4 down to its 10% floor


def test_by_default_two_sequences_share_a_forward_and_the_references_sample_per_sequence_is_one_argument_away(
    tmp_path,
):
    """One forward (so one mask sample: a training forward draws a new one each call,
    tests/adapters/test_model.py) of two sequences per step; ``batch_size=1, gradient_accumulation_steps=2``
    gives each sequence its own forward, not a departure; a larger batch_size is named as a departure."""
    data = TokenDataset(cyclic_language(16, seed=3))
    seen: dict[str, tuple[list[int], int]] = {}

    def forwards(name: str, **kwargs) -> None:
        mm = get_mask_model(tiny_llama(), MaskConfig())
        rows: list[int] = []
        handle = mm.base_model.get_input_embeddings().register_forward_hook(  # the masked forwards (the
            lambda mod, args, out: rows.append(out.shape[0]) if torch.is_grad_enabled() else None
        )  # unmasked teacher's, the default objective's, run without autograd)
        try:
            learn_mask(mm, data, max_steps=3, output_dir=str(tmp_path / name), compile_sampling=False,
                       disable_tqdm=True, **kwargs)  # fmt: skip
        finally:
            handle.remove()
        seen[name] = rows, mm.training_summary["optimizer_steps"]

    _no_departure_warning(lambda: forwards("default"))
    _no_departure_warning(lambda: forwards("reference", batch_size=1, gradient_accumulation_steps=2))
    with pytest.warns(UserWarning, match="micro-batches of 4 sequences share one mask sample"):
        forwards("larger", batch_size=4)
    assert seen["default"] == ([2] * 3, 3)  # 3 steps x one forward of 2 sequences
    assert seen["reference"] == ([1] * 6, 3)  # 3 steps x 2 micro-batches of one sequence
    assert seen["larger"] == ([4] * 3, 3)


# ---------------------------------------------------------------------------------------------- the caller's callback
def _anneal_callbacks(trainer: Trainer) -> list[MaskAnnealCallback]:
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MaskAnnealCallback)]


def test_learn_mask_uses_the_callers_mask_anneal_callback_with_its_settings(tmp_path):
    """check_recipe=False: a deliberate departure (lr 5e-2) runs without the recipe warning;
    log_mask_stats=False: the logs hold tau and kappa but no mask statistics."""
    mm = get_mask_model(tiny_llama(), MaskConfig())
    mine = MaskAnnealCallback(check_recipe=False, log_mask_stats=False, compile_sampling=False)
    holder = {}
    _no_departure_warning(
        lambda: holder.setdefault(
            "trainer",
            learn_mask(mm, TokenDataset(cyclic_language(8, seed=0)), max_steps=2, learning_rate=5e-2,
                       output_dir=str(tmp_path), logging_steps=1, disable_tqdm=True, callbacks=[mine]),
        )
    )  # fmt: skip
    trainer = holder["trainer"]
    assert _anneal_callbacks(trainer) == [mine]  # not a second, default one
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(
        "tau" in h and "mask_flip_rate" not in h and "mask_max_prob" not in h for h in logs
    )
    assert mm.training_summary["optimizer_steps"] == 2 and not mm.training


def test_learn_mask_adds_a_default_callback_only_without_one(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = learn_mask(mm, TokenDataset(cyclic_language(8, seed=0)), max_steps=1, output_dir=str(tmp_path),
                         compile_sampling=False, disable_tqdm=True, callbacks=[Recorder()])  # fmt: skip
    (default,) = _anneal_callbacks(trainer)
    assert default.check_recipe and default.log_mask_stats and default.compile_sampling is False


def test_learn_mask_refuses_two_callbacks_or_a_contradicting_compile_sampling(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    data = TokenDataset(cyclic_language(8, seed=0))
    with pytest.raises(ConfigError, match="more than one MaskAnnealCallback"):
        learn_mask(mm, data, max_steps=1, output_dir=str(tmp_path),
                   callbacks=[MaskAnnealCallback(), MaskAnnealCallback(check_recipe=False)])  # fmt: skip
    contradiction = r"compile_sampling=False but the MaskAnnealCallback.*compile_sampling=True"
    with pytest.raises(ConfigError, match=contradiction):
        learn_mask(mm, data, max_steps=1, output_dir=str(tmp_path), compile_sampling=False,
                   callbacks=[MaskAnnealCallback(compile_sampling=True)])  # fmt: skip
    assert mm.last_losses == {} and not mm.schedule.driven  # refused before any training
