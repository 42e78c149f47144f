"""The training schedule: ``schedule_value`` (linear, cosine, exponential) and the one ``MaskSchedule`` a model
owns and its masked layers read (tau, kappa, the regulariser, compiled or recomputed sampling)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)

from hf_maskllm import MaskAnnealCallback, MaskConfig, get_mask_model
from hf_maskllm.adapters import MaskSchedule
from hf_maskllm.adapters.schedule import annealed_values, schedule_value
from hf_maskllm.errors import ConfigError
from hf_maskllm.numerics import fused_linear


# ---------------------------------------------------------------------------------------------- schedule_value
@pytest.mark.parametrize(
    ("start", "end", "kind", "progress", "expected"),
    [
        # linear: start + (end - start) * t
        (4.0, 0.05, "linear", 0.0, 4.0),
        (4.0, 0.05, "linear", 0.5, 2.025),
        (4.0, 0.05, "linear", 0.25, 3.0125),
        (4.0, 0.05, "linear", 1.0, 0.05),
        (100.0, 500.0, "linear", 0.5, 300.0),
        (100.0, 500.0, "linear", 0.75, 400.0),
        # cosine: end + (start - end) * (1 + cos(pi t)) / 2
        (4.0, 0.05, "cosine", 0.0, 4.0),
        (4.0, 0.05, "cosine", 0.5, 2.025),
        (4.0, 0.05, "cosine", 0.25, 0.05 + 3.95 * (1 + math.sqrt(0.5)) / 2),
        (4.0, 0.05, "cosine", 1.0, 0.05),
        (100.0, 500.0, "cosine", 0.25, 500.0 - 400.0 * (1 + math.sqrt(0.5)) / 2),
        # exponential: start * (end / start) ** t; the midpoint is the geometric mean
        (4.0, 0.05, "exponential", 0.0, 4.0),
        (4.0, 0.05, "exponential", 0.5, math.sqrt(4.0 * 0.05)),
        (4.0, 0.05, "exponential", 1.0, 0.05),
        (100.0, 500.0, "exponential", 0.5, math.sqrt(100.0 * 500.0)),
        # progress is clamped to [0, 1]
        (4.0, 0.05, "linear", -0.5, 4.0),
        (4.0, 0.05, "exponential", 1.5, 0.05),
    ],
)
def test_schedule_values_by_hand(start, end, kind, progress, expected):
    assert schedule_value(start, end, progress, kind) == pytest.approx(expected, rel=1e-12)


def test_unknown_schedule_kind_raises():
    with pytest.raises(ConfigError, match="step"):
        schedule_value(4.0, 0.05, 0.5, "step")


# ---------------------------------------------------------------------------------------------- MaskSchedule
def test_update_sets_several_fields_and_refuses_unknown_ones():
    schedule = MaskSchedule()
    default = MaskConfig()  # a fresh schedule starts where the default config's schedules start
    assert (schedule.tau, schedule.kappa, schedule.hard, schedule.sparse_reg_weight) == (
        default.tau[0],
        default.kappa[0],
        False,
        0.0,
    )
    assert (schedule.reg_divisor, schedule.compiled_sampling, schedule.recompute_sampling) == (1, False, None)
    schedule.update(tau=0.5, kappa=300.0)
    assert (schedule.tau, schedule.kappa) == (0.5, 300.0)
    with pytest.raises(ConfigError, match=r"MaskSchedule has no field \['grad_accum_steps', 'taus'\]"):
        schedule.update(taus=1.0, grad_accum_steps=2, kappa=1.0)
    assert schedule.kappa == 300.0  # nothing is set when a name is unknown


def test_set_schedule_values_updates_the_schedule_every_layer_reads():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    assert all(layer.schedule is mm.schedule for layer in mm.masked_layers().values())
    assert not mm.schedule.driven
    mm.set_schedule_values(2.0, 200.0)
    assert (mm.schedule.tau, mm.schedule.kappa, mm.schedule.sparse_reg_weight) == (2.0, 200.0, 0.0)
    assert mm.schedule.driven  # a training loop sets it: no warning about a missing callback
    mm.set_schedule_values(1.0, 300.0, sparse_reg_weight=1e-4)
    assert (mm.schedule.tau, mm.schedule.kappa, mm.schedule.sparse_reg_weight) == (1.0, 300.0, 1e-4)
    other = get_mask_model(tiny_llama(), MaskConfig())
    assert other.schedule is not mm.schedule and other.schedule.tau == 2.0  # one schedule per model


@pytest.mark.parametrize("kinds", [("linear", "linear"), ("cosine", "exponential")])
def test_one_function_computes_the_schedule_from_the_progress_and_the_config(kinds):
    """``annealed_values`` is the annealing policy; ``set_schedule_progress`` (what the callback calls) writes
    exactly its values, and the schedule holds settings only (no per-step outputs)."""
    config = MaskConfig(tau=(4.0, 0.05), kappa=(100.0, 500.0), tau_schedule=kinds[0], kappa_schedule=kinds[1],
                        sparse_reg=1e-3)  # fmt: skip
    mm = get_mask_model(tiny_llama(), config)
    for progress in (0.0, 0.25, 0.5, 1.0):
        expected = {
            "tau": schedule_value(4.0, 0.05, progress, kinds[0]),
            "kappa": schedule_value(100.0, 500.0, progress, kinds[1]),
            "sparse_reg_weight": 1e-3 * (1.0 - progress),
        }
        assert annealed_values(config, progress) == expected
        mm.set_schedule_progress(progress)
        held = {name: getattr(mm.schedule, name) for name in expected}
        assert held == expected and mm.schedule.progress == progress and mm.schedule.driven
    fields = {f.name for f in dataclasses.fields(MaskSchedule)}
    assert not fields & {"last_reg_loss", "last_objective_terms"}  # outputs live on the model


def test_the_values_that_change_every_step_have_tensors_that_follow_them_in_place():
    """tau, kappa and the regulariser's weight stay Python floats for users; the forward reads their 0-d tensors,
    the same objects all run (compiled code holding them sees each new value), and a flag for the regulariser."""
    config = MaskConfig(tau=(4.0, 0.05), kappa=(100.0, 500.0), sparse_reg=1e-3)
    schedule = MaskSchedule()
    tensors = {name: schedule.tensor(name) for name in ("tau", "kappa", "sparse_reg_weight")}
    assert all(
        t.shape == () and t.dtype == torch.float64 and t.device.type == "cpu" for t in tensors.values()
    )
    assert not schedule.regularising
    for progress in (0.0, 0.3, 0.999, 1.0):
        schedule.set_progress(config, progress)
        for name, tensor in tensors.items():
            assert schedule.tensor(name) is tensor
            assert type(getattr(schedule, name)) is float and tensor.item() == getattr(schedule, name)
        assert schedule.regularising == (progress < 1.0)
    schedule.tau = 0.25  # a field set directly, or through update, moves its tensor too
    schedule.update(kappa=7.5, sparse_reg_weight=2e-4)
    assert [t.item() for t in tensors.values()] == [0.25, 7.5, 2e-4] and schedule.regularising
    with pytest.raises(ConfigError, match="not 'hard'"):
        schedule.tensor("hard")


@pytest.mark.parametrize("recompute", [False, True])
def test_the_fused_linear_computes_with_the_schedule_tensors_what_it_computes_with_floats(recompute):
    """The tensors are float64 CPU scalars: ``kappa / tau`` in the backward pass is the Python float's, and the
    fused forward and backward give bit for bit what the same values as floats give."""
    schedule = MaskSchedule()
    schedule.update(tau=0.3, kappa=300.0)
    as_float32 = torch.tensor([300.0, 0.3], dtype=torch.float32)
    # float32 tensors would give another kappa / tau than the floats
    assert as_float32[0] / as_float32[1] != torch.tensor(300.0 / 0.3, dtype=torch.float32)
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(weight.numel() // 4, 6, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    seed = torch.tensor([5, 9], dtype=torch.int32)
    results = []
    for tau, kappa in ((0.3, 300.0), (schedule.tensor("tau"), schedule.tensor("kappa"))):
        leaf = logits.clone().requires_grad_(True)
        y, reg = fused_linear.masked_linear(
            x, weight, None, leaf, 2, 4, seed, tau, kappa, with_reg=True, recompute=recompute
        )
        (y.square().sum() + reg).backward()
        results.append((y, reg, leaf.grad))
    for floats, tensors in zip(*results):
        assert torch.equal(floats, tensors)


def test_compiled_sampling_is_per_model_and_restored_after_training():
    """Two models in one process keep their own setting; the callback restores the model's own."""
    a = get_mask_model(tiny_llama(seed=0), MaskConfig())
    b = get_mask_model(tiny_llama(seed=1), MaskConfig())
    assert a.set_compiled_sampling(True) is False
    assert a.schedule.compiled_sampling and not b.schedule.compiled_sampling
    assert all(layer.schedule is a.schedule for layer in a.masked_layers().values())
    assert all(layer.schedule is b.schedule for layer in b.masked_layers().values())
    # b trains eager: nothing is compiled on its behalf
    fused_linear._COMPILED.clear()
    b.train()
    ids = torch.randint(0, b.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    b(input_ids=ids, labels=ids).loss.backward()
    assert not fused_linear._COMPILED
    # the callback turns b's on for its run and gives b back its own setting (off), leaving a's (on)
    args = SimpleNamespace(n_gpu=1, world_size=1, gradient_accumulation_steps=1)
    state = SimpleNamespace(global_step=0, max_steps=1)
    callback = MaskAnnealCallback(log_mask_stats=False, compile_sampling=True)
    callback.on_train_begin(args, state, None, model=b)
    assert b.schedule.compiled_sampling
    callback.on_train_end(args, state, None, model=b)
    assert not b.schedule.compiled_sampling
    assert a.schedule.compiled_sampling


def test_set_recompute_sampling_sets_every_layer_and_returns_the_previous():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    assert mm.set_recompute_sampling(True) is None
    assert mm.schedule.recompute_sampling is True
    assert all(layer.schedule is mm.schedule for layer in mm.masked_layers().values())
    assert mm.set_recompute_sampling(None) is True
    assert mm.schedule.recompute_sampling is None
