"""MaskModel: injection across architectures (one matrix, shared checks), the forward and its sparse weight
regulariser, dense views, failed construction, attribute forwarding."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import (
    model_inputs,
    output_tensor,
    single_thread,  # noqa: F401  (autouse fixture)
    tiny_bert,
    tiny_bert_mlm,
    tiny_gemma,
    tiny_gpt2,
    tiny_llama,
    tiny_llama_tied,
    tiny_mistral,
    tiny_opt,
    tiny_qwen2,
)
from torch import nn
from trainer_helpers import TokenDataset, cyclic_language, random_tokens, training_args
from transformers import Trainer

from hf_maskllm import MaskAnnealCallback, MaskConfig, MaskedLinear, MaskModel, get_mask_model
from hf_maskllm.adapters import layer as layer_module
from hf_maskllm.adapters.objective import is_causal_lm
from hf_maskllm.errors import ConfigError, MaskFileError, MaskLLMError
from hf_maskllm.modules import dense_weight_view, is_conv1d
from hf_maskllm.numerics import sampling
from hf_maskllm.patterns import candidate_patterns, count_nm_violations

# (case id, model factory, MaskConfig kwargs, number of layers that must be masked)
CASES = [
    ("llama-2:4-all-linear", tiny_llama, {}, 14),
    ("llama_tied-2:4-all-linear", tiny_llama_tied, {}, 14),
    ("llama-1:4-list", tiny_llama, {"n": 1, "m": 4, "target_modules": ["q_proj", "v_proj"]}, 4),
    ("llama-4:8-regex", tiny_llama, {"n": 4, "m": 8, "target_modules": r".*\.mlp\.(gate|up|down)_proj"}, 6),
    ("qwen2-2:4-all-linear", tiny_qwen2, {}, 14),
    ("qwen2-3:8-exclude", tiny_qwen2, {"n": 3, "m": 8, "exclude_modules": ["down_proj", "o_proj"]}, 10),
    ("mistral-2:4-all-linear", tiny_mistral, {}, 14),
    ("gemma-2:4-all-linear", tiny_gemma, {}, 14),
    ("gemma-2:8-list", tiny_gemma, {"n": 2, "m": 8, "target_modules": ["gate_proj", "up_proj"]}, 4),
    ("gpt2-conv1d-2:4-all-linear", tiny_gpt2, {}, 8),
    ("gpt2-conv1d-1:4-list", tiny_gpt2, {"n": 1, "m": 4, "target_modules": ["c_attn", "c_fc"]}, 4),
    ("opt-2:4-all-linear", tiny_opt, {}, 12),
    ("bert_mlm-2:4-all-linear", tiny_bert_mlm, {}, 13),
    ("bert-2:4-all-linear", tiny_bert, {}, 13),
    (
        "bert-3:4-regex-exclude",
        tiny_bert,
        {"n": 3, "m": 4, "exclude_modules": r"pooler\..*|.*\.output\.dense"},
        8,
    ),
]
IDS = [c[0] for c in CASES]


def _build(factory, kwargs, seed: int = 0) -> tuple[MaskModel, nn.Module]:
    base = factory()
    # init_std large enough that argmax is far from ties and masks differ clearly between layers.
    cfg = MaskConfig(**{"seed": seed, **kwargs})
    return get_mask_model(base, cfg), base


def _first_layer(mm: MaskModel) -> tuple[str, MaskedLinear]:
    name = mm.masked_names[0]
    return name, mm.masked_layers()[name]


@pytest.fixture(params=CASES, ids=IDS)
def case(request):
    case_id, factory, kwargs, count = request.param
    mm, base = _build(factory, kwargs)
    return mm, base, kwargs, count, case_id


# ---------------------------------------------------------------------------------------------- matrix checks
def test_injection_replaces_targets_with_masked_linear(case):
    mm, base, kwargs, count, case_id = case
    n, m = kwargs.get("n", 2), kwargs.get("m", 4)
    assert len(mm.masked_names) == count
    assert mm.get_base_model() is base
    c = math.comb(m, n)
    for name, layer in mm.masked_layers().items():
        assert isinstance(base.get_submodule(name), MaskedLinear)
        assert isinstance(layer.base_layer, nn.Linear) or is_conv1d(layer.base_layer)
        out_f, in_f = dense_weight_view(layer.base_layer).shape
        assert layer.mask_logits.shape == (out_f * in_f // m, c)
        assert layer.mask_logits.dtype == torch.bfloat16  # the default logits_dtype
    wrapped = [name for name, mod in base.named_modules() if isinstance(mod, MaskedLinear)]
    assert wrapped == mm.masked_names
    if case_id.startswith("gpt2"):  # GPT-2 really goes through the Conv1D path
        assert all(is_conv1d(layer.base_layer) for layer in mm.masked_layers().values())


def test_only_logits_require_grad(case):
    mm, _, _, count, _ = case
    trainable = [name for name, p in mm.named_parameters() if p.requires_grad]
    assert len(trainable) == count
    assert all(name.endswith(".logits.default") for name in trainable)  # the active mask's logits
    trainable_n, total = mm.get_nb_trainable_parameters()
    assert trainable_n == sum(layer.mask_logits.numel() for layer in mm.masked_layers().values())
    assert 0 < trainable_n < total


def test_output_embedding_is_never_masked(case):
    mm, base, _, _, _ = case
    out = base.get_output_embeddings()
    if out is None:  # BertModel has no output embedding
        return
    assert not isinstance(out, MaskedLinear)
    out_names = {name for name, mod in base.named_modules() if mod is out}
    assert out_names and not out_names & set(mm.masked_names)


def test_training_mode_samples_a_new_soft_mask_each_forward(case):
    mm, _, kwargs, _, _ = case
    n, m = kwargs.get("n", 2), kwargs.get("m", 4)
    inputs = model_inputs(mm)
    if is_causal_lm(mm.base_model):  # the default objective there distils the unmasked model: labels
        inputs = {**inputs, "labels": inputs["input_ids"]}
    mm.train()
    torch.manual_seed(0)
    first = output_tensor(mm(**inputs)).detach()
    second = output_tensor(mm(**inputs)).detach()
    assert not torch.allclose(first, second)
    _, layer = _first_layer(mm)
    soft = layer.sample_mask()
    assert soft.requires_grad  # differentiable w.r.t. the logits
    groups = soft.detach().reshape(-1, m)
    torch.testing.assert_close(groups.sum(dim=1), torch.full((groups.shape[0],), float(n)))
    assert bool(((groups >= 0) & (groups <= 1 + 1e-6)).all())
    assert not bool(((groups == 0) | (groups == 1)).all())  # soft, not already hard at the starting tau


def test_eval_mode_uses_the_exact_hard_argmax_mask(case):
    mm, _, kwargs, _, _ = case
    n, m = kwargs.get("n", 2), kwargs.get("m", 4)
    mm.eval()
    inputs = model_inputs(mm)
    with torch.no_grad():
        first = output_tensor(mm(**inputs))
        second = output_tensor(mm(**inputs))
        with mm.disable_masks():
            dense = output_tensor(mm(**inputs))
    assert torch.equal(first, second)  # deterministic
    assert not torch.allclose(first, dense, atol=1e-4)  # the mask does something
    cand = candidate_patterns(n, m, dtype=torch.bool)
    for name, layer in mm.masked_layers().items():
        hard = layer.hard_mask()
        assert hard.dtype == torch.bool and hard.shape == (layer.out_features, layer.in_features)
        groups = hard.reshape(-1, m)
        assert bool((groups.sum(dim=1) == n).all()), name
        assert torch.equal(hard, cand[layer.mask_logits.argmax(dim=-1)].reshape(hard.shape)), name
        assert count_nm_violations(hard.float(), n, m) == 0


def test_eval_output_equals_manual_masked_linear(case):
    mm, _, _, _, _ = case
    mm.eval()
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name):
        def hook(module, args, out) -> None:
            seen.setdefault(name, (args[0], out))

        return hook

    hooks = [layer.register_forward_hook(record(name)) for name, layer in mm.masked_layers().items()]
    with torch.no_grad():
        mm(**model_inputs(mm))
    for h in hooks:
        h.remove()
    assert set(seen) == set(mm.masked_names)  # every masked layer ran
    for name, (x, out) in seen.items():
        layer = mm.masked_layers()[name]
        weight = dense_weight_view(layer.base_layer) * layer.hard_mask().float()
        expected = F.linear(x, weight, layer.base_layer.bias)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------- wrapping
def test_wrapping_twice_raises():
    base = tiny_llama()
    mm = get_mask_model(base, MaskConfig())
    with pytest.raises(MaskLLMError, match="already carries mask adapters"):
        get_mask_model(base, MaskConfig())
    with pytest.raises(MaskLLMError, match="already carries mask adapters"):
        get_mask_model(mm, MaskConfig())
    assert len(mm.masked_names) == 14  # the first wrap is intact


# ---------------------------------------------------------------------------------------------- logits dtype and gradients
@pytest.mark.parametrize(("name", "dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_logits_dtype(name, dtype):
    mm, _ = _build(tiny_llama, {"logits_dtype": name})
    assert all(layer.mask_logits.dtype == dtype for layer in mm.masked_layers().values())
    mm.train()
    out = mm(**model_inputs(mm), labels=model_inputs(mm)["input_ids"])
    out.loss.backward()
    grads = [layer.mask_logits.grad for layer in mm.masked_layers().values()]
    assert all(g is not None and g.dtype == dtype and bool(g.abs().sum() > 0) for g in grads)


def test_gradient_reaches_only_logits():
    mm, base = _build(tiny_llama, {})
    mm.train()
    inputs = model_inputs(mm)
    mm(**inputs, labels=inputs["input_ids"]).loss.backward()
    for name, p in base.named_parameters():
        if name.endswith(".logits.default"):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
        else:
            assert p.grad is None, name


# ---------------------------------------------------------------------------------------------- reporting and forwarding
def test_print_trainable_parameters(capsys):
    mm, _ = _build(tiny_llama, {"target_modules": ["q_proj", "v_proj"]})
    mm.print_trainable_parameters()
    out = capsys.readouterr().out
    trainable, total = mm.get_nb_trainable_parameters()
    assert f"trainable params: {trainable:,}" in out and f"all params: {total:,}" in out
    assert "2:4" in out


def test_attribute_forwarding_and_generate():
    mm, base = _build(tiny_llama, {})
    assert mm.config is base.config
    mm.eval()
    ids = model_inputs(mm)["input_ids"][:1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = mm.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


# ---------------------------------------------------------------------------------------------- the sparse weight regulariser
def _enable_checkpointing(model, use_reentrant: bool) -> None:
    """Activation checkpointing under either of its transformers names (older releases: gradient_...)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": use_reentrant}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


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
        probs = sampling.sample_probs(
            layer.mask_logits, seeds[name], layer.schedule.tau, layer.schedule.kappa
        )
        mask = torch.stack(sampling.soft_mask_from_probs(probs, layer.n, layer.m, hard=False), dim=-1)
        sampled[name] = mask.reshape(layer.out_features, layer.in_features)
    return out, sampled


def test_sparse_regulariser_matches_manual_loss_and_gradient():
    lam = 1e-3
    # exact gradients; the language-model loss alone, so that its gradient is the regulariser's only partner
    mm = get_mask_model(tiny_llama(), MaskConfig(sparse_reg=lam, logits_dtype="float32", distill_logits=0.0))
    mm.train()
    ids = random_tokens(2, 3)
    inputs = {"input_ids": ids, "labels": ids}
    logits = [layer.mask_logits for layer in mm.masked_layers().values()]

    callback = MaskAnnealCallback()
    callback._apply(mm, global_step=3, max_steps=10)  # lambda * (1 - t) = 0.7 lambda
    weight = mm.schedule.sparse_reg_weight
    assert weight == pytest.approx(0.7 * lam)

    mm.schedule.update(sparse_reg_weight=0.0)
    plain, masks = _forward_recording_masks(mm, inputs, seed=0)
    reg = sum(
        (layer.base_layer.weight * masks[name]).pow(2).sum() for name, layer in mm.masked_layers().items()
    )
    grad_lm = torch.autograd.grad(plain.loss, logits, retain_graph=True)
    grad_reg = torch.autograd.grad(reg, logits)

    mm.schedule.update(sparse_reg_weight=weight)
    regularised, masks2 = _forward_recording_masks(mm, inputs, seed=0)
    for name in masks:  # same Gumbel noise, same masks
        assert torch.equal(masks[name].detach(), masks2[name].detach())
    # the returned (logged) loss is the language-model loss; the term comes with the outputs, for logging
    torch.testing.assert_close(regularised.loss, plain.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(regularised.sparse_reg_loss, -weight * reg.detach(), rtol=1e-5, atol=1e-9)
    assert not regularised.sparse_reg_loss.requires_grad
    assert mm.last_losses["sparse_reg_loss"] is regularised.sparse_reg_loss  # what MaskAnnealCallback logs
    assert "sparse_reg_loss" not in plain  # no regulariser, no value
    assert float(weight * reg.detach()) > 1e-3  # the term is not negligible here
    grad_total = torch.autograd.grad(regularised.loss, logits)
    for g_total, g_lm, g_reg in zip(grad_total, grad_lm, grad_reg):
        assert not torch.allclose(g_total, g_lm)
        # float32 sums: an element where the two terms cancel is exact only up to rounding of the largest
        atol = 1e-6 * float(torch.maximum(g_lm.abs().max(), (weight * g_reg).abs().max()))
        torch.testing.assert_close(g_total, g_lm - weight * g_reg, rtol=1e-4, atol=atol)

    # when the Trainer normalises over the accumulated batch (num_items_in_batch), the term is split
    mm.schedule.update(reg_divisor=2)
    n_items = torch.tensor(int((ids[:, 1:] != -100).numel()))
    reg_n, _ = _forward_recording_masks(mm.train(), inputs, seed=0, num_items_in_batch=n_items)
    grad_reg_n = torch.autograd.grad(reg_n.loss, logits)
    mm.schedule.update(sparse_reg_weight=0.0)
    lm_n, _ = _forward_recording_masks(mm, inputs, seed=0, num_items_in_batch=n_items)
    torch.testing.assert_close(reg_n.loss, lm_n.loss, rtol=1e-6, atol=1e-7)
    grad_lm_n = torch.autograd.grad(lm_n.loss, logits)
    for g_total, g_lm, g_reg in zip(grad_reg_n, grad_lm_n, grad_reg):
        atol = 1e-6 * float(torch.maximum(g_lm.abs().max(), (weight / 2 * g_reg).abs().max()))  # as above
        torch.testing.assert_close(g_total, g_lm - weight / 2 * g_reg, rtol=1e-4, atol=atol)


def test_no_regulariser_in_eval_or_with_zero_lambda():
    mm = get_mask_model(tiny_llama(), MaskConfig(sparse_reg=1.0))
    ids = random_tokens(2, 4)
    mm.schedule.update(sparse_reg_weight=1.0)
    mm.eval()
    with torch.no_grad():
        reg_eval = mm(input_ids=ids, labels=ids)
        mm.schedule.update(sparse_reg_weight=0.0)
        plain_eval = mm(input_ids=ids, labels=ids)
    assert torch.equal(reg_eval.loss, plain_eval.loss)
    assert "sparse_reg_loss" not in reg_eval and "sparse_reg_loss" not in mm.last_losses
    mm.train()
    torch.manual_seed(0)
    plain_train = mm(input_ids=ids, labels=ids)  # weight 0: nothing computed
    assert "sparse_reg_loss" not in plain_train and "sparse_reg_loss" not in mm.last_losses


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
        mm.schedule.update(sparse_reg_weight=reg)
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
        mm.schedule.update(sparse_reg_weight=1e-3)
        mm.get_base_model().enable_input_require_grads()
        _enable_checkpointing(mm.get_base_model(), use_reentrant=True)
        with pytest.warns(UserWarning, match="use_reentrant"):
            mm.train()(input_ids=ids, labels=ids)


def test_logged_loss_is_the_base_model_loss_and_the_gradient_has_the_regulariser():
    mm = get_mask_model(tiny_llama(), MaskConfig(logits_dtype="float32", sparse_reg=1e-2))
    mm.train()
    mm.schedule.update(sparse_reg_weight=1e-2)
    ids = random_tokens(2, 4)
    logits = [layer.mask_logits for layer in mm.masked_layers().values()]
    torch.manual_seed(0)
    out = mm(input_ids=ids, labels=ids)
    torch.manual_seed(0)  # the same Gumbel noise: the base model runs with the same soft masks
    base = mm.base_model(input_ids=ids, labels=ids)
    # the same cross-entropy, computed in the logit KL's pass over the logits (the default objective)
    torch.testing.assert_close(out.loss.detach(), base.loss.detach(), rtol=1e-6, atol=0)
    assert float(out.sparse_reg_loss) < 0
    grad_out = torch.autograd.grad(out.loss, logits)
    grad_base = torch.autograd.grad(base.loss, logits)
    assert any(not torch.allclose(a, b) for a, b in zip(grad_out, grad_base))


# ---------------------------------------------------------------------------------------------- training without a schedule
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


# ---------------------------------------------------------------------------------------------- dense views, failures
def test_disable_masks_runs_the_base_layers_without_moving_a_module():
    mm, base = _build(tiny_llama, {})
    layers = mm.masked_layers()
    inputs = model_inputs(mm)
    mm.eval()
    with torch.no_grad():
        masked = output_tensor(mm(**inputs))
        with mm.disable_masks():
            assert all(base.get_submodule(name) is layer for name, layer in layers.items())  # a flag, no swap
            assert mm.schedule.masks_disabled
            dense = output_tensor(mm(**inputs))
        assert all(base.get_submodule(name) is layer for name, layer in layers.items())
        again = output_tensor(mm(**inputs))
        plain = output_tensor(tiny_llama()(**inputs))  # the same seeded weights, never wrapped
    assert torch.equal(dense, plain)
    assert torch.equal(again, masked) and not torch.allclose(masked, dense, atol=1e-4)
    with pytest.raises(RuntimeError, match="inside"), mm.disable_masks():
        raise RuntimeError("inside")
    assert all(base.get_submodule(name) is layer for name, layer in layers.items())


def _own_linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def test_a_failed_construction_leaves_the_model_with_its_own_layers():
    model = tiny_llama()
    own = _own_linears(model)
    with pytest.raises(ConfigError, match="needs calibration data"):  # the prior fails after wrapping
        MaskModel(model, MaskConfig(prior="wanda"))
    with pytest.raises(ConfigError, match="needs calibration data"):
        get_mask_model(model, MaskConfig(prior="sparsegpt"))
    assert not any(isinstance(mod, MaskedLinear) for mod in model.modules())
    assert _own_linears(model) == own and all(model.get_submodule(k) is v for k, v in own.items())
    assert len(get_mask_model(model, MaskConfig()).masked_names) == 14  # and it can be wrapped again


def test_a_failed_from_pretrained_leaves_the_model_with_its_own_layers(tmp_path):
    get_mask_model(tiny_llama(hidden=32, intermediate=64), MaskConfig()).save_pretrained(tmp_path / "small")
    model = tiny_llama()
    own = _own_linears(model)
    with pytest.raises(MaskFileError, match="shape"):  # the same layer names, other shapes
        MaskModel.from_pretrained(model, tmp_path / "small")
    assert not any(isinstance(mod, MaskedLinear) for mod in model.modules())
    assert all(model.get_submodule(k) is v for k, v in own.items())
    assert len(get_mask_model(model, MaskConfig()).masked_names) == 14
