"""Training with the transformers Trainer: annealing callback, sparse regulariser, learning, resuming."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_maskllm import MaskAnnealCallback, MaskConfig, MaskedLinear, MaskLLMError, MaskModel, get_mask_model
from hf_maskllm.adapters import layer as layer_module
from hf_maskllm.adapters import sampling
from hf_maskllm.adapters.schedules import schedule_value
from hf_maskllm.patterns import candidate_patterns

SEQ = 16


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def cyclic_language(num: int, seed: int) -> torch.Tensor:
    """Sequences ``start, start + k, start + 2k, ...`` (mod 32) with k in {1, 2, 3}: learnable in context."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 32, (num, 1), generator=generator)
    step = torch.randint(1, 4, (num, 1), generator=generator)
    return (start + step * torch.arange(SEQ)) % 32 + 3


def random_tokens(num: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (num, SEQ), generator=torch.Generator().manual_seed(seed))


def training_args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 6,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _enable_checkpointing(model, use_reentrant: bool) -> None:
    """Activation checkpointing under either of its transformers names (older releases: gradient_...)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": use_reentrant}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def _first_layer(mm: MaskModel) -> MaskedLinear:
    return mm.masked_layers()[mm.masked_names[0]]


# ---------------------------------------------------------------------------------------------- callback
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
        lambda mod, args: seen.append((mod.tau, mod.kappa, mm.sparse_reg_weight)) if mod.training else None
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
    kappa = callback.kappa
    probs = torch.cat(
        [
            (kappa * layer.mask_logits.detach().float()).softmax(-1).amax(-1)
            for layer in mm.masked_layers().values()
        ]
    )
    assert callback.last_max_prob == pytest.approx(float(probs.mean()), rel=1e-6)


# ---------------------------------------------------------------------------------------------- regulariser
def _forward_recording_masks(mm: MaskModel, inputs: dict, seed: int, **kwargs):
    """Training forward with a fixed Gumbel seed; returns the output and each layer's sampled soft mask,
    recomputed by plain autograd from the noise seed the layer drew (differentiable in the logits)."""
    seeds: dict[str, torch.Tensor] = {}
    current: list[str] = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, name=name: current.append(name))
        for name, layer in mm.masked_layers().items()
    ]
    original = layer_module.draw_seed

    def record(device):
        seeds[current[-1]] = original(device)
        return seeds[current[-1]]

    layer_module.draw_seed = record
    try:
        torch.manual_seed(seed)
        out = mm(**inputs, **kwargs)
    finally:
        layer_module.draw_seed = original
        for hook in hooks:
            hook.remove()
    sampled = {}
    for name, layer in mm.masked_layers().items():
        probs = sampling.sample_probs(layer.mask_logits, seeds[name], layer.tau, layer.kappa)
        mask = torch.stack(sampling.soft_mask_from_probs(probs, layer.n, layer.m, hard=False), dim=-1)
        sampled[name] = mask.reshape(layer.out_features, layer.in_features)
    return out, sampled


def test_sparse_regulariser_matches_manual_loss_and_gradient():
    lam = 1e-3
    mm = get_mask_model(tiny_llama(), MaskConfig(sparse_reg=lam, logits_dtype="float32"))  # exact gradients
    mm.train()
    ids = random_tokens(2, 3)
    inputs = {"input_ids": ids, "labels": ids}
    logits = [layer.mask_logits for layer in mm.masked_layers().values()]

    callback = MaskAnnealCallback()
    callback._apply(mm, global_step=3, max_steps=10)  # lambda * (1 - t) = 0.7 lambda
    weight = mm.sparse_reg_weight
    assert weight == pytest.approx(0.7 * lam)

    mm.sparse_reg_weight = 0.0
    plain, masks = _forward_recording_masks(mm, inputs, seed=0)
    reg = sum(
        (layer.base_layer.weight * masks[name]).pow(2).sum() for name, layer in mm.masked_layers().items()
    )
    grad_lm = torch.autograd.grad(plain.loss, logits, retain_graph=True)
    grad_reg = torch.autograd.grad(reg, logits)

    mm.sparse_reg_weight = weight
    regularised, masks2 = _forward_recording_masks(mm, inputs, seed=0)
    for name in masks:  # same Gumbel noise, same masks
        assert torch.equal(masks[name].detach(), masks2[name].detach())
    # the returned (logged) loss is the language-model loss; the term is kept aside for logging
    torch.testing.assert_close(regularised.loss, plain.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mm.last_sparse_reg_term, -weight * reg.detach(), rtol=1e-5, atol=1e-9)
    assert float(weight * reg.detach()) > 1e-3  # the term is not negligible here
    grad_total = torch.autograd.grad(regularised.loss, logits)
    for g_total, g_lm, g_reg in zip(grad_total, grad_lm, grad_reg):
        assert not torch.allclose(g_total, g_lm)
        torch.testing.assert_close(g_total, g_lm - weight * g_reg, rtol=1e-4, atol=1e-9)

    # when the Trainer normalises over the accumulated batch (num_items_in_batch), the term is split
    mm.grad_accum_steps = 2
    n_items = torch.tensor(int((ids[:, 1:] != -100).numel()))
    reg_n, _ = _forward_recording_masks(mm.train(), inputs, seed=0, num_items_in_batch=n_items)
    grad_reg_n = torch.autograd.grad(reg_n.loss, logits)
    mm.sparse_reg_weight = 0.0
    lm_n, _ = _forward_recording_masks(mm, inputs, seed=0, num_items_in_batch=n_items)
    torch.testing.assert_close(reg_n.loss, lm_n.loss, rtol=1e-6, atol=1e-7)
    grad_lm_n = torch.autograd.grad(lm_n.loss, logits)
    for g_total, g_lm, g_reg in zip(grad_reg_n, grad_lm_n, grad_reg):
        torch.testing.assert_close(g_total, g_lm - weight / 2 * g_reg, rtol=1e-4, atol=1e-9)


def test_no_regulariser_in_eval_or_with_zero_lambda():
    mm = get_mask_model(tiny_llama(), MaskConfig(sparse_reg=1.0))
    ids = random_tokens(2, 4)
    mm.sparse_reg_weight = 1.0
    mm.eval()
    with torch.no_grad():
        reg_eval = mm(input_ids=ids, labels=ids).loss
        mm.sparse_reg_weight = 0.0
        plain_eval = mm(input_ids=ids, labels=ids).loss
    assert torch.equal(reg_eval, plain_eval)


# ---------------------------------------------------------------------------------------------- learning
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


# ---------------------------------------------------------------------------------------------- resume
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
    assert set(saved) == {f"base_model.{name}.mask_logits" for name in full.masked_names}
    assert not any(k.endswith(".weight") for k in saved)

    resumed, trainer = _resume_run(tmp_path / "b", str(checkpoint), max_steps=10, save_steps=100)
    assert trainer.state.global_step == 10
    for name, layer in full.masked_layers().items():
        torch.testing.assert_close(
            resumed.masked_layers()[name].mask_logits, layer.mask_logits, rtol=0, atol=1e-6, msg=name
        )
    # steps 6-10 changed the logits, so the equality above is not trivial
    name = full.masked_names[0]
    assert not torch.allclose(saved[f"base_model.{name}.mask_logits"], full.masked_layers()[name].mask_logits)


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
        assert mm.grad_accum_steps == expected


def test_data_parallel_is_refused_with_a_clear_error():
    mm = get_mask_model(tiny_llama(), MaskConfig())
    args = SimpleNamespace(n_gpu=2, world_size=1, gradient_accumulation_steps=1)
    with pytest.raises(MaskLLMError, match="DataParallel"):
        MaskAnnealCallback().on_train_begin(args, SimpleNamespace(global_step=0, max_steps=1), None, model=mm)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    """Recomputed blocks redraw the same Gumbel seeds (checkpointing restores the RNG): identical grads.

    Non-reentrant checkpointing (transformers' default) also keeps the sparse regulariser's gradient;
    reentrant checkpointing cannot (its first forward runs without autograd), which is warned about.
    """
    ids = random_tokens(2, 5)
    reg = 0.0 if use_reentrant else 1e-3

    def logit_grads(checkpointing: bool) -> list[torch.Tensor]:
        mm = get_mask_model(tiny_llama(), MaskConfig(logits_dtype="float32", sparse_reg=reg))
        mm.sparse_reg_weight = reg
        if checkpointing:
            base = mm.get_base_model()
            base.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
            _enable_checkpointing(base, use_reentrant)
            assert any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
        mm.train()
        torch.manual_seed(0)
        mm(input_ids=ids, labels=ids).loss.backward()  # (reentrant checkpoints do not support autograd.grad)
        return [layer.mask_logits.grad for layer in mm.masked_layers().values()]

    for plain, checkpointed in zip(logit_grads(False), logit_grads(True)):
        assert plain.abs().max() > 0
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-8)
    if use_reentrant:
        mm = get_mask_model(tiny_llama(), MaskConfig(sparse_reg=1e-3))
        mm.sparse_reg_weight = 1e-3
        mm.get_base_model().enable_input_require_grads()
        _enable_checkpointing(mm.get_base_model(), use_reentrant=True)
        with pytest.warns(UserWarning, match="use_reentrant"):
            mm.train()(input_ids=ids, labels=ids)


def test_compiled_sampling_is_per_model_and_restored_after_training():
    """Two models in one process keep their own setting; the callback restores the model's own."""
    from hf_maskllm.adapters import fused_linear

    a = get_mask_model(tiny_llama(seed=0), MaskConfig())
    b = get_mask_model(tiny_llama(seed=1), MaskConfig())
    assert a.set_compiled_sampling(True) is False
    assert all(layer.compiled_sampling for layer in a.masked_layers().values())
    assert not any(layer.compiled_sampling for layer in b.masked_layers().values())
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
    assert all(layer.compiled_sampling for layer in b.masked_layers().values())
    callback.on_train_end(args, state, None, model=b)
    assert not any(layer.compiled_sampling for layer in b.masked_layers().values())
    assert all(layer.compiled_sampling for layer in a.masked_layers().values())
