"""The Gumbel-softmax mask sampler: values, gradients, memory, reproducibility."""

from __future__ import annotations

import pytest
import torch

from hf_maskllm.adapters import sampling
from hf_maskllm.patterns import candidate_patterns

NM = [(2, 4), (1, 4), (3, 8), (4, 8)]


def reference_mask(logits: torch.Tensor, u: torch.Tensor, cand: torch.Tensor, tau: float, kappa: float):
    """Plain autograd: softmax((kappa * logits - log(-log u)) / tau) @ candidates."""
    gumbel = -torch.log(-torch.log(u))
    return torch.softmax((kappa * logits + gumbel) / tau, dim=-1) @ cand


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("tau,kappa", [(4.0, 100.0), (0.5, 3.0)])
def test_matches_autograd_reference_values_and_gradients(n, m, tau, kappa):
    torch.manual_seed(0)
    cand = candidate_patterns(n, m)
    logits = (torch.randn(37, cand.shape[0]) * 0.05).requires_grad_()
    upstream = torch.randn(37, m)
    out = sampling.sample_soft_mask(logits, cand, tau, kappa, seed=123)
    (out * upstream).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    u = sampling._uniform(logits.shape, 123, logits.device)
    ref = reference_mask(logits, u, cand, tau, kappa)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # float32 softmax backward computed in a different order: a few ulps of the gradient's scale kappa / tau.
    torch.testing.assert_close(grad, logits.grad, rtol=1e-4, atol=1e-6 * kappa / tau)
    # Every soft group keeps exactly n in expectation.
    torch.testing.assert_close(out.sum(-1), torch.full((37,), float(n)), rtol=0, atol=1e-5)


def test_seed_reproducible_and_fresh_by_default():
    cand = candidate_patterns(2, 4)
    logits = torch.randn(64, 6)
    a = sampling.sample_soft_mask(logits, cand, 1.0, 1.0, seed=5)
    b = sampling.sample_soft_mask(logits, cand, 1.0, 1.0, seed=5)
    assert torch.equal(a, b)
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


def test_gumbel_noise_statistics():
    u = sampling._uniform(torch.Size([200_000]), 3, torch.device("cpu"))
    g = -torch.log(-torch.log(u))
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.03


def test_backward_keeps_no_per_group_tensor_alive():
    """Only the logits (a parameter, no copy) and the candidates are saved: no [G, C] noise or probabilities."""
    cand = candidate_patterns(2, 4)
    logits = torch.randn(4096, 6, requires_grad=True)

    def saved_by(fn) -> list[torch.Tensor]:
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return saved

    u = sampling._uniform(logits.shape, 0, logits.device)
    plain = saved_by(lambda: reference_mask(logits, u, cand, 1.0, 100.0))
    # plain autograd keeps the [G, C] probabilities (and the hooks see them)
    assert any(t.numel() >= logits.numel() and t.data_ptr() != logits.data_ptr() for t in plain)
    ours = saved_by(lambda: sampling.sample_soft_mask(logits, cand, 1.0, 100.0, seed=0))
    assert ours
    for t in ours:
        assert t.data_ptr() == logits.data_ptr() or t.numel() <= cand.numel()


@pytest.mark.slow
def test_compiled_sampling_matches_eager():
    torch.manual_seed(0)
    cand = candidate_patterns(2, 4)
    logits = (torch.randn(1000, 6) * 0.05).requires_grad_()
    upstream = torch.randn(1000, 4)
    eager = sampling.sample_soft_mask(logits, cand, 2.0, 150.0, seed=11)
    (eager * upstream).sum().backward()
    eager_grad = logits.grad.clone()
    logits.grad = None
    sampling.set_compiled_sampling(True)
    try:
        fused = sampling.sample_soft_mask(logits, cand, 2.0, 150.0, seed=11)
        (fused * upstream).sum().backward()
    finally:
        sampling.set_compiled_sampling(False)
    # inductor reorders float32 reductions: a few ulps (of the gradient's scale kappa / tau = 75 for the grads)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad, eager_grad, rtol=1e-4, atol=75 * 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_math_under_autocast_and_16_bit_logit_gradients(dtype):
    torch.manual_seed(0)
    cand = candidate_patterns(2, 4)
    base = torch.randn(64, 6) * 0.05
    upstream = torch.randn(64, 4)
    ref_logits = base.clone().requires_grad_()
    ref = sampling.sample_soft_mask(ref_logits, cand, 2.0, 100.0, seed=4)
    (ref * upstream).sum().backward()
    with torch.autocast("cpu", dtype=dtype):
        out = sampling.sample_soft_mask(base.clone(), cand, 2.0, 100.0, seed=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    low = base.to(dtype).requires_grad_()
    (sampling.sample_soft_mask(low, cand, 2.0, 100.0, seed=4) * upstream).sum().backward()
    assert low.grad.dtype == dtype
    # the 16-bit logits themselves are rounded (the forward differs slightly): compare loosely, at the grad scale 50
    torch.testing.assert_close(low.grad.float(), ref_logits.grad, rtol=0.1, atol=0.05 * 50)
