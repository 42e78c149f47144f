"""Mask injection across architectures (one matrix, shared checks), sampling, eval masks, targets, priors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import (
    model_inputs,
    odd_net,
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

from hf_maskllm import MaskConfig, MaskedLinear, MaskModel, get_mask_model
from hf_maskllm.errors import MaskLLMError, TargetError
from hf_maskllm.modules import dense_weight_view, is_conv1d
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
    assert all(name.endswith(".mask_logits") for name in trainable)
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
    assert not bool(((groups == 0) | (groups == 1)).all())  # soft, not already hard at tau = 4


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


# ---------------------------------------------------------------------------------------------- eval cache
def _changed_logits(layer: MaskedLinear) -> torch.Tensor:
    """Logits whose argmax differs from the current one in every group."""
    logits = layer.mask_logits.detach().clone()
    return logits.roll(1, dims=1) if logits.shape[1] > 1 else -logits


def test_eval_mask_cache_follows_in_place_logit_changes():
    mm, _ = _build(tiny_llama, {})
    mm.eval()
    inputs = model_inputs(mm)
    name, layer = _first_layer(mm)
    with torch.no_grad():
        before = output_tensor(mm(**inputs))
        mask_before = layer.hard_mask().clone()
        assert layer.hard_mask() is layer.hard_mask()  # cached while logits are unchanged
        layer.mask_logits.copy_(_changed_logits(layer))
        after = output_tensor(mm(**inputs))
    mask_after = layer.hard_mask()
    assert not torch.equal(mask_before, mask_after)
    cand = candidate_patterns(2, 4, dtype=torch.bool)
    assert torch.equal(mask_after, cand[layer.mask_logits.argmax(-1)].reshape(mask_after.shape))
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "sgd"])
def test_eval_mask_after_optimizer_step_and_eval(optimizer):
    mm, _ = _build(tiny_llama, {})
    inputs = model_inputs(mm)
    params = [p for p in mm.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=50.0)
    elif optimizer == "adamw-fused":  # the Trainer's default; fused kernels do not bump the version counter
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    else:
        opt = torch.optim.AdamW(params, lr=0.05, foreach=True)
    mm.eval()
    with torch.no_grad():
        before = output_tensor(mm(**inputs))
    masks_before = mm.hard_masks()
    mm.train()
    for _ in range(3):
        out = mm(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    mm.eval()
    with torch.no_grad():
        after = output_tensor(mm(**inputs))
    masks_after = mm.hard_masks()
    changed = sum(int((masks_before[k] != masks_after[k]).sum()) for k in masks_before)
    assert changed > 0
    cand = candidate_patterns(2, 4, dtype=torch.bool)
    for name, layer in mm.masked_layers().items():
        expected = cand[layer.mask_logits.argmax(-1)].reshape(layer.out_features, layer.in_features)
        assert torch.equal(masks_after[name], expected), name
    assert not torch.allclose(before, after)


# ---------------------------------------------------------------------------------------------- targets
def test_indivisible_layer_is_skipped_with_a_warning_naming_it():
    with pytest.warns(UserWarning, match=r"odd \(in_features=6\)"):
        mm = get_mask_model(odd_net(), MaskConfig(target_modules=["up", "odd", "down"]))
    assert mm.masked_names == ["up", "down"]
    assert isinstance(mm.base_model.odd, nn.Linear)
    mm.eval()
    assert mm(torch.randn(3, 8)).shape == (3, 8)


def test_indivisible_layer_with_strict_raises():
    with pytest.raises(TargetError, match="odd"):
        get_mask_model(odd_net(), MaskConfig(strict=True))


def test_all_linear_on_custom_module_masks_every_divisible_layer():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 6 is divisible by 2: no warning
        mm = get_mask_model(odd_net(), MaskConfig(n=1, m=2))
    assert mm.masked_names == ["up", "odd", "down"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"target_modules": ["q_proj"]},
            ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"],
        ),
        ({"target_modules": ["layers.1.mlp.down_proj"]}, ["model.layers.1.mlp.down_proj"]),
        (
            {"target_modules": r"model\.layers\.1\.self_attn\.[qk]_proj"},
            ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"],
        ),
        (
            {"target_modules": ["q_proj", "down_proj"], "exclude_modules": r"model\.layers\.0\..*"},
            ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"],
        ),
    ],
)
def test_target_and_exclude_selection(kwargs, expected):
    mm = get_mask_model(tiny_llama(), MaskConfig(**kwargs))
    assert mm.masked_names == expected


def test_exclude_suffix_matches_module_names_not_their_children():
    mm = get_mask_model(tiny_llama(), MaskConfig(exclude_modules=["self_attn.q_proj", "mlp"]))
    assert len(mm.masked_names) == 12  # 'mlp' names the MLP block, whose projections stay targets
    assert not any(name.endswith("q_proj") for name in mm.masked_names)


def test_excluding_everything_raises():
    with pytest.raises(TargetError, match="matched no maskable layer"):
        get_mask_model(tiny_llama(), MaskConfig(exclude_modules=r".*_proj"))


def test_list_is_suffix_match_on_dotted_names_and_regex_is_full_match():
    with pytest.raises(TargetError, match="matched no maskable layer"):
        get_mask_model(tiny_llama(), MaskConfig(target_modules=["proj"]))  # not a dotted suffix
    with pytest.raises(TargetError, match="matched no maskable layer"):
        get_mask_model(tiny_llama(), MaskConfig(target_modules="q_proj"))  # regex must match the full name
    mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=".*q_proj"))
    assert len(mm.masked_names) == 2


def test_explicit_lm_head_target_is_masked_but_all_linear_skips_it():
    mm = get_mask_model(tiny_llama(), MaskConfig(target_modules=["lm_head"]))
    assert mm.masked_names == ["lm_head"]
    mm2 = get_mask_model(tiny_llama(), MaskConfig(exclude_modules=["q_proj"]))
    assert "lm_head" not in mm2.masked_names


@pytest.mark.parametrize(
    ("targets", "type_name"),
    [(["embed_tokens"], "Embedding"), (["mlp"], "LlamaMLP"), (["input_layernorm"], "LlamaRMSNorm")],
)
def test_unsupported_module_named_explicitly_raises(targets, type_name):
    with pytest.raises(TargetError, match=type_name):
        get_mask_model(tiny_llama(), MaskConfig(target_modules=targets))


def test_targets_matching_nothing_raise():
    with pytest.raises(TargetError, match="nonexistent"):
        get_mask_model(tiny_llama(), MaskConfig(target_modules=["nonexistent"]))


def test_wrapping_twice_raises():
    base = tiny_llama()
    mm = get_mask_model(base, MaskConfig())
    with pytest.raises(MaskLLMError, match="already carries mask adapters"):
        get_mask_model(base, MaskConfig())
    with pytest.raises(MaskLLMError, match="already carries mask adapters"):
        get_mask_model(mm, MaskConfig())
    assert len(mm.masked_names) == 14  # the first wrap is intact


# ---------------------------------------------------------------------------------------------- init / dtype / seed
def test_seed_controls_logit_init_and_init_std():
    a, _ = _build(tiny_llama, {"seed": 1})
    b, _ = _build(tiny_llama, {"seed": 1})
    c, _ = _build(tiny_llama, {"seed": 2})
    la, lb, lc = (next(iter(x.masked_layers().values())).mask_logits for x in (a, b, c))
    assert torch.equal(la, lb) and not torch.equal(la, lc)
    all_logits = torch.cat([layer.mask_logits.reshape(-1) for layer in a.masked_layers().values()])
    assert float(all_logits.detach().std()) == pytest.approx(0.01, rel=0.05)
    wide, _ = _build(tiny_llama, {"init_std": 0.5})
    wide_logits = torch.cat([layer.mask_logits.reshape(-1) for layer in wide.masked_layers().values()])
    assert float(wide_logits.detach().std()) == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize(("name", "dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_logits_dtype(name, dtype):
    mm, _ = _build(tiny_llama, {"logits_dtype": name})
    assert all(layer.mask_logits.dtype == dtype for layer in mm.masked_layers().values())
    mm.train()
    out = mm(**model_inputs(mm), labels=model_inputs(mm)["input_ids"])
    out.loss.backward()
    grads = [layer.mask_logits.grad for layer in mm.masked_layers().values()]
    assert all(g is not None and g.dtype == dtype and bool(g.abs().sum() > 0) for g in grads)


def test_hard_straight_through_samples_are_exact_nm_and_differentiable():
    mm, _ = _build(tiny_llama, {"hard": True})
    mm.train()
    _, layer = _first_layer(mm)
    assert layer.hard is True
    sample = layer.sample_mask()
    groups = sample.detach().reshape(-1, 4)
    assert bool(((groups == 0) | (groups == 1)).all()) and bool((groups.sum(1) == 2).all())
    (sample * torch.randn_like(sample)).sum().backward()
    assert layer.mask_logits.grad is not None and bool(layer.mask_logits.grad.abs().sum() > 0)


def test_gradient_reaches_only_logits():
    mm, base = _build(tiny_llama, {})
    mm.train()
    inputs = model_inputs(mm)
    mm(**inputs, labels=inputs["input_ids"]).loss.backward()
    for name, p in base.named_parameters():
        if name.endswith("mask_logits"):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
        else:
            assert p.grad is None, name


# ---------------------------------------------------------------------------------------------- priors
def _random_nm_masks(mm: MaskModel, n: int, m: int, seed: int = 7) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    cand = candidate_patterns(n, m, dtype=torch.bool)
    out = {}
    for name, layer in mm.masked_layers().items():
        idx = torch.randint(
            0, cand.shape[0], (layer.out_features * layer.in_features // m,), generator=generator
        )
        out[name] = cand[idx].reshape(layer.out_features, layer.in_features)
    return out


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8)])
def test_apply_prior_makes_initial_hard_mask_equal_the_prior(n, m):
    mm, _ = _build(tiny_llama, {"n": n, "m": m, "logits_dtype": "float32"})  # the rule checked to 1e-7
    prior = _random_nm_masks(mm, n, m)
    init = {name: layer.mask_logits.detach().clone() for name, layer in mm.masked_layers().items()}
    # the random prior is far from what a magnitude prior would give
    for name, layer in mm.masked_layers().items():
        w = dense_weight_view(layer.base_layer).abs().reshape(-1, m)
        magnitude = torch.zeros_like(w, dtype=torch.bool).scatter_(1, w.topk(n, dim=1).indices, True)
        assert float((magnitude.reshape(prior[name].shape) != prior[name]).float().mean()) > 0.2
    mm.apply_prior(prior)  # default strength 3
    assert mm.mask_config.prior_strength == 3.0
    cand = candidate_patterns(n, m)
    for name, layer in mm.masked_layers().items():
        assert torch.equal(layer.hard_mask(), prior[name]), name
        # the rule: logits += alpha * std * (overlap - n/2), the prior's candidate raised further if needed
        std = init[name].std()
        overlap = prior[name].reshape(-1, m).float() @ cand.t()
        expected = init[name] + 3.0 * std * (overlap - n / 2)
        prior_idx = (overlap == n).float().argmax(dim=1)
        new = layer.mask_logits.detach()
        is_prior = torch.zeros_like(new, dtype=torch.bool).scatter_(1, prior_idx[:, None], True)
        torch.testing.assert_close(new[~is_prior], expected[~is_prior], rtol=0, atol=1e-7)
        assert bool((new[is_prior] >= expected[is_prior] - 1e-7).all())
        # in most groups the rule alone already makes the prior win: those logits are untouched (fewer
        # for 4:8, where 16 of the 70 candidates share 3 of the 4 kept positions and get +3 sigma too)
        untouched = torch.isclose(new[is_prior], expected[is_prior], rtol=0, atol=1e-7)
        assert float(untouched.float().mean()) > 0.6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8)])
def test_apply_prior_is_exact_with_16_bit_logits(n, m, dtype):
    # rounding the prior-adjusted logits to 16 bits must not tie or reorder the prior's candidate
    mm, _ = _build(tiny_llama, {"n": n, "m": m, "logits_dtype": dtype})
    prior = _random_nm_masks(mm, n, m)
    mm.apply_prior(prior)
    for name, mask in mm.hard_masks().items():
        assert mm.masked_layers()[name].mask_logits.dtype == getattr(torch, dtype)
        assert torch.equal(mask, prior[name]), name


def test_prior_rule_for_2_4_is_plus_minus_three_sigma():
    mm, _ = _build(tiny_llama, {"target_modules": ["q_proj"], "logits_dtype": "float32"})
    _, layer = _first_layer(mm)
    before = layer.mask_logits.detach().clone()
    prior = {
        name: candidate_patterns(2, 4, dtype=torch.bool)[0].repeat(lay.out_features, lay.in_features // 4)
        for name, lay in mm.masked_layers().items()
    }  # 1100 everywhere
    mm.apply_prior(prior)
    delta = (layer.mask_logits.detach() - before) / before.std()
    # candidates 1100 (+3 sigma), 1010/1001/0110/0101 (0), 0011 (-3 sigma), except where the fix-up raised 1100
    torch.testing.assert_close(delta[:, 1:5], torch.zeros_like(delta[:, 1:5]), atol=1e-4, rtol=0)
    torch.testing.assert_close(delta[:, 5], torch.full_like(delta[:, 5], -3.0), atol=1e-4, rtol=0)
    assert bool((delta[:, 0] >= 3.0 - 1e-4).all())
    assert float(torch.isclose(delta[:, 0], torch.tensor(3.0), atol=1e-4).float().mean()) > 0.9


def test_apply_prior_rejects_wrong_layers_shapes_and_non_nm():
    from hf_maskllm.errors import MaskFileError, NMViolationError

    mm, _ = _build(tiny_llama, {"target_modules": ["q_proj"]})
    good = _random_nm_masks(mm, 2, 4)
    with pytest.raises(MaskFileError, match="missing"):
        mm.apply_prior({k: v for k, v in list(good.items())[:1]})
    name = next(iter(good))
    with pytest.raises(MaskFileError, match="shape"):
        mm.apply_prior({**good, name: good[name][:, :32]})
    bad = good[name].clone()
    bad[0, :4] = True  # 4 of 4 kept
    with pytest.raises(NMViolationError):
        mm.apply_prior({**good, name: bad})


def test_saved_mask_as_prior_gives_identical_initial_masks(tmp_path):
    source, _ = _build(tiny_llama, {"n": 2, "m": 4, "init_std": 1.0, "seed": 3})
    source.save_pretrained(tmp_path / "mask")
    saved = source.hard_masks()
    target = get_mask_model(tiny_llama(seed=5), MaskConfig(prior=str(tmp_path / "mask"), seed=11))
    fresh = get_mask_model(tiny_llama(seed=5), MaskConfig(seed=11))
    for name, mask in target.hard_masks().items():
        assert torch.equal(mask, saved[name]), name
        assert not torch.equal(fresh.hard_masks()[name], saved[name])  # not true by chance


def test_combined_prior_adds_the_terms_and_leaves_disagreements_to_learning(tmp_path):
    """prior=[saved mask, "magnitude"]: the rule's terms add; where the two agree their candidate leads by
    6 sigma, where they disagree the init noise picks among the candidates they favour equally."""
    from hf_maskllm.priors import compute_prior_masks

    source, _ = _build(tiny_llama, {"init_std": 1.0, "seed": 3})
    source.save_pretrained(tmp_path / "general")
    general = source.hard_masks()
    kwargs = {"seed": 11, "logits_dtype": "float32"}
    combined = get_mask_model(
        tiny_llama(seed=5), MaskConfig(prior=[str(tmp_path / "general"), "magnitude"], **kwargs)
    )
    fresh = get_mask_model(tiny_llama(seed=5), MaskConfig(**kwargs))
    assert combined.mask_config.prior == [str(tmp_path / "general"), "magnitude"]
    magnitude = compute_prior_masks(tiny_llama(seed=5), "magnitude", 2, 4, combined.masked_names)
    cand = candidate_patterns(2, 4)
    agree_groups = disagree_groups = best_groups = 0
    for name, layer in combined.masked_layers().items():
        init = fresh.masked_layers()[name].mask_logits.detach()
        overlaps = [k.reshape(-1, 4).float() @ cand.t() for k in (general[name], magnitude[name])]
        expected = init + 3.0 * init.std() * sum(o - 1 for o in overlaps)
        torch.testing.assert_close(layer.mask_logits.detach(), expected, rtol=0, atol=1e-6)  # no fix-up
        total = overlaps[0] + overlaps[1]
        hard = layer.hard_mask().reshape(-1, 4).float() @ cand.t()
        agree = (overlaps[0] == 2) & (overlaps[1] == 2)
        agree_rows = agree.any(dim=1)
        assert bool((hard[agree_rows] == 2).eq(agree[agree_rows]).all())  # agreement: that candidate
        chosen = total.gather(1, (hard == 2).float().argmax(dim=1, keepdim=True)).squeeze(1)
        best = (chosen == total.max(dim=1).values)[~agree_rows]
        agree_groups += int(agree_rows.sum())
        disagree_groups += int((~agree_rows).sum())
        best_groups += int(best.sum())
    # disagreement: one of the candidates the two favour most, except where the noise beats 3 sigma
    assert agree_groups > 100 and disagree_groups > 100
    assert best_groups > 0.9 * disagree_groups


def test_combined_prior_config_round_trips_and_names_a_bad_source(tmp_path):
    from hf_maskllm.errors import ConfigError

    source, _ = _build(tiny_llama, {"seed": 3})
    source.save_pretrained(tmp_path / "general")
    prior = [str(tmp_path / "general"), "magnitude"]
    mm = get_mask_model(tiny_llama(seed=5), MaskConfig(prior=prior))
    mm.save_pretrained(tmp_path / "out")
    assert MaskConfig.from_pretrained(tmp_path / "out").prior == prior
    assert f"{prior[0]} + magnitude" in (tmp_path / "out" / "README.md").read_text()
    assert MaskConfig(prior=("magnitude",)).prior == "magnitude"  # a one-element list is that prior
    for bad in ([], ["magnitude", "magnitude"], ["magnitude", 3]):
        with pytest.raises(ConfigError, match="distinct"):
            MaskConfig(prior=bad)
    with pytest.raises(ConfigError, match=r"Did you mean prior='sparsegpt'\?"):
        get_mask_model(tiny_llama(seed=5), MaskConfig(prior=[prior[0], "sparsegtp"]))


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
