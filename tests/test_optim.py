"""MaskAdamW: the update rule, stochastic rounding, memory per masked weight, Trainer integration."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)
from trainer_helpers import TokenDataset, cyclic_language, training_args
from transformers import Trainer

from hf_maskllm import MaskAdamW, MaskAnnealCallback, MaskConfig, get_mask_model
from hf_maskllm.errors import ConfigError
from hf_maskllm.learn import learn_mask
from hf_maskllm.memory import training_state_bytes


def _reference_steps(p0, grads, lr, betas, eps, wd, momentum, second_moment="logit"):
    """The update rule in float64: second moment per logit (AdamW's) or per row (the mean squared
    gradient of a group), optional momentum."""
    per_row = second_moment == "group"
    p, v, m = (
        p0.double().clone(),
        torch.zeros(p0.shape[0], 1, dtype=torch.float64)
        if per_row
        else torch.zeros_like(p0, dtype=torch.float64),
        torch.zeros_like(p0, dtype=torch.float64),
    )
    for step, g in enumerate(grads, start=1):
        g = g.double()
        v = betas[1] * v + (1 - betas[1]) * (g.square().mean(-1, keepdim=True) if per_row else g.square())
        denom = (v / (1 - betas[1] ** step)).sqrt() + eps
        if momentum:
            m = betas[0] * m + (1 - betas[0]) * g
            direction = m / (1 - betas[0] ** step)
        else:
            direction = g
        p = p * (1 - lr * wd) - lr * direction / denom
    return p


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("momentum_dtype", [None, torch.float32])
@pytest.mark.parametrize("second_moment", ["logit", "group"])
def test_update_matches_float64_reference(compile, momentum_dtype, second_moment):
    """Exact rule with float32 states (the per-logit second moment at 32 bits)."""
    torch.manual_seed(0)
    p0 = torch.randn(257, 6) * 0.05
    column_scale = torch.logspace(0, -3, 6)  # a group's logits get gradients of different scales
    grads = [torch.randn(257, 6) * column_scale * 10 ** (-k) for k in range(4)]  # and v must follow in time
    p = torch.nn.Parameter(p0.clone())
    opt = MaskAdamW(
        [p],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        momentum_dtype=momentum_dtype,
        second_moment=second_moment,
        second_moment_bits=32,
        compile=compile,
    )
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = _reference_steps(p0, grads, 1e-2, (0.9, 0.95), 1e-8, 0.1, momentum_dtype is not None, second_moment)
    torch.testing.assert_close(p.double(), ref, rtol=1e-5, atol=1e-7)
    state = opt.state[p]["exp_avg_sq"]
    assert (state.shape, state.dtype) == (
        ((257, 6), torch.float32) if second_moment == "logit" else ((257,), torch.float32)
    )


def test_per_logit_second_moment_moves_small_gradient_logits_as_far_as_large_ones():
    """Why the default is per logit: a group's unlikely candidates get tiny gradients (their softmax
    probability scales them); one shared second moment shrinks their steps by the same factor."""
    grads = torch.tensor([[1.0, 1.0, 1e-3, 1e-3, 1e-3, 1e-3]]).repeat(64, 1)
    moved = {}
    for mode in ("logit", "group"):
        p = torch.nn.Parameter(torch.zeros(64, 6))
        opt = MaskAdamW(
            [p], lr=1e-2, weight_decay=0.0, second_moment=mode, second_moment_bits=32, compile=False
        )
        for _ in range(10):
            p.grad = grads.clone()
            opt.step()
        moved[mode] = -p.detach()[0]
    torch.testing.assert_close(moved["logit"], torch.full((6,), 0.1), rtol=1e-4, atol=0)  # lr per step each
    assert moved["group"][2] < 1e-3 * moved["group"][0] * 1.01  # 1000x less for the small-gradient logits


@pytest.mark.parametrize(
    ("bits", "dtype", "max_error", "mean_error"),
    [(16, torch.bfloat16, 4e-3, 3e-4), (8, torch.uint8, 1.2e-2, 1e-3)],
)
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compact_per_logit_second_moment_is_close_and_unbiased(bits, dtype, max_error, mean_error, compile):
    """bf16 logits with the second moment in bf16 or in 8 bits, 8 steps against the float64 rule:
    float32 states would give 3.2e-3 at most and 2.4e-4 on average (the logits' bf16 rounding) while
    the logits move by 2.2e-2 on average; bf16 states add nothing, 8-bit ones (1.25x apart) ~3% of
    the movement, and neither any bias (24k logits, gradients spread over 3 decades)."""
    torch.manual_seed(0)
    p0 = torch.randn(4096, 6) * 0.05
    grads = [torch.randn(4096, 6) * torch.logspace(0, -3, 6) for _ in range(8)]
    p = torch.nn.Parameter(p0.to(torch.bfloat16))
    opt = MaskAdamW([p], lr=1e-2, weight_decay=0.0, second_moment_bits=bits, compile=compile)
    for g in grads:
        p.grad = g.to(torch.bfloat16)
        opt.step()
    assert opt.state[p]["exp_avg_sq"].dtype == dtype  # 2 or 1 bytes per logit
    ref = _reference_steps(p0.to(torch.bfloat16).float(), [g.to(torch.bfloat16) for g in grads], 1e-2,
                           (0.9, 0.95), 1e-8, 0.0, False)  # fmt: skip
    error = p.double() - ref
    assert error.abs().max() < max_error
    assert error.abs().mean() < mean_error
    assert error.mean().abs() < 2e-5  # unbiased


def test_8bit_second_moment_format():
    """Every code decodes to a float32 that encodes back to itself; rounding between neighbours is
    unbiased (16 random bits); below the range is its floor (the root stays below eps), above it its top."""
    from hf_maskllm.numerics.sampling import seed_tensor
    from hf_maskllm.optim import V8_MIN_EXP, _decode_v8, _encode_v8, _random_bits

    def encode(v: torch.Tensor, seed: int) -> torch.Tensor:
        return _encode_v8(v, (_random_bits(seed_tensor(seed), v) >> 16) & 0xFFFF)

    codes = torch.arange(256, dtype=torch.uint8)
    values = _decode_v8(codes)
    assert torch.equal(encode(values.contiguous(), 7), codes)
    assert values[0] == 2.0**V8_MIN_EXP and values[-1] == 1.75 * 2.0 ** (V8_MIN_EXP + 63)
    assert bool((values[1:] > values[:-1]).all())  # monotonic
    x = torch.full((200_000,), 1.1e-7)  # between the codes 1.75 * 2**-24 and 2**-23
    rounded = _decode_v8(encode(x, 3))
    assert set(rounded.unique().tolist()) == {1.75 * 2.0**-24, 2.0**-23}
    assert abs(rounded.double().mean().item() / 1.1e-7 - 1) < 2e-3
    edges = _decode_v8(encode(torch.tensor([0.0, 1e-30, 1e3]), 3))
    assert edges.tolist() == [values[0].item(), values[0].item(), values[-1].item()]


def test_bf16_stochastic_rounding_keeps_updates_that_round_to_nearest_loses():
    """50 steps of 1e-4 on bf16 logits at 0.25 (bf16 spacing there: 2e-3): AdamW loses all of them.
    (float32 second moment: exact 1e-4 steps; the 8-bit one's are 1e-4 only on average, and its
    rounding noise makes them ~0.75% longer on average here: 1 / sqrt is convex.)"""
    ours = torch.nn.Parameter(torch.full((20_000, 6), 0.25, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(ours.detach().clone())
    opt = MaskAdamW([ours], lr=1e-4, weight_decay=0.0, second_moment_bits=32, compile=False)
    ref = torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0)
    for _ in range(50):
        ours.grad = torch.ones_like(ours)
        plain.grad = torch.ones_like(plain)
        opt.step()
        ref.step()
    assert plain.float().mean().item() == 0.25  # every update rounded away
    assert abs(ours.float().mean().item() - (0.25 - 50 * 1e-4)) < 2e-5  # unbiased: the mean moved by 5e-3
    assert ours.float().unique().numel() > 1  # each logit rounded its own way


def test_bf16_momentum_is_rounded_stochastically_too():
    torch.manual_seed(0)
    p0 = torch.randn(4096, 6) * 0.05
    grads = [torch.randn(4096, 6) for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = MaskAdamW([p], lr=1e-2, weight_decay=0.0, momentum_dtype=torch.bfloat16, compile=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    ref = _reference_steps(p0, grads, 1e-2, (0.9, 0.95), 1e-8, 0.0, True)
    error = p.double() - ref
    # Stochastic roundings of the bf16 momentum and the 8-bit second moment: the largest of 24,576 errors
    # was 1.7e-3 to 2.1e-3 over the seeds 0-7 of the rounding bits.
    assert error.abs().max() < 3e-3
    assert error.mean().abs() < 2e-5  # and unbiased


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"momentum_dtype": torch.int8}, "momentum_dtype"),
        ({"second_moment": "row"}, "second_moment"),
        ({"second_moment_bits": 4}, "second_moment_bits"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MaskAdamW([torch.nn.Parameter(torch.zeros(4, 6))], **kwargs)


def _bytes_per_masked_weight(logits_dtype: str, optimizer_cls, optimizer_kwargs) -> float:
    mm = get_mask_model(tiny_llama(), MaskConfig(logits_dtype=logits_dtype))
    opt = optimizer_cls(list(mm.parameters()), **optimizer_kwargs)
    mm.train()
    ids = cyclic_language(4, seed=0)
    mm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sizes = training_state_bytes(mm, opt)
    masked = sum(layer.out_features * layer.in_features for layer in mm.masked_layers().values())
    return sizes["total"] / masked


def test_training_state_bytes_per_masked_weight():
    """Default (bf16 logits + MaskAdamW, 8-bit second moment per logit) 7.5 bytes; bf16 second moment
    9; per-group 7; reference (fp32 + AdamW) 24; per-group + bf16 momentum 10."""
    assert _bytes_per_masked_weight("bfloat16", MaskAdamW, {"compile": False}) == pytest.approx(7.5, abs=1e-2)
    v16 = {"compile": False, "second_moment_bits": 16}
    assert _bytes_per_masked_weight("bfloat16", MaskAdamW, v16) == pytest.approx(9.0, abs=1e-2)
    group = {"compile": False, "second_moment": "group"}
    assert _bytes_per_masked_weight("bfloat16", MaskAdamW, group) == pytest.approx(7.0, abs=1e-2)
    assert _bytes_per_masked_weight("float32", torch.optim.AdamW, {}) == pytest.approx(24.0, abs=1e-2)
    momentum = {**group, "momentum_dtype": torch.bfloat16}
    assert _bytes_per_masked_weight("bfloat16", MaskAdamW, momentum) == pytest.approx(10.0, abs=1e-2)
    assert MaskConfig().logits_dtype == "bfloat16"


def test_learn_mask_uses_mask_adamw_and_trainer_warns_for_round_to_nearest(tmp_path):
    ids = cyclic_language(16, seed=1)
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = learn_mask(mm, TokenDataset(ids), max_steps=2, output_dir=str(tmp_path / "a"), disable_tqdm=True,
                         compile_sampling=False, use_cpu=True, logging_steps=1)  # fmt: skip
    assert isinstance(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer,
        MaskAdamW,
    )
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.1
    plain = Trainer(
        model=get_mask_model(tiny_llama(), MaskConfig()),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=TokenDataset(ids),
        callbacks=[MaskAnnealCallback(compile_sampling=False)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain.train()
    assert any("MaskAdamW" in str(w.message) and "bfloat16" in str(w.message) for w in caught)


def test_replicas_round_identically_whatever_their_rng_state():
    """DDP replicas get identical gradients; their stochastic rounding must agree too, or they drift."""
    torch.manual_seed(0)
    p0 = (torch.randn(512, 6) * 0.05).to(torch.bfloat16)
    grads = [torch.randn(512, 6).to(torch.bfloat16) for _ in range(3)]
    replicas = []
    for rng_seed in (1, 2):
        torch.manual_seed(rng_seed)  # another global RNG state on each "rank"
        p = torch.nn.Parameter(p0.clone())
        opt = MaskAdamW([p], lr=1e-3, compile=False, momentum_dtype=torch.bfloat16)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        replicas.append(p.detach())
    assert torch.equal(replicas[0], replicas[1])
    assert not torch.equal(replicas[0], p0)


@pytest.mark.slow
def test_compiled_update_compiles_once_whatever_the_learning_rate_and_step():
    """The learning rate (a scheduler changes it every step) and the step count reach the compiled
    update as a tensor: the first step compiles, later ones reuse it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    p = torch.nn.Parameter((torch.randn(300, 6) * 0.05).to(torch.bfloat16))
    opt = MaskAdamW([p], lr=1e-3, compile=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    p.grad = torch.randn(300, 6).to(torch.bfloat16)
    opt.step()
    compiled = counters["stats"]["unique_graphs"]
    for _ in range(3):
        schedule.step()
        p.grad = torch.randn(300, 6).to(torch.bfloat16)
        opt.step()
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("second_moment", ["logit", "group"])
def test_candidate_major_and_row_major_logits_update_bit_identically(compile, second_moment):
    """Masked layers store logits candidate-major, FSDP2 shards hold them row-major: every element
    draws the same rounding bits in both layouts, so both take exactly the same steps."""
    from hf_maskllm.numerics.fused_linear import candidate_major

    torch.manual_seed(0)
    p0 = (torch.randn(512, 6) * 0.05).to(torch.bfloat16)
    grads = [torch.randn(512, 6).to(torch.bfloat16) for _ in range(3)]
    results = []
    for layout in (lambda t: t.contiguous(), candidate_major):
        p = torch.nn.Parameter(layout(p0.clone()))
        opt = MaskAdamW(
            [p], lr=1e-3, compile=compile, second_moment=second_moment, momentum_dtype=torch.bfloat16
        )
        for g in grads:
            p.grad = layout(g.clone())
            opt.step()
        assert p.stride() == layout(p0).stride()
        results.append((p.detach(), opt.state[p]["exp_avg_sq"], opt.state[p]["exp_avg"]))
    for row_major, candidate_major_ in zip(*results):
        assert torch.equal(row_major, candidate_major_)
    assert not torch.equal(results[0][0], p0)


@pytest.mark.parametrize(
    ("second_moment", "bits", "v_dtype"),
    [("group", 8, torch.float32), ("logit", 8, torch.uint8), ("logit", 16, torch.bfloat16)],
)
def test_state_dict_round_trip_keeps_dtypes_and_continues_exactly(second_moment, bits, v_dtype):
    """torch's load_state_dict casts states to the parameter dtype (bf16); MaskAdamW keeps its own."""
    torch.manual_seed(0)
    p0 = (torch.randn(300, 6) * 0.05).to(torch.bfloat16)
    grads = [torch.randn(300, 6).to(torch.bfloat16) for _ in range(4)]
    kwargs = {"lr": 1e-3, "compile": False, "momentum_dtype": torch.bfloat16, "second_moment": second_moment,
              "second_moment_bits": bits}  # fmt: skip

    def run(resume_after: int | None) -> torch.Tensor:
        p = torch.nn.Parameter(p0.clone())
        opt = MaskAdamW([p], **kwargs)
        for i, g in enumerate(grads):
            if i == resume_after:
                saved = opt.state_dict()
                p = torch.nn.Parameter(p.detach().clone())
                opt = MaskAdamW([p], **kwargs)
                opt.load_state_dict(saved)
                state = opt.state[p]
                assert state["exp_avg_sq"].dtype == v_dtype and state["exp_avg"].dtype == torch.bfloat16
            p.grad = g.clone()
            opt.step()
        return p.detach()

    assert torch.equal(run(None), run(2))
    p = torch.nn.Parameter(p0.clone())
    with_momentum = MaskAdamW([p], **kwargs)
    p.grad = grads[0].clone()
    with_momentum.step()
    with pytest.raises(ConfigError, match="momentum_dtype"):
        MaskAdamW([p], **{**kwargs, "momentum_dtype": None}).load_state_dict(with_momentum.state_dict())
    other = "group" if second_moment == "logit" else "logit"
    with pytest.raises(ConfigError, match=f"second_moment='{second_moment}'"):
        MaskAdamW([p], **{**kwargs, "second_moment": other}).load_state_dict(with_momentum.state_dict())
    if second_moment == "logit":
        with pytest.raises(ConfigError, match=f"second_moment_bits={bits}"):
            MaskAdamW([p], **{**kwargs, "second_moment_bits": 24 - bits}).load_state_dict(
                with_momentum.state_dict()
            )


def test_flattened_parameters_are_refused_clearly():
    p = torch.nn.Parameter(torch.zeros(24))
    p.grad = torch.ones(24)
    with pytest.raises(ConfigError, match="FSDP2"):
        MaskAdamW([p], compile=False).step()
