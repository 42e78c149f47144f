"""Mask sampling at the end of the schedule forms no denormal float, and changes nothing else.

At tau 0.05 and kappa 1000 with logits spread like a trained run (a magnitude prior at the default
strength), many probabilities fall below the float32 normal range (2**-126); unflushed, they make
``W * mask`` and the logits' gradient partly denormal, and every CPU matmul with them 100x slower.
Each test checks that the flushed outputs hold no denormal and equal a float64 reference except
where that reference is itself below the normal range, and that the reference does reach that
range (so the case is exercised). ``W * mask`` is held to a higher floor, ``MASKED_WEIGHT_FLOOR``,
so that its products with activations and gradients in the matmuls stay normal too.
"""

from __future__ import annotations

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)
from torch import nn

from hf_maskllm import MaskConfig
from hf_maskllm.adapters import MaskedLinear
from hf_maskllm.numerics import fused_linear, sampling
from hf_maskllm.numerics.denormals import (
    FLOAT32_TINY,
    LN_FLOAT32_TINY,
    MASKED_WEIGHT_FLOOR,
    is_denormal,
    masked_weight_product,
)
from hf_maskllm.patterns import candidate_patterns

TAU, KAPPA = MaskConfig().tau[1], MaskConfig().kappa[1]  # the end of the default schedule: 0.05, 1000
SEED = 11
# float32 exponents of size kappa / tau * |logit| (hundreds) carry absolute errors of about 1e-4:
# the probabilities they give are exact to about 1e-4 relative, so compare at 1e-3.
RTOL = 1e-3


@pytest.fixture(autouse=True, scope="module")
def fresh_compiled_code():
    """Leave no compiled sampling code behind: a later module compiling other (n, m) from a clean state
    is what that module tests."""
    yield
    torch._dynamo.reset()
    fused_linear._COMPILED.clear()


def spread_logits(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N(0, 0.01) logits plus the magnitude prior at the default strength (alpha sigma per overlap)."""
    cand = candidate_patterns(n, m)
    groups = weight.reshape(-1, m).abs()
    prior = torch.zeros_like(groups).scatter_(1, groups.topk(n, dim=-1).indices, 1.0)
    logits = torch.randn(groups.shape[0], cand.shape[0]) * 0.01
    return logits + MaskConfig().prior_strength * logits.std() * (prior @ cand.t() - n / 2)


def reference_probs(logits: torch.Tensor, seed: int, tau: float, kappa: float) -> torch.Tensor:
    """float64 softmax((kappa * logits - log(-log u)) / tau) with the sampler's noise: never flushed."""
    u = sampling.gumbel_uniform(sampling.seed_tensor(seed), logits.shape[0], logits.shape[1], logits.device)
    return torch.softmax((kappa * logits.double() - torch.log(-torch.log(u.double()))) / tau, dim=-1)


def below_normal(t: torch.Tensor) -> torch.Tensor:
    return (t != 0) & (t.abs() < FLOAT32_TINY)


def assert_flushed_match(
    ours: torch.Tensor, ref: torch.Tensor, name: str, floor: float = FLOAT32_TINY
) -> None:
    """No denormal in ``ours``; equal to ``ref`` (float64) where ``|ref| >= floor`` (by default: in the
    normal range), else zero (or, within float32 rounding of the floor, values just above it)."""
    assert not is_denormal(ours).any(), f"{name}: {int(is_denormal(ours).sum())} denormal values"
    assert ((ref != 0) & (ref.abs() < floor)).any(), (
        f"{name}: the reference never falls below the floor; test exercises nothing"
    )
    ours = ours.double()
    normal = ref.abs() >= floor
    bad = (ours - ref).abs() > RTOL * ref.abs()
    assert not (bad & normal).any(), f"{name}: mismatch at {(bad & normal).nonzero()[:5].tolist()}"
    assert (ours[~normal].abs() < floor * (1 + RTOL)).all(), f"{name}: a below-normal value became large"


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_pass_flushes_probs_and_masked_weight(compiled, dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    logits = spread_logits(weight, 2, 4)
    w_eff, _, probs = fused_linear._run(
        "sample_weight", compiled, weight.reshape(-1, 4), logits, sampling.seed_tensor(SEED), TAU, KAPPA,
        2, 4, False, dtype, "probs",
    )  # fmt: skip
    ref_probs = reference_probs(logits, SEED, TAU, KAPPA)
    assert_flushed_match(probs.t(), ref_probs, "probabilities")
    ref_w = weight.double() * (ref_probs @ candidate_patterns(2, 4, torch.float64)).reshape(weight.shape)
    kept = w_eff[w_eff != 0].float().abs()
    assert kept.min() >= MASKED_WEIGHT_FLOOR  # every product with it in a matmul stays normal
    if dtype == torch.float32:
        assert_flushed_match(w_eff.view(weight.shape), ref_w, "W * mask", MASKED_WEIGHT_FLOOR)
    else:  # rounded to bfloat16 (8 bits): no denormal, and the float32 result rounded
        assert not is_denormal(w_eff).any()
        w32, _, _ = fused_linear._run(
            "sample_weight", compiled, weight.reshape(-1, 4), logits, sampling.seed_tensor(SEED), TAU, KAPPA,
            2, 4, False, torch.float32, "",
        )  # fmt: skip
        torch.testing.assert_close(w_eff.float(), w32, rtol=2**-8, atol=0)
    # The unflushed float32 formula does produce denormals here: what the flush removes.
    plain = torch.softmax((KAPPA * logits - torch.log(-torch.log(sampling.gumbel_uniform(
        sampling.seed_tensor(SEED), *logits.shape, logits.device)))) / TAU, dim=-1)  # fmt: skip
    assert (
        is_denormal(plain).any()
        and is_denormal(weight * (plain @ candidate_patterns(2, 4)).view(48, 64)).any()
    )
    # and normal values below the masked weight's floor, which the floor sets to 0
    between = (ref_w.abs() >= FLOAT32_TINY) & (ref_w.abs() < MASKED_WEIGHT_FLOOR)
    assert between.any() and (w_eff.view(weight.shape)[between] == 0).all()


def test_mid_schedule_masked_weight_is_zero_or_above_the_floor():
    """Midway through the default schedule many probabilities lie between 1e-38 and 1e-20: ``W * mask``
    from them is 0 where below ``MASKED_WEIGHT_FLOOR`` and the float64 formula elsewhere, so its products
    with activations in the layer's matmul (and with gradients in the backward pass) are never denormal."""
    config = MaskConfig()
    (tau0, tau1), (kappa0, kappa1) = config.tau, config.kappa
    tau = 0.3
    kappa = kappa0 + (kappa1 - kappa0) * (tau0 - tau) / (tau0 - tau1)  # the linear schedules' pair
    torch.manual_seed(6)
    weight = torch.randn(64, 128)
    logits = spread_logits(weight, 2, 4)
    w_eff, _, _ = fused_linear._run(
        "sample_weight", False, weight.reshape(-1, 4), logits, sampling.seed_tensor(SEED), tau, kappa,
        2, 4, False, torch.float32, "",
    )  # fmt: skip
    mask = reference_probs(logits, SEED, tau, kappa) @ candidate_patterns(2, 4, torch.float64)
    ref = weight.double() * mask.reshape(weight.shape)
    between = (ref.abs() >= FLOAT32_TINY) & (ref.abs() < MASKED_WEIGHT_FLOOR)
    assert between.float().mean() > 0.01  # many entries the normal-range flush alone would keep
    assert_flushed_match(w_eff.view(weight.shape), ref, "W * mask", MASKED_WEIGHT_FLOOR)
    x = torch.randn(9, 128)
    products = x[:, None, :] * w_eff.view(weight.shape)[None]  # every product the forward's matmul sums
    assert not is_denormal(products).any()
    assert is_denormal(x[:, None, :] * ref.float()[None]).any()  # which the plain product would not avoid


# The flush is the same code for every N:M: compiled, it is checked on 2:4; 4:8 (70 candidates) runs eager,
# as compiling it takes over a minute on a CPU (tests/test_sampling.py checks a compiled 3:8 pass against
# float64, without denormals).
@pytest.mark.parametrize(
    "n,m,compiled", [(2, 4, False), (4, 8, False), pytest.param(2, 4, True, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("loss_scale", [1.0, 1e-6])  # 1e-6: gradients of a loss averaged over many tokens
def test_fused_backward_flushes_logits_gradient(n, m, compiled, loss_scale):
    torch.manual_seed(1)
    weight = torch.randn(32, 64)
    base = spread_logits(weight, n, m)
    x0 = torch.randn(7, 64)
    upstream = torch.randn(7, 32) * loss_scale
    logits = base.clone().requires_grad_()
    x = x0.clone().requires_grad_()
    y, reg = fused_linear.masked_linear(
        x, weight, None, logits, n, m, sampling.seed_tensor(SEED), TAU, KAPPA, False, True, compiled
    )
    ((y * upstream).sum() + 1e-3 * loss_scale * reg).backward()

    ref_logits = base.double().requires_grad_()
    probs = reference_probs(ref_logits, SEED, TAU, KAPPA)
    probs.retain_grad()
    masked = weight.double() * (probs @ candidate_patterns(n, m, torch.float64)).reshape(weight.shape)
    ref_y = x0.double() @ masked.t()
    ((ref_y * upstream.double()).sum() + 1e-3 * loss_scale * masked.square().sum()).backward()

    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), upstream.double() @ masked, rtol=1e-5, atol=1e-5 * loss_scale)
    grad, ref = logits.grad.double(), ref_logits.grad
    assert not is_denormal(logits.grad).any(), f"{int(is_denormal(logits.grad).sum())} denormal gradients"
    assert below_normal(ref).any()
    # Per element: p * (g - dot) * kappa / tau; float32 sums of g carry ~1e-6 of the largest g.
    tol = RTOL * ref.abs() + 1e-5 * probs.detach() * probs.grad.abs().max() * KAPPA / TAU
    tiny_p = probs.detach() < FLOAT32_TINY
    assert (grad[tiny_p] == 0).all()  # an underflowed probability has a zero gradient
    normal = ref.abs() >= FLOAT32_TINY
    off = ((grad - ref).abs() > tol) & ~tiny_p & normal
    assert not off.any(), f"mismatch at {off.nonzero()[:5].tolist()}: {grad[off][:5]} vs {ref[off][:5]}"
    # Below the normal range: zeros (or, within float32 rounding of the boundary, the smallest normals).
    assert (grad[~normal].abs() < FLOAT32_TINY * (1 + RTOL)).all()


def test_bf16_autocast_step_has_no_denormal_gradient():
    torch.manual_seed(2)
    weight = torch.randn(32, 64)
    logits = spread_logits(weight, 2, 4).bfloat16().requires_grad_()
    x = torch.randn(7, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = fused_linear.masked_linear(x, weight, None, logits, 2, 4, sampling.seed_tensor(3), TAU, KAPPA)
    assert y.dtype == torch.bfloat16
    (y.float().square().sum() * 1e-6).backward()  # the size of a loss averaged over many tokens
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()
    assert logits.grad.float().abs().max() > 0
    assert not is_denormal(logits.grad).any()


def test_eager_masked_weight_with_unfrozen_base_layer_is_flushed():
    """The plain-autograd path (the base layer unfrozen): W * mask, W's and the logits' gradients."""
    torch.manual_seed(3)
    base = nn.Linear(256, 64)
    layer = MaskedLinear(base, 2, 4, spread_logits(base.weight.detach(), 2, 4)).train()
    layer.schedule.update(tau=TAU, kappa=KAPPA)
    base.weight.requires_grad_(True)
    torch.manual_seed(4)
    masked = layer.masked_weight()
    assert not is_denormal(masked).any()
    torch.manual_seed(4)
    plain = base.weight.detach() * layer.sample_mask().detach()
    assert is_denormal(plain).any()  # the unflushed product does underflow
    keep = plain.abs() >= MASKED_WEIGHT_FLOOR
    assert torch.equal(masked.detach()[keep], plain[keep])  # flushing is exact elsewhere
    assert (masked.detach()[~keep] == 0).all()
    layer(torch.randn(5, 256)).square().sum().backward()
    for name, grad in (("weight", base.weight.grad), ("logits", layer.mask_logits.grad)):
        assert grad.abs().max() > 0 and not is_denormal(grad).any(), name


def test_masked_weight_product_keeps_the_plain_gradients():
    torch.manual_seed(5)
    weight = torch.randn(8, 16, requires_grad=True)
    mask = torch.tensor([1.0, 0.5, 3e-38, 1e-39 * 1e3, 1e-30, 0.0, 2e-37, 1e-3]).repeat(16).view(8, 16)
    mask.requires_grad_()
    upstream = torch.randn(8, 16)
    (masked_weight_product(weight, mask) * upstream).sum().backward()
    plain = weight.detach() * mask.detach()
    out = masked_weight_product(weight.detach(), mask.detach())
    keep = plain.abs() >= MASKED_WEIGHT_FLOOR
    assert torch.equal(out[keep], plain[keep]) and (out[~keep] == 0).all() and (~keep).any()
    torch.testing.assert_close(mask.grad, upstream * weight.detach(), rtol=0, atol=0)
    expected = upstream * mask.detach()
    expected = torch.where(expected.abs() < FLOAT32_TINY, 0.0, expected)
    torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)


def test_exp_clamp_is_the_smallest_float32_with_a_normal_exponential():
    """The sampler evaluates exp at this bound on every underflowed lane: it must not give a denormal."""
    bound = torch.full((64,), LN_FLOAT32_TINY)
    assert (bound.exp() >= FLOAT32_TINY).all()
    below = torch.nextafter(bound, torch.tensor(-100.0))
    assert (below.exp() < FLOAT32_TINY).all()  # so exp(x) for x under the bound is below the normal range
