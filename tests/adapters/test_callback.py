"""MaskAnnealCallback with the transformers Trainer: the annealed schedule it drives, the mask statistics
it logs, the regulariser's divisor and value, the layout of the logits, learning and resuming."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from safetensors.torch import load_file
from trainer_helpers import TokenDataset, cyclic_language, random_tokens, training_args
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_maskllm import MaskAnnealCallback, MaskConfig, MaskedLinear, MaskLLMError, MaskModel, get_mask_model
from hf_maskllm.adapters.schedule import schedule_value
from hf_maskllm.patterns import candidate_patterns


def _first_layer(mm: MaskModel) -> MaskedLinear:
    return mm.masked_layers()[mm.masked_names[0]]


# ---------------------------------------------------------------------------------------------- the schedule and its regulariser
class StepRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


@pytest.mark.parametrize(
    ("tau_schedule", "kappa_schedule"), [("linear", "linear"), ("cosine", "exponential")]
)
def test_callback_anneals_tau_kappa_and_regulariser_per_optimizer_step(
    tmp_path, tau_schedule, kappa_schedule
):
    cfg = MaskConfig(
        tau=(4.0, 0.05),
        kappa=(100.0, 500.0),
        tau_schedule=tau_schedule,
        kappa_schedule=kappa_schedule,
        sparse_reg=1e-3,
    )
    mm = get_mask_model(tiny_llama(), cfg)
    layer = _first_layer(mm)
    seen: list[tuple[float, float, float]] = []  # what every micro-batch forward actually used
    layer.register_forward_pre_hook(
        lambda mod, args: (
            seen.append((mod.schedule.tau, mod.schedule.kappa, mod.schedule.sparse_reg_weight))
            if mod.training and not mod.schedule.masks_disabled  # the masked passes, not the unmasked one
            else None
        )
    )
    recorder = StepRecorder()
    max_steps = 6
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=max_steps),
        train_dataset=TokenDataset(random_tokens(64, 0)),
        callbacks=[MaskAnnealCallback(), recorder],
    )
    trainer.train()

    assert recorder.steps == list(range(max_steps))  # once per optimizer update, not per micro-batch
    expected = []
    for step in range(max_steps):
        t = step / max_steps
        values = (
            schedule_value(4.0, 0.05, t, tau_schedule),
            schedule_value(100.0, 500.0, t, kappa_schedule),
            1e-3 * (1 - t),
        )
        expected += [values, values]  # gradient accumulation: two forwards per step
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(1, max_steps + 1))
    for h in logs:  # each log reports the values used for the step just taken
        t = (h["step"] - 1) / max_steps
        assert h["tau"] == pytest.approx(schedule_value(4.0, 0.05, t, tau_schedule), abs=1e-6)
        assert h["kappa"] == pytest.approx(schedule_value(100.0, 500.0, t, kappa_schedule), abs=1e-4)
        assert 0.0 <= h["mask_flip_rate"] <= 1.0
        assert 1 / 6 < h["mask_max_prob"] <= 1.0
    assert any(h["mask_flip_rate"] > 0 for h in logs)  # lr 1e-2 on logits of std 0.01 flips masks
    assert mm.training_summary["optimizer_steps"] == max_steps
    assert mm.training_summary["final_tau"] == pytest.approx(expected[-1][0])


def test_every_layer_reads_the_one_schedule_the_callback_updates(tmp_path):
    """The model's MaskSchedule is shared by its layers and updated in place once per optimizer step; the
    regulariser's value of each forward comes back as ``outputs.sparse_reg_loss`` and the last one is logged."""
    mm = get_mask_model(tiny_llama(), MaskConfig(tau=(4.0, 1.0), sparse_reg=1e-3))
    schedule = mm.schedule
    assert all(layer.schedule is schedule for layer in mm.masked_layers().values())
    assert not schedule.driven and schedule.progress is None and mm.last_losses == {}
    read: list[
        tuple[int, float]
    ] = []  # (id of the schedule a layer reads, its tau) in every training forward
    for layer in mm.masked_layers().values():
        layer.register_forward_pre_hook(
            lambda mod, args: (
                read.append((id(mod.schedule), mod.schedule.tau))
                if mod.training and not mod.schedule.masks_disabled
                else None
            )
        )
    values: list[float] = []  # outputs.sparse_reg_loss of every training forward
    mm.register_forward_hook(
        lambda mod, args, kwargs, out: values.append(float(out.sparse_reg_loss)), with_kwargs=True
    )
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=3),  # 2 micro-batches per step
        train_dataset=TokenDataset(random_tokens(32, 2)),
        callbacks=[MaskAnnealCallback(compile_sampling=False, check_recipe=False)],
    )
    trainer.train()
    assert mm.schedule is schedule and schedule.driven and schedule.reg_divisor == 2
    assert schedule.progress == pytest.approx(2 / 3)  # the last step's
    assert {i for i, _ in read} == {id(schedule)}
    layers = len(mm.masked_layers())
    taus = [tau for _, tau in read][::layers]  # one per forward
    assert taus == pytest.approx([4.0, 4.0, 3.0, 3.0, 2.0, 2.0])  # 4 -> 1 over 3 steps, per step
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(values) == 6 and all(v < 0 for v in values)
    assert [h["sparse_reg_loss"] for h in logs] == pytest.approx(values[1::2])  # the step's last micro-batch
    assert float(mm.last_losses["sparse_reg_loss"]) == pytest.approx(
        values[-1]
    )  # on the model, not the schedule
    assert [h["tau"] for h in logs] == pytest.approx([4.0, 3.0, 2.0])  # what the schedule held in each step


def test_regulariser_divisor_covers_accumulation_and_processes():
    """With num_items_in_batch the Trainer multiplies the loss by the process count (average_tokens_across_devices)
    and stops dividing by the accumulation steps: the callback's divisor undoes both."""
    mm = get_mask_model(tiny_llama(), MaskConfig())
    state = SimpleNamespace(global_step=0, max_steps=10)
    for world, average, accum, expected in [(2, True, 3, 6), (2, False, 3, 3), (1, True, 4, 4)]:
        args = SimpleNamespace(
            n_gpu=1,
            world_size=world,
            average_tokens_across_devices=average,
            gradient_accumulation_steps=accum,
        )
        MaskAnnealCallback(log_mask_stats=False).on_train_begin(args, state, None, model=mm)
        assert mm.schedule.reg_divisor == expected


# ---------------------------------------------------------------------------------------------- mask statistics
@pytest.mark.parametrize("compiled", [False, None])  # None: compiled where a compiler is available
def test_statistics_only_on_logged_steps_with_the_flips_of_the_step_just_logged(tmp_path, compiled):
    """With logging every 3 steps the callback keeps hard choices only across the step before each log
    (steps 2 and 5 of 6) and logs the fraction of masked weights that changed in that very step."""
    mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=["q_proj", "v_proj"]))
    callback = MaskAnnealCallback(compile_sampling=compiled)
    flips: dict[int, float] = {}
    kept_after: dict[int, int] = {}
    before: dict[str, torch.Tensor] = {}

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            before.clear()
            before.update({k: v.clone() for k, v in mm.hard_masks().items()})

        def on_step_end(self, args, state, control, **kwargs):  # runs after MaskAnnealCallback's
            after = mm.hard_masks()
            changed = sum(int((before[k] != after[k]).sum()) for k in before)
            flips[state.global_step] = changed / sum(v.numel() for v in before.values())
            kept_after[state.global_step] = len(callback._previous)

    mm.train()
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=6, logging_steps=3, learning_rate=5e-2),
        train_dataset=TokenDataset(random_tokens(64, 1)),
        callbacks=[callback, Watch()],
    )
    trainer.train()
    layers = len(mm.masked_layers())
    assert kept_after == {1: 0, 2: layers, 3: 0, 4: 0, 5: layers, 6: 0}
    logged = {h["step"]: h["mask_flip_rate"] for h in trainer.state.log_history if "mask_flip_rate" in h}
    assert logged.keys() == {3, 6}
    assert all(logged[step] == pytest.approx(flips[step]) for step in logged)
    assert any(flips[step] > 0 for step in logged)
    groups = sum(layer.mask_logits.shape[0] for layer in mm.masked_layers().values())
    assert callback.held_bytes() == groups + 6 * 6  # one byte per group, held across steps 2 and 5


@pytest.mark.parametrize("compiled", [False, None])  # None: compiled where a compiler is available
def test_callback_flip_rate_and_max_prob_match_a_manual_computation(tmp_path, compiled):
    mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=["q_proj", "v_proj"]))
    callback = MaskAnnealCallback(compile_sampling=compiled)
    before: dict[str, torch.Tensor] = {}
    after: dict[str, torch.Tensor] = {}

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            before.clear()
            before.update({k: v.clone() for k, v in mm.hard_masks().items()})

        def on_step_end(self, args, state, control, **kwargs):
            after.clear()
            after.update({k: v.clone() for k, v in mm.hard_masks().items()})

    mm.train()
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=1, learning_rate=5e-2),
        train_dataset=TokenDataset(random_tokens(16, 1)),
        callbacks=[Snapshot(), callback],  # Snapshot's on_step_end runs before the callback's
    )
    trainer.train()
    mm.train()  # hard_masks() below must not use an eval cache
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    total = sum(v.numel() for v in before.values())
    assert changed > 0
    assert callback.last_flip_rate == pytest.approx(changed / total)
    kappa = mm.schedule.kappa  # the callback keeps no copy
    assert not hasattr(callback, "kappa") and not hasattr(callback, "tau")
    probs = torch.cat(
        [
            (kappa * layer.mask_logits.detach().float()).softmax(-1).amax(-1)
            for layer in mm.masked_layers().values()
        ]
    )
    assert callback.last_max_prob == pytest.approx(float(probs.mean()), rel=1e-6)


# ---------------------------------------------------------------------------------------------- around the training run
def test_data_parallel_is_refused_with_a_clear_error():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    args = SimpleNamespace(n_gpu=2, world_size=1, gradient_accumulation_steps=1)
    with pytest.raises(MaskLLMError, match="DataParallel"):
        MaskAnnealCallback().on_train_begin(args, SimpleNamespace(global_step=0, max_steps=1), None, model=mm)


def test_trainer_stores_logits_candidate_major_and_checkpoints_them_row_major(tmp_path):
    """MaskAnnealCallback switches the logits to candidate-major storage when the Trainer is created
    (not under FSDP); switching named masks keeps the layout; the state dict (what a Trainer checkpoint
    writes with safetensors) is contiguous; values never change."""
    from safetensors.torch import save_file

    mm = get_mask_model(tiny_llama(), MaskConfig())
    before = {k: v.clone() for k, v in mm.state_dict().items()}
    layers = mm.masked_layers().values()
    assert all(layer.mask_logits.is_contiguous() for layer in layers)
    mm.add_mask("task", MaskConfig())
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    Trainer(model=mm, args=args, callbacks=[MaskAnnealCallback()])
    for name in ("default", "task", "default"):
        mm.set_mask(name)
        for layer in mm.masked_layers().values():
            assert layer.mask_logits.stride() == (1, layer.mask_logits.shape[0]), name
    state = mm.state_dict()
    assert all(t.is_contiguous() for t in state.values())
    assert all(torch.equal(state[k], before[k]) for k in before)
    save_file(state, tmp_path / "checkpoint.safetensors")
    assert mm.set_candidate_major_logits(False) is True
    assert all(layer.mask_logits.is_contiguous() for layer in mm.masked_layers().values())
    fsdp = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True)
    MaskAnnealCallback().on_init_end(fsdp, None, None, model=mm)
    assert all(layer.mask_logits.is_contiguous() for layer in mm.masked_layers().values())


def test_compilation_announces_itself_with_its_time(tmp_path, caplog, monkeypatch):
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


# ---------------------------------------------------------------------------------------------- learning and resuming
def _eval_loss(model, ids: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
def test_trainer_learns_masks_that_beat_a_random_prior(tmp_path):
    train_ids, eval_ids = cyclic_language(2048, 0), cyclic_language(64, 1)
    # 1. a dense model that knows the language
    torch.manual_seed(0)
    model = tiny_llama()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        batch = train_ids[torch.randint(0, train_ids.shape[0], (32,))]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    dense = _eval_loss(model, eval_ids)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    # 2. a random exactly-2:4 prior hurts
    mm = get_mask_model(model, MaskConfig(sparse_reg=0.0))
    generator = torch.Generator().manual_seed(7)
    cand = candidate_patterns(2, 4, dtype=torch.bool)
    prior = {
        name: cand[
            torch.randint(0, 6, (layer.out_features * layer.in_features // 4,), generator=generator)
        ].reshape(layer.out_features, layer.in_features)
        for name, layer in mm.masked_layers().items()
    }
    mm.apply_prior(prior)
    random_prior = _eval_loss(mm, eval_ids)
    assert random_prior > dense + 0.3

    # 3. learning the masks with frozen weights recovers most of the gap
    trainer = Trainer(
        model=mm,
        args=training_args(
            tmp_path, max_steps=40, per_device_train_batch_size=8, learning_rate=2e-2, logging_steps=10
        ),
        train_dataset=TokenDataset(train_ids),
        callbacks=[MaskAnnealCallback()],
    )
    trainer.train()
    learned = _eval_loss(mm, eval_ids)
    assert learned < random_prior - 0.5 * (random_prior - dense), (dense, random_prior, learned)
    assert learned > dense - 0.05
    changed = sum(int((mm.hard_masks()[k] != prior[k]).sum()) for k in prior) / sum(
        v.numel() for v in prior.values()
    )
    assert changed > 0.05
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    # the weights stayed frozen
    merged = mm.merge_and_unload()
    for key, value in merged.state_dict().items():
        if key.endswith("proj.weight"):
            assert torch.equal(value[value != 0], weights[key][value != 0]), key
        else:
            assert torch.equal(value, weights[key]), key


def _resume_run(tmp_path, resume_from: str | None, max_steps: int, save_steps: int):
    mm = get_mask_model(tiny_llama(), MaskConfig(seed=0))
    trainer = Trainer(
        model=mm,
        args=training_args(
            tmp_path,
            max_steps=max_steps,
            learning_rate=1e-2,
            lr_scheduler_type="linear",
            weight_decay=0.1,
            save_strategy="steps",
            save_steps=save_steps,
        ),
        train_dataset=TokenDataset(random_tokens(64, 5)),
        callbacks=[MaskAnnealCallback()],
    )
    trainer.train(resume_from_checkpoint=resume_from)
    return mm, trainer


@pytest.mark.slow
def test_resume_from_checkpoint_continues_exactly(tmp_path):
    full, _ = _resume_run(tmp_path / "a", None, max_steps=10, save_steps=5)
    checkpoint = tmp_path / "a" / "out" / "checkpoint-5"
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert set(saved) == {f"base_model.{name}.logits.default" for name in full.masked_names}
    assert not any(k.endswith(".weight") for k in saved)

    resumed, trainer = _resume_run(tmp_path / "b", str(checkpoint), max_steps=10, save_steps=100)
    assert trainer.state.global_step == 10
    for name, layer in full.masked_layers().items():
        torch.testing.assert_close(
            resumed.masked_layers()[name].mask_logits, layer.mask_logits, rtol=0, atol=1e-6, msg=name
        )
    # steps 6-10 changed the logits, so the equality above is not trivial
    name = full.masked_names[0]
    assert not torch.allclose(
        saved[f"base_model.{name}.logits.default"], full.masked_layers()[name].mask_logits
    )
