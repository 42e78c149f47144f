"""A new mask's initial logits: the seeded random init, the MaskLLM prior rule, and a config's prior
resolved to hard masks (a one-shot method on calibration data, a saved mask, or several of them)."""

from __future__ import annotations

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)
from torch import nn

from hf_maskllm import MaskConfig, MaskedLinear, MaskModel, get_mask_model
from hf_maskllm.data import calibration_tokens
from hf_maskllm.errors import ConfigError, MaskFileError, NMViolationError
from hf_maskllm.modules import dense_weight_view
from hf_maskllm.patterns import candidate_patterns
from hf_maskllm.priors import compute_prior_masks


def _build(factory, kwargs, seed: int = 0) -> tuple[MaskModel, nn.Module]:
    base = factory()
    return get_mask_model(base, MaskConfig(**{"seed": seed, **kwargs})), base


def _first_layer(mm: MaskModel) -> tuple[str, MaskedLinear]:
    name = mm.masked_names[0]
    return name, mm.masked_layers()[name]


# ---------------------------------------------------------------------------------------------- random init
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


# ---------------------------------------------------------------------------------------------- the prior rule
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
    mm.apply_prior(prior)  # the config's strength
    alpha = mm.mask_config.prior_strength
    cand = candidate_patterns(n, m)
    for name, layer in mm.masked_layers().items():
        assert torch.equal(layer.hard_mask(), prior[name]), name
        # the rule: logits += alpha * std * (overlap - n/2), the prior's candidate raised further if needed
        std = init[name].std()
        overlap = prior[name].reshape(-1, m).float() @ cand.t()
        expected = init[name] + alpha * std * (overlap - n / 2)
        prior_idx = (overlap == n).float().argmax(dim=1)
        new = layer.mask_logits.detach()
        is_prior = torch.zeros_like(new, dtype=torch.bool).scatter_(1, prior_idx[:, None], True)
        torch.testing.assert_close(new[~is_prior], expected[~is_prior], rtol=0, atol=1e-7)
        assert bool((new[is_prior] >= expected[is_prior] - 1e-7).all())
        # in most groups the rule alone already makes the prior win: those logits are untouched (fewer
        # for 4:8, where 16 of the 70 candidates share 3 of the 4 kept positions and get +alpha sigma too)
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
    mm, _ = _build(
        tiny_llama, {"target_modules": ["q_proj"], "logits_dtype": "float32", "prior_strength": 3.0}
    )
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


# ---------------------------------------------------------------------------------------------- saved masks and calibration as priors
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
    2 alpha sigma, where they disagree the init noise picks among the candidates they favour equally."""
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
        expected = init + combined.mask_config.prior_strength * init.std() * sum(o - 1 for o in overlaps)
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


class _CharTokenizer:
    """Characters as token ids (< 128): enough to calibrate a tiny model on real text."""

    def __call__(self, text, return_tensors=None, verbose=True):
        ids = [min(ord(c), 127) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_get_mask_model_calibrates_from_texts_and_starts_at_the_prior(method):
    """get_mask_model(prior=..., calibration_data=texts, tokenizer=...): the initial hard masks are the prior."""
    texts = [f"Article {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 for i in range(8)]
    config = MaskConfig(prior=method, calibration_samples=4, calibration_seqlen=64, seed=3)
    tokens = calibration_tokens(texts, _CharTokenizer(), num_samples=4, seqlen=64, seed=3)
    model = tiny_llama()
    names = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    expected = compute_prior_masks(model, method, 2, 4, names, calibration=tokens, progress=False)
    mask_model = get_mask_model(model, config, calibration_data=texts, tokenizer=_CharTokenizer())
    got = mask_model.hard_masks()
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    with pytest.raises(ConfigError, match="tokenizer"):
        get_mask_model(tiny_llama(), MaskConfig(prior=method), calibration_data=texts)
    with pytest.raises(ConfigError, match="calibration"):
        get_mask_model(tiny_llama(), MaskConfig(prior=method))


# ---------------------------------------------------------------------------------------------- Wanda order
def test_wanda_order_matches_a_float64_hand_computation_and_keeps_the_lead():
    """``logits - beta * std * clip(log e_c - mean log e, 3)``, ``e_c`` the pruned ``(W_j ||X_j||)^2``; where
    that lets another candidate overtake the prior's, the prior's is lifted just above it."""
    from hf_maskllm.adapters.prior_init import prior_logits, wanda_order

    gen = torch.Generator().manual_seed(7)
    weight, norms = torch.randn(16, 32, generator=gen), torch.rand(32, generator=gen) * 3
    prior = candidate_patterns(2, 4, dtype=torch.bool)[torch.randint(0, 6, (128,), generator=gen)].reshape(
        16, 32
    )
    logits = prior_logits(torch.randn(128, 6, generator=gen) * 0.01, prior, 2, 4, 4.0, 0.01)
    lead = logits.argmax(dim=1)
    out = wanda_order(logits, weight, norms, 2, 4, beta=4.0, init_std=0.01)

    cand = candidate_patterns(2, 4, torch.float64)
    error = ((weight.double() * norms.double()) ** 2).reshape(-1, 4) @ (1 - cand).t()  # [G, C]
    log_error = error.log()
    expected = logits.double() - 4.0 * 0.01 * (log_error - log_error.mean(dim=1, keepdim=True)).clamp(-3, 3)
    assert torch.equal(out.argmax(dim=1), lead)  # the hard mask is the prior's
    lifted = expected.argmax(dim=1) != lead
    assert lifted.any() and (~lifted).any()  # both cases occur
    torch.testing.assert_close(out.double()[~lifted], expected[~lifted], rtol=0, atol=1e-6)
    others = torch.ones_like(expected, dtype=torch.bool).scatter_(1, lead[:, None], False)
    torch.testing.assert_close(
        out.double()[lifted][others[lifted]], expected[lifted][others[lifted]], rtol=0, atol=1e-6
    )
    top_other = expected[lifted].masked_fill(~others[lifted], -float("inf")).amax(dim=1)
    assert (out.double()[lifted, lead[lifted]] > top_other).all()
    # among the other candidates, a lower Wanda error starts higher
    delta = out.double() - logits.double()
    d, e = delta[others].view(-1, 5), log_error[others].view(-1, 5)
    lower = e[:, :, None] < e[:, None, :]  # candidate i prunes less Wanda error than j
    assert (d[:, :, None] >= d[:, None, :] - 1e-6)[lower].all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wanda_order_keeps_the_lead_after_rounding_to_16_bits(dtype):
    from hf_maskllm.adapters.prior_init import prior_logits, wanda_order

    gen = torch.Generator().manual_seed(8)
    weight, norms = torch.randn(64, 64, generator=gen), torch.rand(64, generator=gen)
    prior = candidate_patterns(2, 4, dtype=torch.bool)[torch.randint(0, 6, (1024,), generator=gen)].reshape(
        64, 64
    )
    logits = prior_logits((torch.randn(1024, 6, generator=gen) * 0.01).to(dtype), prior, 2, 4, 4.0, 0.01)
    out = wanda_order(logits, weight, norms, 2, 4, beta=10.0, init_std=0.01)
    assert out.dtype == dtype
    assert torch.equal(out.argmax(dim=1), logits.argmax(dim=1))


def test_input_norms_are_the_layer_inputs_l2_norms_over_every_token():
    from hf_maskllm.priors.wanda import input_norms

    model = tiny_llama().train()
    ids = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(9))
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]
    norms = input_norms(model, names, ids, batch_size=2)
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    torch.testing.assert_close(
        norms[names[0]].double(), x.double().pow(2).sum((0, 1)).sqrt(), rtol=1e-5, atol=0
    )
    assert norms[names[1]].shape == (model.config.intermediate_size,) and (norms[names[1]] > 0).all()
    torch.testing.assert_close(input_norms(model, names, ids, batch_size=5)[names[1]], norms[names[1]])
    assert model.training  # left as it was (the pass itself runs in eval mode)


def test_get_mask_model_fills_in_the_wanda_strength_and_refuses_what_cannot_apply(tmp_path):
    """Default: 4.0 with a prior and calibration data (the starting hard mask is still the prior's, the
    logits differ), 0.0 without calibration data; an explicit strength that cannot apply names the fix; the
    saved config holds the value used; the paper's config starts without the order."""
    from hf_maskllm.adapters.config import PAPER_MASK_CONFIG

    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(10))
    ordered = get_mask_model(tiny_llama(), MaskConfig(prior="wanda"), calibration_data=ids)
    plain = get_mask_model(tiny_llama(), MaskConfig(prior="wanda", wanda_strength=0.0), calibration_data=ids)
    assert ordered.mask_config.wanda_strength == 4.0 and plain.mask_config.wanda_strength == 0.0
    for name, mask in plain.hard_masks().items():
        assert torch.equal(ordered.hard_masks()[name], mask), name
    assert any(
        not torch.equal(layer.mask_logits, plain.masked_layers()[name].mask_logits)
        for name, layer in ordered.masked_layers().items()
    )
    paper = get_mask_model(tiny_llama(), MaskConfig(prior="wanda", **PAPER_MASK_CONFIG), calibration_data=ids)
    assert paper.mask_config.wanda_strength == 0.0
    assert get_mask_model(tiny_llama(), MaskConfig(prior="magnitude")).mask_config.wanda_strength == 0.0
    assert get_mask_model(tiny_llama(), MaskConfig()).mask_config.wanda_strength == 0.0  # no prior
    with pytest.raises(ConfigError, match="calibration_data="):
        get_mask_model(tiny_llama(), MaskConfig(prior="magnitude", wanda_strength=2.0))
    with pytest.raises(ConfigError, match="prior is None"):
        get_mask_model(tiny_llama(), MaskConfig(wanda_strength=2.0), calibration_data=ids)
    ordered.save_pretrained(tmp_path / "mask")
    assert MaskConfig.from_pretrained(tmp_path / "mask").wanda_strength == 4.0
    plain.save_pretrained(
        tmp_path / "plain"
    )  # the value older files mean: left out, so older versions read it
    assert "wanda_strength" not in (tmp_path / "plain" / "mask_config.json").read_text()
    assert MaskConfig.from_pretrained(tmp_path / "plain").wanda_strength == 0.0
