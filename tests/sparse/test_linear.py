"""SparseLinear on CPU: every forward route against the dense reference, gradients, and the dense-weight cache."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import single_thread  # noqa: F401  (autouse fixture)
from transformers.pytorch_utils import Conv1D

from hf_maskllm.kernels.cpu_ops import CPU_DECODE_MAX_TOKENS
from hf_maskllm.sparse import SparseLinear, set_dense_cache


def nm_linear(
    out_features: int, in_features: int, n: int, m: int, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features).to(dtype)
    with torch.no_grad():
        groups = linear.weight.view(out_features, -1, m)
        groups.scatter_(-1, groups.abs().argsort(dim=-1)[..., : m - n], 0.0)
        linear.bias.normal_()
    return linear


CASES = [(2, 4, 37, 64), (1, 4, 16, 24), (3, 8, 23, 40), (4, 8, 8, 16)]


# fp32: the direct kernel sums in another order than the dense GEMM; bf16: both round one float32 sum
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m,out_f,in_f", CASES)
@pytest.mark.parametrize("tokens", [1, 8, 9, 40])  # the direct kernel (<= 8 tokens) and expand + GEMM
def test_every_cpu_route_matches_dense(n, m, out_f, in_f, dtype, tokens):
    dense = nm_linear(out_f, in_f, n, m, dtype)
    sparse = SparseLinear.from_dense(dense, n, m)
    assert sparse.cache_dense is None  # the default: no dense copy where a kernel exists
    x = torch.randn(tokens, in_f, dtype=dtype)
    expected = F.linear(x, dense.weight.detach(), dense.bias.detach())
    with torch.no_grad():
        direct = sparse(x)
        assert sparse._cache is None  # the CPU kernels read the compressed weight
        torch.testing.assert_close(direct, expected, **TOL[dtype])
        if tokens > CPU_DECODE_MAX_TOKENS and dtype == torch.float32:  # the same GEMM on the same bits
            assert torch.equal(direct, expected)
        torch.testing.assert_close(
            sparse(x.view(1, tokens, in_f)), direct.view(1, tokens, out_f), rtol=0, atol=0
        )
        set_dense_cache(sparse, True)  # opt-in: the decompressed weight is kept and serves F.linear
        cached = sparse(x)
        assert sparse._cache is not None
        torch.testing.assert_close(cached, expected, rtol=0, atol=0)
        set_dense_cache(sparse, False)
        assert sparse._cache is None
        torch.testing.assert_close(sparse(x), direct, rtol=0, atol=0)
        assert sparse._cache is None
    torch.testing.assert_close(sparse(x), expected, **TOL[dtype])  # grad enabled: the training route


def test_float64_and_autocast_take_the_dense_routes():
    dense = nm_linear(16, 32, 2, 4, torch.float32)
    sparse = SparseLinear.from_dense(dense, 2, 4)
    x = torch.randn(3, 32)
    with torch.no_grad():
        sparse64 = SparseLinear.from_dense(copy.deepcopy(dense).double(), 2, 4)
        torch.testing.assert_close(
            sparse64(x.double()), F.linear(x.double(), dense.weight.double(), dense.bias.double())
        )
        for tokens in (3, 20):  # under autocast the output dtype is autocast's, whatever the route
            xt = torch.randn(tokens, 32)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = sparse(xt), dense(xt)
            assert got.dtype == want.dtype == torch.bfloat16
            torch.testing.assert_close(got, want)


def test_without_cpu_kernels_the_cached_route_runs(monkeypatch):
    import hf_maskllm.kernels.route as route

    monkeypatch.setattr(route, "cpu_kernels", lambda: None)
    dense = nm_linear(16, 32, 2, 4, torch.float32)
    sparse = SparseLinear.from_dense(dense, 2, 4)
    x = torch.randn(3, 32)
    with torch.no_grad():
        y = sparse(x)
    assert sparse._cache is not None  # dense speed where nothing reads the compressed weight
    torch.testing.assert_close(y, F.linear(x, dense.weight, dense.bias), rtol=0, atol=0)
    set_dense_cache(sparse, False)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), y, rtol=0, atol=0)
    assert sparse._cache is None


@pytest.mark.parametrize("n,m,out_f,in_f", CASES)
def test_gradients_match_dense_at_kept_positions(n, m, out_f, in_f):
    dense = nm_linear(out_f, in_f, n, m, torch.float32)
    sparse = SparseLinear.from_dense(dense, n, m)
    x = torch.randn(4, in_f)
    x_dense, x_sparse = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(4, out_f)
    (dense(x_dense) * g).sum().backward()
    (sparse(x_sparse) * g).sum().backward()
    torch.testing.assert_close(x_sparse.grad, x_dense.grad)
    torch.testing.assert_close(sparse.bias.grad, dense.bias.grad)
    # values.grad is the dense weight gradient read at the stored positions, nothing else
    torch.testing.assert_close(sparse.values.grad, dense.weight.grad.gather(1, sparse.kept_columns()))
    assert sparse.values.grad.shape[1] == in_f * n // m


@pytest.mark.parametrize("tokens", [2, 40])
def test_frozen_values_pass_input_gradients_without_a_cache(tokens):
    dense = nm_linear(16, 32, 2, 4, torch.float32)
    sparse = SparseLinear.from_dense(dense, 2, 4)
    sparse.values.requires_grad_(False)
    x = torch.randn(tokens, 32, requires_grad=True)
    y = sparse(x)  # LoRA-style training: a freshly expanded weight, kept by autograd only
    assert sparse._cache is None
    torch.testing.assert_close(y, F.linear(x, dense.weight, dense.bias), rtol=0, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, dense.weight.detach().sum(0).expand(tokens, -1))


def reference(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.linear(x, layer.dense_weight(), layer.bias)


@pytest.mark.parametrize("cache", [None, True])
def test_forward_follows_optimizer_steps_load_state_dict_and_dtype_changes(cache):
    sparse = SparseLinear.from_dense(nm_linear(16, 32, 2, 4, torch.float32), 2, 4)
    set_dense_cache(sparse, cache)
    exact = dict(rtol=0, atol=0) if cache else dict(rtol=1e-6, atol=1e-6)  # the kernel sums in its own order
    x = torch.randn(2, 32)
    with torch.no_grad():
        before = sparse(x)
    # an optimizer step (foreach in-place update) changes values: the cache must not serve the old weight
    opt = torch.optim.SGD([sparse.values], lr=0.5)
    sparse.values.grad = torch.ones_like(sparse.values)
    opt.step()
    with torch.no_grad():
        after = sparse(x)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, reference(sparse, x), **exact)
    # loading other values (copy_ into the parameter)
    other = SparseLinear.from_dense(nm_linear(16, 32, 2, 4, torch.float32, seed=5), 2, 4)
    sparse.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), reference(other, x), **exact)
    # writes through .data bypass version counters: clear_cache() is the documented way
    with torch.no_grad():
        sparse(x)
    sparse.values.data.mul_(2.0)
    sparse.clear_cache()
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), reference(sparse, x), **exact)
    # a dtype change drops the cache and serves the new dtype
    sparse.to(torch.bfloat16)
    assert sparse._cache is None
    xb = x.bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(
            sparse(xb), reference(sparse, xb), **(exact if cache else TOL[torch.bfloat16])
        )
    sparse.train()
    assert sparse._cache is None


def test_weight_is_a_copy_and_to_dense_rebuilds_conv1d():
    torch.manual_seed(0)
    conv = Conv1D(12, 16)  # weight [in, out]
    with torch.no_grad():
        w = conv.weight.t().contiguous()
        groups = w.view(12, -1, 4)
        groups.scatter_(-1, groups.abs().argsort(dim=-1)[..., :2], 0.0)
        conv.weight.copy_(w.t())
        conv.bias.normal_()
    sparse = SparseLinear.from_dense(conv, 2, 4)
    assert sparse.conv1d
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), conv(x))
        sparse.weight.add_(1.0)  # a write to the copy does not change the layer
        torch.testing.assert_close(sparse(x), conv(x))
    back = sparse.to_dense()
    assert (
        isinstance(back, Conv1D)
        and torch.equal(back.weight, conv.weight)
        and torch.equal(back.bias, conv.bias)
    )
