"""The sequential calibration driver of the one-shot priors: masks of whole models (magnitude, Wanda,
SparseGPT), the model left unchanged, SparseGPT pruning in place, and what is refused."""

from __future__ import annotations

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
# Sequential calibration: each block sees the outputs of the blocks pruned before it
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Precision: float64 on a CPU by default, the model's weights and dtypes unchanged
# ---------------------------------------------------------------------------------------------


def _input_dtypes(model: nn.Module, names: list[str], run) -> set[torch.dtype]:
    """Dtypes of the inputs the target layers see while ``run()`` calibrates."""
    seen: set[torch.dtype] = set()
    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda mod, a, o: seen.add(a[0].dtype)) for n in names]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_blocks_run_in_float64_on_cpu_by_default(method):
    model = tiny_llama()
    names = target_names(model)
    tokens = calib()
    seen = _input_dtypes(
        model, names, lambda: compute_prior_masks(model, method, 2, 4, names, tokens, progress=False)
    )
    assert seen == {torch.float64}
    kwargs = {"compute_dtype": torch.float32}
    run = lambda: compute_prior_masks(model, method, 2, 4, names, tokens, progress=False, **kwargs)  # noqa: E731
    assert _input_dtypes(model, names, run) == {torch.float32}


def test_float64_masks_follow_a_float64_reference():
    """Block 0's first layer: the mask SparseGPT picks from float64 inputs, solved in float64."""
    model = tiny_llama()
    tokens = calib()
    names = target_names(model)
    first = dict(model.named_modules())[names[0]]
    weight = first.weight.detach().clone()
    seen: list[torch.Tensor] = []
    handle = first.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        model.double()(input_ids=tokens)
    handle.remove()
    model.float()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen])
    assert x.dtype == torch.float64
    h = 2.0 / x.shape[0] * (x.t() @ x)
    _, expected = sparsegpt_layer(weight.double(), h, 2, 4)
    masks = compute_prior_masks(model, "sparsegpt", 2, 4, names, tokens, progress=False)
    assert torch.equal(masks[names[0]], expected)


def test_bf16_model_keeps_dtypes_and_rounds_updates():
    model = tiny_llama().to(torch.bfloat16)
    names = target_names(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compute_prior_masks(model, "sparsegpt", 2, 4, names, calib(), progress=False)
    after = model.state_dict()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    masks = sparsegpt_prune(model, 2, 4, names, calib(), progress=False)
    modules = dict(model.named_modules())
    for name in names:
        w = modules[name].weight
        assert w.dtype == torch.bfloat16
        assert not w[~masks[name]].any()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_failure_in_float64_restores_weights_and_dtypes(monkeypatch):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 9:  # inside block 1, after block 0 was pruned
            raise RuntimeError("boom")
        return sparsegpt_layer(*args, **kwargs)

    monkeypatch.setattr(calibration_mod, "sparsegpt_layer", failing)
    with pytest.raises(RuntimeError, match="boom"):
        sparsegpt_prune(model, 2, 4, target_names(model), calib(), progress=False)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_compute_dtype_is_checked():
    model = tiny_llama(layers=1)
    with pytest.raises(ConfigError, match="compute_dtype"):
        compute_prior_masks(model, "wanda", 2, 4, target_names(model), calib(), compute_dtype=torch.float16)
