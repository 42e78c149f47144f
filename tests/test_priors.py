"""One-shot N:M priors: magnitude, Wanda, SparseGPT, and the sequential calibration driver."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)
from transformers.pytorch_utils import Conv1D

from hf_maskllm.errors import ConfigError, DataError, TargetError
from hf_maskllm.patterns import count_nm_violations, mask_to_indices
from hf_maskllm.priors import (
    PRIOR_METHODS,
    HessianStats,
    compute_prior_masks,
    find_decoder_blocks,
    magnitude_mask,
    sparsegpt_layer,
    sparsegpt_prune,
    wanda_mask,
)
from hf_maskllm.priors import calibration as calibration_mod

VOCAB = 128


def tiny_llama(layers: int = 2, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


def tiny_opt() -> OPTForCausalLM:
    torch.manual_seed(0)
    config = OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
    )
    return OPTForCausalLM(config).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "opt": tiny_opt}


def target_names(model: nn.Module) -> list[str]:
    """Every Linear / Conv1D inside the decoder blocks (what MaskLLM masks)."""
    list_name, _ = find_decoder_blocks(model)
    return [
        name
        for name, mod in model.named_modules()
        if name.startswith(list_name + ".") and isinstance(mod, (nn.Linear, Conv1D))
    ]


def calib(num: int = 4, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (num, seqlen), generator=torch.Generator().manual_seed(seed))


def weight_oi(module: nn.Module) -> torch.Tensor:
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


def capture_inputs(model: nn.Module, module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Inputs ``[tokens, in]`` that ``module`` sees when the model runs on ``tokens``."""
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=tokens)
    handle.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).float()


# ---------------------------------------------------------------------------------------------
# Magnitude and Wanda by hand
# ---------------------------------------------------------------------------------------------


def test_magnitude_hand_example_2_4():
    w = torch.tensor(
        [
            [0.1, -0.9, 0.5, 0.2, 3.0, -4.0, 1.0, 0.0],
            [-2.0, 1.0, 0.3, -0.4, 0.5, 0.6, -0.7, 0.05],
        ]
    )
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(magnitude_mask(w, 2, 4), expected)
    # 1:4 keeps the single largest |w| per group.
    expected_1_4 = torch.tensor([[0, 1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(magnitude_mask(w, 1, 4), expected_1_4)
    # Ties go to the lower index, deterministically.
    assert torch.equal(magnitude_mask(torch.ones(1, 4), 2, 4), torch.tensor([[1, 1, 0, 0]], dtype=torch.bool))


def test_wanda_hand_example_differs_from_magnitude():
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.2, -0.3]])
    norms = torch.tensor([10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 20.0])
    # Scores: [10, 2, 3, 4 | 1, 0.5, 0.2, 6] -> keep {0, 3} and {4, 7}; magnitude keeps {2, 3} and {4, 5}.
    assert torch.equal(wanda_mask(w, norms, 2, 4), torch.tensor([[1, 0, 0, 1, 1, 0, 0, 1]], dtype=torch.bool))
    assert torch.equal(magnitude_mask(w, 2, 4), torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool))


def test_wanda_uses_input_norms_of_each_layer_sequentially():
    model = tiny_llama()
    tokens = calib()
    names = target_names(model)
    masks = compute_prior_masks(model, "wanda", 2, 4, names, tokens, batch_size=3, progress=False)
    modules = dict(model.named_modules())
    # Block 0 sees the dense model's activations.
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        x = capture_inputs(model, modules[name], tokens)
        assert torch.equal(masks[name], wanda_mask(modules[name].weight, x.norm(dim=0), 2, 4)), name
    # Block 1 sees the outputs of the already-pruned block 0.
    with torch.no_grad():
        for name in names:
            if name.startswith("model.layers.0."):
                modules[name].weight.mul_(masks[name])
    name = "model.layers.1.mlp.up_proj"
    x = capture_inputs(model, modules[name], tokens)
    assert torch.equal(masks[name], wanda_mask(modules[name].weight, x.norm(dim=0), 2, 4))
    # and that differs from calibrating block 1 on dense activations (the test can fail).
    dense = tiny_llama()
    x_dense = capture_inputs(dense, dict(dense.named_modules())[name], tokens)
    assert not torch.allclose(x, x_dense)


# ---------------------------------------------------------------------------------------------
# SparseGPT on a single layer
# ---------------------------------------------------------------------------------------------


def random_hessian(in_features: int, tokens: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g, dtype=torch.float64)
    x = x @ torch.randn(in_features, in_features, generator=g, dtype=torch.float64)  # correlated features
    return 2.0 / tokens * x.t() @ x


def obs_saliency(w: torch.Tensor, h: torch.Tensor, j: int) -> float:
    """Brute-force OBS saliency of removing w_j when only columns j+1.. may compensate.

    min over d (d_k = 0 for k < j, d_j = -w_j, d_k free for k > j) of d^T H d, solved as a linear
    system (Schur complement), independently of SparseGPT's Cholesky trick.
    """
    rest = torch.arange(j + 1, h.shape[0])
    d = torch.zeros(h.shape[0], dtype=torch.float64)
    d[j] = -w[j]
    if rest.numel():
        d[rest] = -torch.linalg.solve(h[rest][:, rest], h[rest, j] * d[j])
    return float(d @ h @ d)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 8)])
def test_sparsegpt_first_group_matches_exhaustive_obs_choice(n, m):
    """What "exhaustive" means here: the reference rule prunes, at the start of each group, the m-n
    columns with the smallest *individual* OBS saliency (columns to the right may compensate, columns
    to the left are final). So over all C(m, n) candidate patterns of the first group, the chosen one
    minimises the sum of the individual saliencies of the pruned columns. (This is the reference's
    greedy per-group rule, not the joint optimum of removing several weights at once.) Rows are
    independent in SparseGPT, so each of the 16 rows is one instance of the single-row check."""
    in_features, rows = 2 * m, 16
    h = random_hessian(in_features, seed=n + m)
    w = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    hd = h.clone()
    hd.diagonal().add_(0.01 * h.diagonal().mean())  # the dampening sparsegpt_layer applies
    _, mask = sparsegpt_layer(w.float(), h, n, m, percdamp=0.01)
    for r in range(rows):
        sal = [obs_saliency(w[r], hd, j) for j in range(m)]
        best = min(
            itertools.combinations(range(m), n),
            key=lambda keep, sal=sal: sum(s for j, s in enumerate(sal) if j not in keep),
        )
        expected = torch.zeros(m, dtype=torch.bool)
        expected[list(best)] = True
        assert torch.equal(mask[r, :m], expected), (r, sal, mask[r, :m])
    # The OBS choice differs from magnitude on some rows, so the check has teeth.
    assert not torch.equal(mask[:, :m], magnitude_mask(w[:, :m], n, m))


def test_sparsegpt_with_diagonal_hessian_equals_wanda():
    # Orthogonal input features: H is diagonal, the OBS update never crosses columns, and the score
    # w^2 * H_jj orders weights exactly as Wanda's |w| * ||X_j||.
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(64, 16, generator=g, dtype=torch.float64))
    norms = torch.rand(16, generator=g, dtype=torch.float64) * 3 + 0.1
    x = q * norms  # [tokens, in], columns orthogonal with norms `norms`
    w = torch.randn(8, 16, generator=g)
    new_w, mask = sparsegpt_layer(w, 2.0 / 64 * x.t() @ x, 2, 4, percdamp=0.0)
    assert torch.equal(mask, wanda_mask(w, norms.float(), 2, 4))
    torch.testing.assert_close(new_w, w * mask, rtol=1e-5, atol=1e-5)


def test_sparsegpt_lazy_blocks_equal_unblocked():
    h = random_hessian(48)
    w = torch.randn(6, 48, generator=torch.Generator().manual_seed(3))
    w_small, m_small = sparsegpt_layer(w, h, 2, 4, blocksize=4)  # one group per block
    w_big, m_big = sparsegpt_layer(w, h, 2, 4, blocksize=128)  # one block for all
    w_odd, m_odd = sparsegpt_layer(w, h, 3, 8, blocksize=20)  # rounded down to 16: no group is split
    assert torch.equal(m_small, m_big)
    torch.testing.assert_close(w_small, w_big, rtol=1e-4, atol=1e-5)  # fp32 sums in another order
    assert count_nm_violations(w_odd, 3, 8) == 0
    mask_to_indices(m_odd, 3, 8)


def test_sparsegpt_update_reduces_reconstruction_error():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 32, generator=g) @ torch.randn(32, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    stats = HessianStats(32)
    stats.add(HessianStats.increment(x))
    new_w, mask = sparsegpt_layer(w, stats.hessian(), 2, 4)
    assert torch.equal(new_w != 0, mask & (w != 0))  # zero exactly where pruned
    err_update = (x @ (w - new_w).t()).norm()
    err_mask_only = (x @ (w * mask).t() - x @ w.t()).norm()
    assert err_update < 0.8 * err_mask_only, (err_update, err_mask_only)


def test_sparsegpt_dead_inputs():
    h = random_hessian(8)
    h[2, :] = 0
    h[:, 2] = 0  # input 2 never fires
    w = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    new_w, mask = sparsegpt_layer(w, h, 2, 4)
    assert not mask[:, 2].any()  # its weight is zeroed first, so it is pruned
    assert torch.isfinite(new_w).all()
    mask_to_indices(mask, 2, 4)


# ---------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("method", PRIOR_METHODS)
def test_masks_leave_model_bit_identical(arch, method):
    model = MODELS[arch]()
    model.train()
    model.config.use_cache = True
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = target_names(model)
    masks = compute_prior_masks(model, method, 2, 4, names, calib(), batch_size=2, progress=False)
    assert list(masks) == names
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training and model.config.use_cache
    modules = dict(model.named_modules())
    for name, mask in masks.items():
        assert mask.dtype == torch.bool and mask.device.type == "cpu"
        assert mask.shape == weight_oi(modules[name]).shape  # [out, in], also for GPT-2 Conv1D
        mask_to_indices(mask, 2, 4)  # raises unless exactly 2:4
    if arch == "gpt2":
        c_fc = modules["transformer.h.0.mlp.c_fc"]
        assert masks["transformer.h.0.mlp.c_fc"].shape == (256, 64) == c_fc.weight.t().shape
    if method == "magnitude":
        for name, mask in masks.items():
            assert torch.equal(mask, magnitude_mask(weight_oi(modules[name]), 2, 4))


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 8)])
@pytest.mark.parametrize("method", PRIOR_METHODS)
def test_masks_are_exactly_n_m(method, n, m):
    model = tiny_llama(layers=1)
    names = target_names(model)
    masks = compute_prior_masks(model, method, n, m, names, calib(2, 8), progress=False)
    modules = dict(model.named_modules())
    for name, mask in masks.items():
        assert (mask_to_indices(mask, n, m) >= 0).all()
        assert count_nm_violations(modules[name].weight * mask, n, m) == 0
        assert int(mask.sum()) == mask.numel() * n // m


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_sparsegpt_prune_updates_weights_and_keeps_mask(arch):
    model = MODELS[arch]()
    tokens = calib()
    names = target_names(model)
    modules = dict(model.named_modules())
    first = names[0]  # a block-0 layer fed the block input: same inputs before and after pruning
    x = capture_inputs(model, modules[first], tokens)
    dense = weight_oi(modules[first]).detach().clone()
    mask_only = compute_prior_masks(model, "sparsegpt", 2, 4, names, tokens, batch_size=2, progress=False)
    masks = sparsegpt_prune(model, 2, 4, names, tokens, batch_size=2, progress=False)
    for name in names:
        assert torch.equal(masks[name], mask_only[name])  # mask-only mode runs the same algorithm
        w = weight_oi(modules[name])
        assert count_nm_violations(w, 2, 4) == 0
        assert not w[~masks[name]].any()
    updated = weight_oi(modules[first]).detach()
    assert not torch.equal(updated, dense * masks[first])  # the OBS update changed kept weights
    err_update = (x @ (updated - dense).t()).norm()
    err_mask_only = (x @ (dense * masks[first] - dense).t()).norm()
    assert err_update < err_mask_only, (err_update, err_mask_only)


def test_sparsegpt_prune_restores_weights_on_failure(monkeypatch):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("boom")
        return sparsegpt_layer(*args, **kwargs)

    monkeypatch.setattr(calibration_mod, "sparsegpt_layer", failing)
    with pytest.raises(RuntimeError, match="boom"):
        sparsegpt_prune(model, 2, 4, target_names(model), calib(), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_targets_outside_blocks_are_calibrated_after_them():
    model = tiny_llama()
    model.lm_head = nn.Linear(64, VOCAB, bias=False)  # untie so that pruning it touches no embedding
    names = ["model.layers.1.mlp.down_proj", "lm_head"]
    tokens = calib()
    masks = compute_prior_masks(model, "wanda", 2, 4, names, tokens, progress=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(masks[names[0]])
    x = capture_inputs(model, model.lm_head, tokens)
    assert torch.equal(masks["lm_head"], wanda_mask(model.lm_head.weight, x.norm(dim=0), 2, 4))


def test_find_decoder_blocks():
    assert find_decoder_blocks(tiny_llama())[0] == "model.layers"
    assert find_decoder_blocks(tiny_gpt2())[0] == "transformer.h"
    assert find_decoder_blocks(tiny_opt())[0] == "model.decoder.layers"
    assert find_decoder_blocks(nn.Sequential(nn.Linear(4, 4))) is None


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_errors():
    model = tiny_llama(layers=1)
    names = target_names(model)
    for method in ("wanda", "sparsegpt"):
        with pytest.raises(DataError, match="calibration data is required"):
            compute_prior_masks(model, method, 2, 4, names, None)
    with pytest.raises(DataError, match="calibration data is required"):
        sparsegpt_prune(model, 2, 4, names, None)
    with pytest.raises(DataError, match="integer tensor"):
        compute_prior_masks(model, "wanda", 2, 4, names, torch.rand(2, 8))
    with pytest.raises(ConfigError, match="magnitude, wanda, sparsegpt"):
        compute_prior_masks(model, "obs", 2, 4, names, calib())
    with pytest.raises(ConfigError):
        compute_prior_masks(model, "magnitude", 4, 4, names)
    with pytest.raises(TargetError, match="not in the model"):
        compute_prior_masks(model, "magnitude", 2, 4, ["model.layers.0.self_attn.nope"])
    with pytest.raises(TargetError, match="nn.Linear"):
        compute_prior_masks(model, "magnitude", 2, 4, ["model.norm"])
    with pytest.raises(ConfigError, match="batch_size"):
        compute_prior_masks(model, "wanda", 2, 4, names, calib(), batch_size=0)
    # Magnitude needs no data at all.
    assert set(compute_prior_masks(model, "magnitude", 2, 4, names)) == set(names)
    model.model.layers[0].mlp.down_proj = nn.Linear(36, 64)  # 36 inputs: divisible by 4, not by 8
    with pytest.raises(TargetError, match="not divisible by m=8"):
        compute_prior_masks(model, "magnitude", 4, 8, ["model.layers.0.mlp.down_proj"])


class _CharTokenizer:
    """Characters as token ids (< 128): enough to calibrate a tiny model on real text."""

    def __call__(self, text, return_tensors=None, verbose=True):
        ids = [min(ord(c), 127) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_get_mask_model_calibrates_from_texts_and_starts_at_the_prior(method):
    """get_mask_model(prior=..., calibration_data=texts, tokenizer=...): the initial hard masks are the prior."""
    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.data import calibration_tokens
    from hf_maskllm.errors import ConfigError

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
