"""The Gumbel-softmax mask sampler: values and gradients against float64, straight-through samples, the
counter-based noise (the fused masked linear built on it: test_fused_linear.py)."""

from __future__ import annotations

import pytest
import torch
from models import single_thread  # noqa: F401  (autouse fixture)

from hf_maskllm.numerics import sampling
from hf_maskllm.patterns import candidate_patterns

NM = [(2, 4), (1, 4), (3, 8), (4, 8)]


def reference_mask(logits: torch.Tensor, seed: int, n: int, m: int, tau: float, kappa: float) -> torch.Tensor:
    """Plain float64 autograd: softmax((kappa * logits - log(-log u)) / tau) @ candidates, same noise."""
    u = sampling.gumbel_uniform(sampling.seed_tensor(seed), logits.shape[0], logits.shape[1], logits.device)
    gumbel = -torch.log(-torch.log(u.double()))
    return torch.softmax((kappa * logits.double() + gumbel) / tau, dim=-1) @ candidate_patterns(
        n, m, torch.float64
    )


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("tau,kappa", [(4.0, 100.0), (0.5, 3.0)])
def test_soft_mask_matches_float64_reference_values_and_gradients(n, m, tau, kappa):
    torch.manual_seed(0)
    cand = candidate_patterns(n, m)
    base = torch.randn(37, cand.shape[0]) * 0.05
    upstream = torch.randn(37, m)
    logits = base.clone().requires_grad_()
    out = sampling.sample_soft_mask(logits, cand, tau, kappa, seed=123)
    (out * upstream).sum().backward()
    ref_logits = base.double().requires_grad_()
    ref = reference_mask(ref_logits, 123, n, m, tau, kappa)
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    scale = kappa / tau  # gradients are of this size: compare at float32 precision of it
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-4, atol=2e-6 * scale)
    # Every soft group keeps exactly n in expectation.
    torch.testing.assert_close(out.sum(-1), torch.full((37,), float(n)), rtol=0, atol=1e-5)


def test_seed_reproducible_and_fresh_by_default():
    cand = candidate_patterns(2, 4)
    logits = torch.randn(64, 6)
    a = sampling.sample_soft_mask(logits, cand, 1.0, 1.0, seed=5)
    assert torch.equal(a, sampling.sample_soft_mask(logits, cand, 1.0, 1.0, seed=5))
    assert not torch.equal(a, sampling.sample_soft_mask(logits, cand, 1.0, 1.0, seed=6))
    assert not torch.equal(
        a, sampling.sample_soft_mask(logits, cand, 1.0, 1.0, seed=5 + 2**32)
    )  # high word used
    torch.manual_seed(0)
    c = sampling.sample_soft_mask(logits, cand, 1.0, 1.0)
    d = sampling.sample_soft_mask(logits, cand, 1.0, 1.0)
    assert not torch.equal(c, d)
    torch.manual_seed(0)
    assert torch.equal(c, sampling.sample_soft_mask(logits, cand, 1.0, 1.0))


def test_hard_straight_through_forward_is_one_hot_backward_is_soft():
    torch.manual_seed(1)
    cand = candidate_patterns(2, 4)
    logits = (torch.randn(50, 6) * 0.3).requires_grad_()
    upstream = torch.randn(50, 4)
    out = sampling.sample_soft_mask(logits, cand, 2.0, 3.0, hard=True, seed=9)
    assert set(out.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(out.sum(-1), torch.full((50,), 2.0))
    (out * upstream).sum().backward()
    hard_grad = logits.grad.clone()
    logits.grad = None
    (sampling.sample_soft_mask(logits, cand, 2.0, 3.0, seed=9) * upstream).sum().backward()
    torch.testing.assert_close(hard_grad, logits.grad)


def test_uniform_never_reaches_zero_or_one():
    """The extreme bit patterns map strictly inside (0, 1): the Gumbel noise stays finite."""
    bits = torch.tensor([0, -1, 2**31 - 1, -(2**31), 511, -512], dtype=torch.int32)
    u = sampling.bits_to_uniform(bits)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_hash_noise_statistics():
    """Uniform in (0, 1), Gumbel moments, no correlation between neighbours or between seeds."""
    u = sampling.gumbel_uniform(sampling.seed_tensor(3), 100_000, 6, torch.device("cpu")).double()
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 above ~43.8
    g = -torch.log(-torch.log(u))
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.03
    flat = u.flatten() - 0.5
    assert abs((flat[1:] * flat[:-1]).mean().item() / flat.var().item()) < 0.01  # lag-1 autocorrelation
    other = sampling.gumbel_uniform(sampling.seed_tensor(4), 100_000, 6, torch.device("cpu")).double() - 0.5
    assert abs((flat * other.flatten()).mean().item() / flat.var().item()) < 0.01
    bits = sampling.hash_bits(sampling.seed_tensor(3), 4096, 8, torch.device("cpu"))
    ones = torch.stack([(bits >> b) & 1 for b in range(32)]).double().mean(dim=(1, 2))
    assert ((ones - 0.5).abs() < 0.02).all()  # every bit position balanced


@pytest.mark.parametrize("seed", [3, 2**40 + 7])
def test_hash_noise_is_independent_within_a_group_and_gives_gumbel_max_frequencies(seed):
    """What sampling relies on: a group's C noises are independent (adjacent candidates' joint
    histogram is flat) and ``argmax(logits + g)`` picks candidate c with probability ``softmax(logits)_c``."""
    groups = 1_000_000
    u = sampling.gumbel_uniform(sampling.seed_tensor(seed), groups, 6, torch.device("cpu")).double()
    first, second = (u[:, :-1] * 32).long().flatten(), (u[:, 1:] * 32).long().flatten()
    counts = torch.bincount(first * 32 + second, minlength=1024).double()
    expected = first.numel() / 1024
    assert ((counts - expected) ** 2 / expected).sum().item() < 1230  # 1023 dof: mean 1023, sd 45
    logits = torch.tensor([0.5, -1.0, 0.0, 1.2, -0.3, 0.1], dtype=torch.float64)
    chosen = torch.bincount((logits - torch.log(-torch.log(u))).argmax(dim=1), minlength=6).double()
    expected = logits.softmax(dim=0) * groups
    assert ((chosen - expected) ** 2 / expected).sum().item() < 20.5  # 5 dof: p < 0.001
