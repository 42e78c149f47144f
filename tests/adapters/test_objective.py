"""The training objective: distillation from the unmasked model (logits and hidden states), checked against
a hand computation (the teacher in float32 or under bfloat16 autocast); the teacher pass reuses the frozen
weights and leaves them untouched; the terms are divided like the language-model loss, so gradient
accumulation sums to the one-batch gradient."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from models import single_thread, tiny_bert_mlm, tiny_gpt2, tiny_llama  # noqa: F401  (autouse fixture)
from trainer_helpers import TokenDataset, random_tokens, training_args
from transformers import Trainer

from hf_maskllm import MaskAnnealCallback, MaskConfig, get_mask_model
from hf_maskllm.adapters import objective
from hf_maskllm.adapters.objective import (
    hidden_distillation,
    logit_distillation,
    predicted_positions,
    teacher_autocast,
)
from hf_maskllm.errors import ConfigError


def _labels(batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, (batch, seq), generator=gen)
    labels[0, :3] = -100  # a prompt that is not trained on
    labels[-1, -4:] = -100  # padding
    return labels


def test_logit_distillation_matches_a_hand_computation():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 3
    teacher = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 3
    labels = _labels(3, 7, 1)
    T = 2.0
    total, count = 0.0, 0
    for b in range(3):
        for t in range(6):
            if labels[b, t + 1] == -100:
                continue
            p = [math.exp(v / T) for v in teacher[b, t].tolist()]
            q = [math.exp(v / T) for v in student[b, t].tolist()]
            p = [v / sum(p) for v in p]
            q = [v / sum(q) for v in q]
            total += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
            count += 1
    valid = predicted_positions(labels)
    assert int(valid.sum()) == count
    got = logit_distillation(student, teacher, valid, T)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(T**2 * total / count, rel=1e-5)
    # with the Trainer's token count of the whole accumulated batch, the sum is divided by it instead
    assert logit_distillation(student, teacher, valid, T, torch.tensor(40)).item() == pytest.approx(
        T**2 * total / 40, rel=1e-5
    )
    assert logit_distillation(teacher, teacher, valid, T).item() == pytest.approx(0.0, abs=1e-6)


def test_hidden_distillation_matches_a_hand_computation():
    gen = torch.Generator().manual_seed(2)
    blocks = 3
    student = tuple(torch.randn(2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(blocks))
    teacher = tuple(torch.randn(2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(blocks))
    labels = _labels(2, 5, 3)
    valid = predicted_positions(labels)
    total = 0.0
    for hs, ht in zip(student, teacher, strict=True):
        for b in range(2):
            for t in range(5):
                if valid[b, t]:
                    err = sum((x - y) ** 2 for x, y in zip(hs[b, t].tolist(), ht[b, t].tolist(), strict=True))
                    total += err / sum(y**2 for y in ht[b, t].tolist())
    count = int(valid.sum())
    got = hidden_distillation(student, teacher, valid)
    assert got.item() == pytest.approx(total / blocks / count, rel=1e-5)
    assert hidden_distillation(student, teacher, valid, 17).item() == pytest.approx(
        total / blocks / 17, rel=1e-5
    )


DISTILL = {"distill_logits": 0.7, "distill_temperature": 2.0, "distill_hidden": 0.3, "lm_weight": 0.5}


def _models(build=tiny_llama, **fields):
    """A MaskModel training on ``fields``' objective and a copy with the same logits on the LM loss alone."""
    config = MaskConfig(prior="magnitude", sparse_reg=0.0, logits_dtype="float32", **fields)
    distilling = get_mask_model(build(), config).train()
    distilling.set_schedule_values(tau=4.0, kappa=100.0)
    plain = copy.deepcopy(distilling)
    plain.mask_config.lm_weight, plain.mask_config.distill_logits, plain.mask_config.distill_hidden = (
        1.0,
        0.0,
        0.0,
    )
    return distilling, plain


@pytest.mark.parametrize("temperature", [1.0, 2.0], ids=["T1", "T2"])
@pytest.mark.parametrize("bf16", [False, True], ids=["teacher-fp32", "teacher-bf16"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_the_objective_on_a_tiny_model_matches_a_hand_computation(build, bf16, temperature, monkeypatch):
    distilling, plain = _models(build, **{**DISTILL, "distill_temperature": temperature})
    assert distilling.set_teacher_bf16(bf16) is None  # the default: chosen for the device
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :4] = -100
    fused = []  # the model's loss function computed the KL in the same pass
    call = objective.FusedCausalLMLoss.__call__
    monkeypatch.setattr(
        objective.FusedCausalLMLoss, "__call__", lambda self, *a, **k: fused.append(1) or call(self, *a, **k)
    )
    torch.manual_seed(7)  # the same Gumbel sample in both models
    out = distilling(input_ids=ids, labels=labels)
    out.loss.backward()
    assert fused == [1] and "_loss_function" not in vars(distilling.base_model)  # and its own is back

    # by hand: the dense model without masks (in the model's training mode: GPT-2's dropout applies, drawn
    # in the same order), the masked model's own outputs
    torch.manual_seed(7)
    with torch.no_grad(), plain.disable_masks(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        teacher = plain(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert teacher.logits.dtype == (torch.bfloat16 if bf16 else torch.float32)
    student = plain(input_ids=ids, labels=labels, output_hidden_states=True)
    valid = predicted_positions(labels)
    kl = logit_distillation(student.logits, teacher.logits, valid, temperature)
    mse = hidden_distillation(student.hidden_states[1:], teacher.hidden_states[1:], valid)
    (0.5 * student.loss + 0.7 * kl + 0.3 * mse).backward()

    assert out.loss.item() == pytest.approx(student.loss.item(), rel=1e-6)  # the logged loss: the LM loss
    assert out.distill_logits_loss.item() == pytest.approx(0.7 * kl.item(), rel=1e-5)
    assert out.distill_hidden_loss.item() == pytest.approx(0.3 * mse.item(), rel=1e-5)
    assert kl.item() > 0 and mse.item() > 0
    for name, layer in distilling.masked_layers().items():
        expected = plain.get_submodule(f"base_model.{name}").mask_logits.grad
        torch.testing.assert_close(layer.mask_logits.grad, expected, rtol=1e-4, atol=1e-9)


def test_the_teacher_runs_in_bfloat16_where_the_device_multiplies_it_natively(monkeypatch):
    model = tiny_llama()
    for native in (False, True):
        monkeypatch.setattr(objective, "native_bf16_matmul", lambda device, native=native: native)
        assert isinstance(teacher_autocast(model), torch.autocast) is native  # the default: the device's
        assert isinstance(teacher_autocast(model, bf16=True), torch.autocast)  # asked for: always
        assert not isinstance(teacher_autocast(model, bf16=False), torch.autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # an active autocast decides
            assert not isinstance(teacher_autocast(model, bf16=True), torch.autocast)
    assert not isinstance(teacher_autocast(model.to(torch.bfloat16)), torch.autocast)  # not float32: as it is


def test_the_teacher_pass_reuses_the_frozen_weights_and_leaves_them_untouched():
    distilling, _ = _models(**DISTILL)
    distilling.base_model.model.norm.eval()  # a user's choice, kept
    params = {name: (p.data_ptr(), p.requires_grad) for name, p in distilling.named_parameters()}
    buffers = {name: b.data_ptr() for name, b in distilling.named_buffers()}
    modes = {name: module.training for name, module in distilling.named_modules()}
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    seen = []
    hooks = [
        layer.base_layer.register_forward_hook(lambda mod, args, out: seen.append(mod.weight.data_ptr()))
        for layer in distilling.masked_layers().values()
    ]
    distilling(input_ids=ids, labels=ids).loss.backward()
    for hook in hooks:
        hook.remove()
    base_ptrs = {layer.base_layer.weight.data_ptr() for layer in distilling.masked_layers().values()}
    assert seen and set(seen) == base_ptrs  # the teacher ran on the model's own weights
    assert {name: (p.data_ptr(), p.requires_grad) for name, p in distilling.named_parameters()} == params
    assert {name: b.data_ptr() for name, b in distilling.named_buffers()} == buffers
    assert {name: module.training for name, module in distilling.named_modules()} == modes
    for name, p in distilling.base_model.named_parameters():
        assert p.grad is None or "logits" in name, name
    assert all(layer.mask_logits.grad is not None for layer in distilling.masked_layers().values())


def test_accumulated_micro_batches_give_the_one_batch_gradient():
    """The Trainer divides every micro-batch's loss by the token count of the whole accumulated batch
    (``num_items_in_batch``): the distillation terms are divided the same way, so two micro-batches sum to
    the gradient of the batch they split (with the same Gumbel sample)."""
    distilling, _ = _models(**DISTILL)
    twin = copy.deepcopy(distilling)
    ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(6))
    labels = ids.clone()
    labels[1, :5] = -100
    labels[3, -3:] = -100  # micro-batches with different token counts
    items = torch.tensor(int((labels[:, 1:] != -100).sum()))
    torch.manual_seed(8)
    distilling(input_ids=ids, labels=labels, num_items_in_batch=items).loss.backward()
    for part in (slice(0, 2), slice(2, 4)):
        torch.manual_seed(8)
        twin(input_ids=ids[part], labels=labels[part], num_items_in_batch=items).loss.backward()
    for name, layer in distilling.masked_layers().items():
        got = twin.get_submodule(f"base_model.{name}").mask_logits.grad
        torch.testing.assert_close(got, layer.mask_logits.grad, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("native", [False, True], ids=["fp32-device", "bf16-device"])
def test_a_trainer_run_logs_the_terms_and_the_language_model_loss(tmp_path, caplog, monkeypatch, native):
    monkeypatch.setattr(objective, "native_bf16_matmul", lambda device: native)
    mask_model = get_mask_model(tiny_llama(), MaskConfig(prior="magnitude", distill_logits=1.0))
    args = training_args(tmp_path, max_steps=2)
    trainer = Trainer(
        model=mask_model, args=args, train_dataset=TokenDataset(random_tokens(16, 0)),
        callbacks=[MaskAnnealCallback()],
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hf_maskllm.adapters.callback"):
        trainer.train()
    assert ("runs under bfloat16 autocast" in caplog.text) is native  # the teacher's precision is said
    logged = [row for row in trainer.state.log_history if "loss" in row and "train_runtime" not in row]
    assert logged and all(
        row["distill_logits_loss"] > 0 and "distill_hidden_loss" not in row for row in logged
    )
    assert all(math.isfinite(row["loss"]) for row in logged)


def test_the_objective_needs_labels_and_sane_weights():
    distilling, _ = _models(distill_logits=1.0)
    with pytest.raises(ConfigError, match="needs `labels`"):
        distilling(input_ids=torch.randint(3, 128, (1, 8)))
    with torch.no_grad():  # evaluation runs the masked model alone, with or without labels
        distilling.eval()
        assert distilling(input_ids=torch.randint(3, 128, (1, 8))).logits is not None
    with pytest.raises(ConfigError, match="all 0"):
        MaskConfig(lm_weight=0.0, distill_logits=0.0)
    assert MaskConfig(lm_weight=0.0).distill_logits is None  # the default distils a causal LM
    with pytest.raises(ConfigError, match="distill_logits"):
        MaskConfig(distill_logits=-1.0)
    with pytest.raises(ConfigError, match="distill_temperature"):
        MaskConfig(distill_temperature=0.0)
    assert MaskConfig(lm_weight=0.0, distill_hidden=1.0).distills


def test_the_command_line_sets_the_objective():
    from hf_maskllm.cli import _parser

    args = _parser().parse_args(["learn"])
    default = MaskConfig()
    assert (args.lm_weight, args.distill_logits, args.distill_temperature, args.distill_hidden) == (
        default.lm_weight, default.distill_logits, default.distill_temperature, default.distill_hidden,
    )  # fmt: skip
    assert tuple(args.tau) == default.tau and args.prior_strength == default.prior_strength
    args = _parser().parse_args(
        ["learn", "--distill-logits", "0.1", "--distill-temperature", "2", "--tau", "4", "0.05"]
    )
    assert (args.distill_logits, args.distill_temperature, args.tau) == (0.1, 2.0, [4.0, 0.05])


def test_the_logged_terms_are_per_token_whatever_the_accumulation():
    """A term carries its gradient divided by the whole accumulated batch's token count, but is logged per
    token of its own batch, as comparable across runs as the logged loss."""
    distilling, _ = _models(**DISTILL)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    torch.manual_seed(3)
    alone = distilling(input_ids=ids, labels=ids)
    torch.manual_seed(3)
    accumulated = distilling(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(8 * 22))
    for name in ("distill_logits_loss", "distill_hidden_loss"):
        assert accumulated[name].item() == pytest.approx(alone[name].item(), rel=1e-5)


def test_a_frozen_mask_under_fine_tuning_leaves_the_loss_alone(tmp_path):
    """A mask learned with distillation, loaded frozen (is_trainable=False) for fine-tuning something else:
    no teacher pass, the caller's loss untouched, batches without labels accepted."""
    from hf_maskllm import MaskModel

    distilling, plain = _models(**DISTILL)
    distilling.save_pretrained(tmp_path / "mask")
    frozen = MaskModel.from_pretrained(tiny_llama(), tmp_path / "mask").train()
    assert frozen.mask_config.distill_logits == 0.7  # saved and read back
    calls = []
    frozen.disable_masks = lambda: calls.append(1)  # a teacher pass would call it
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(10))
    out = frozen(input_ids=ids, labels=ids)
    assert not calls and "distill_logits_loss" not in out
    assert frozen(input_ids=ids).logits is not None


def test_the_papers_objective_fields_are_left_out_of_a_saved_config(tmp_path):
    import json

    MaskConfig(distill_logits=0.0).save_pretrained(tmp_path / "a")
    MaskConfig(distill_logits=0.1).save_pretrained(tmp_path / "b")
    MaskConfig().save_pretrained(tmp_path / "c")  # the default, not yet filled in for a model
    a = json.loads((tmp_path / "a" / "mask_config.json").read_text())
    b = json.loads((tmp_path / "b" / "mask_config.json").read_text())
    c = json.loads((tmp_path / "c" / "mask_config.json").read_text())
    assert not {"lm_weight", "distill_logits", "distill_temperature", "distill_hidden"} & set(a)
    assert b["distill_logits"] == 0.1 and "lm_weight" not in b
    assert c["distill_logits"] is None
    assert MaskConfig.from_pretrained(tmp_path / "a") == MaskConfig(distill_logits=0.0)
    assert MaskConfig.from_pretrained(tmp_path / "b") == MaskConfig(distill_logits=0.1)
    assert MaskConfig.from_pretrained(tmp_path / "c") == MaskConfig()


def test_a_config_saved_without_the_objective_fields_reads_the_papers_objective(tmp_path):
    """Files written before the objective fields existed hold masks learned on the language-model loss
    alone: they read as that, not as today's default."""
    import json

    MaskConfig(distill_logits=0.0).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "mask_config.json").read_text())
    assert "distill_logits" not in data
    config = MaskConfig.from_pretrained(tmp_path)
    assert (config.lm_weight, config.distill_logits, config.distill_hidden) == (1.0, 0.0, 0.0)
    assert not config.distills


def test_the_default_objective_distils_a_causal_lm_and_not_other_models(tmp_path):
    """``distill_logits=None`` is filled in when the mask is added: 1.0 (the unmasked model's next-token
    distribution) for a causal LM, the language-model loss alone for other models; saved as filled in."""
    from hf_maskllm import MaskModel

    config = MaskConfig(prior="magnitude")
    llama = get_mask_model(tiny_llama(), config).train()
    assert llama.mask_config.distill_logits == 1.0 and llama.mask_config.distills
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(11))
    out = llama(input_ids=ids, labels=ids)
    assert out.distill_logits_loss.item() > 0
    llama.save_pretrained(tmp_path / "llama")
    assert MaskModel.from_pretrained(tiny_llama(), tmp_path / "llama").mask_config.distill_logits == 1.0
    MaskConfig().save_pretrained(tmp_path / "llama")  # a config saved before a model filled it in: null
    assert MaskModel.from_pretrained(tiny_llama(), tmp_path / "llama").mask_config.distill_logits == 1.0

    bert = get_mask_model(tiny_bert_mlm(), MaskConfig(prior="magnitude")).train()
    assert bert.mask_config.distill_logits == 0.0 and not bert.mask_config.distills
    out = bert(input_ids=ids, labels=ids)  # its own loss, no objective refused
    assert "distill_logits_loss" not in out and torch.isfinite(out.loss)
    # the paper's objective is one argument away
    paper = get_mask_model(tiny_llama(), MaskConfig(prior="magnitude", distill_logits=0.0)).train()
    assert "distill_logits_loss" not in paper(input_ids=ids, labels=ids)


def test_a_model_that_is_not_a_causal_lm_is_refused_an_objective():
    model = get_mask_model(tiny_bert_mlm(), MaskConfig(distill_logits=1.0)).train()
    ids = torch.randint(3, 128, (1, 8))
    with pytest.raises(ConfigError, match="causal language models"):
        model(input_ids=ids, labels=ids)


def test_a_causal_lm_class_of_remote_code_is_accepted():
    """Not in transformers' Auto mapping, but named like its causal LMs: accepted."""
    from transformers import LlamaForCausalLM

    class CustomForCausalLM(LlamaForCausalLM):
        pass

    base = tiny_llama()
    base.__class__ = CustomForCausalLM
    model = get_mask_model(base, MaskConfig(distill_logits=1.0)).train()
    ids = torch.randint(3, 128, (1, 8))
    assert "distill_logits_loss" in model(input_ids=ids, labels=ids)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_chunked_logit_distillation_matches_the_whole_batch_value_and_gradient(monkeypatch, temperature):
    """The KL runs in chunks of rows, its gradient written in the same pass: the same value and gradient as
    the whole batch at once (float64 reference), whatever the chunk size, padding rows included."""
    from hf_maskllm.adapters import objective

    gen = torch.Generator().manual_seed(12)
    student = (torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    teacher = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 3
    valid = predicted_positions(_labels(3, 7, 13))
    s = torch.log_softmax(student / temperature, -1)
    t = torch.log_softmax(teacher / temperature, -1)
    reference = temperature**2 * (t.exp() * (t - s)).sum(-1)[valid].sum() / valid.sum()
    (expected,) = torch.autograd.grad(reference * 3.0, student)
    for chunk_elements in (11, 33, 11 * 5, 1 << 24):  # 1, 3 and 5 rows per chunk, and all at once
        monkeypatch.setattr(objective, "KL_CHUNK_ELEMENTS", chunk_elements)
        got = logit_distillation(student, teacher, valid, temperature)
        (grad,) = torch.autograd.grad(got * 3.0, student)  # the upstream gradient scales the stored one
        assert got.item() == pytest.approx(reference.item(), rel=1e-6)
        torch.testing.assert_close(grad, expected.float().double(), rtol=1e-5, atol=1e-7)
        assert torch.all(grad[~valid] == 0)


@pytest.mark.parametrize(
    ("dtype", "rtol"), [(torch.float32, 1e-5), (torch.bfloat16, 1 / 128), (torch.float16, 1 / 1024)]
)
def test_16_and_32_bit_logits_get_a_gradient_of_their_dtype_within_its_rounding_of_float64(dtype, rtol):
    """Under a loss scale, as mixed precision runs: float16 keeps the gradient in float32 until the scale
    arrives, so small entries neither underflow nor overflow. The student's own tensor is left untouched."""
    gen = torch.Generator().manual_seed(21)
    student = (torch.randn(2, 9, 300, generator=gen, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    teacher = (torch.randn(2, 9, 300, generator=gen, dtype=torch.float64) * 4).to(dtype)
    before = student.detach().clone()
    valid = predicted_positions(_labels(2, 9, 22))
    s64 = student.detach().double().requires_grad_()
    s, t = torch.log_softmax(s64, -1), torch.log_softmax(teacher.double(), -1)
    reference = (t.exp() * (t - s)).sum(-1)[valid].sum() / valid.sum()
    (expected,) = torch.autograd.grad(reference, s64)
    scale = 1024.0
    got = logit_distillation(student, teacher, valid)
    (grad,) = torch.autograd.grad(got * scale, student)
    assert got.dtype == torch.float32 and grad.dtype == dtype
    assert got.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(grad.double() / scale, expected, rtol=rtol, atol=1e-9)
    assert torch.equal(student.detach(), before)


def test_the_teacher_gets_no_gradient_and_evaluation_builds_no_graph():
    gen = torch.Generator().manual_seed(25)
    student = torch.randn(2, 6, 17, generator=gen).requires_grad_()
    teacher = torch.randn(2, 6, 17, generator=gen).requires_grad_()
    valid = predicted_positions(_labels(2, 6, 26))
    loss = logit_distillation(student, teacher, valid)
    loss.backward()
    assert teacher.grad is None and student.grad is not None
    with torch.no_grad():
        value = logit_distillation(student, teacher, valid)
    assert value.grad_fn is None and value.item() == pytest.approx(loss.item(), rel=1e-6)


def test_the_logit_distillation_keeps_no_teacher_logits_and_refuses_a_second_backward():
    import weakref

    gen = torch.Generator().manual_seed(23)
    student = torch.randn(2, 5, 13, generator=gen).requires_grad_()
    teacher = torch.randn(2, 5, 13, generator=gen)
    valid = predicted_positions(_labels(2, 5, 24))
    alive = weakref.ref(teacher)
    loss = logit_distillation(student, teacher, valid)
    del teacher
    assert alive() is None  # the teacher's logits are freed once the value and the gradient are computed
    loss.backward(retain_graph=True)
    assert student.grad is not None and student.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_fused_language_model_loss_and_kl_match_float64_in_value_and_gradient(monkeypatch, temperature):
    """The language-model loss computed in the KL's pass: the cross-entropy's value (what transformers'
    causal-LM loss returns, the same divisor) and the gradient of ``CE + ratio * KL``, against float64, for
    every chunk size; rows whose next label is -100 get no gradient."""
    gen = torch.Generator().manual_seed(31)
    student = (torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    teacher = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 3
    labels = _labels(3, 7, 32).remainder(11).masked_fill(_labels(3, 7, 32) == -100, -100)
    config = MaskConfig(distill_logits=0.6, lm_weight=0.8, distill_temperature=temperature)
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    valid = targets != -100
    ce = torch.nn.functional.cross_entropy(student.flatten(0, 1), targets.flatten(), reduction="sum")
    s = torch.log_softmax(student / temperature, -1)
    t = torch.log_softmax(teacher / temperature, -1)
    kl = temperature**2 * (t.exp() * (t - s)).sum(-1)[valid].sum()
    for items in (None, torch.tensor(40)):
        divisor = valid.sum() if items is None else 40
        (expected,) = torch.autograd.grad((ce + 0.6 / 0.8 * kl) / divisor * 3.0, student, retain_graph=True)
        for chunk_elements in (11, 33, 1 << 24):  # 1 and 3 rows per chunk, and all at once
            monkeypatch.setattr(objective, "KL_CHUNK_ELEMENTS", chunk_elements)
            fused = objective.FusedCausalLMLoss(teacher.float(), config)
            loss = fused(student.float(), labels, 11, num_items_in_batch=items)
            (grad,) = torch.autograd.grad(loss * 3.0, student)
            assert loss.item() == pytest.approx((ce / divisor).item(), rel=1e-6)
            assert fused.kl.item() == pytest.approx((kl / divisor).item(), rel=1e-5)
            torch.testing.assert_close(grad, expected.float().double(), rtol=1e-5, atol=1e-7)
            assert torch.all(grad[~valid] == 0)


@pytest.mark.parametrize("items", [None, 50], ids=["one-batch", "num-items"])
@pytest.mark.parametrize("lm_weight", [0.5, 0.0], ids=["kl-in-the-loss", "kl-apart"])
@pytest.mark.parametrize("case", ["shift-labels", "flat-shift-labels", "ignore-index"])
def test_every_term_counts_the_positions_the_language_model_loss_counts(case, lm_weight, items):
    """A batch that passes ``shift_labels`` (already shifted, as context parallelism does; also flattened,
    which transformers' loss accepts) or its own ``ignore_index``: the KL (in the language-model loss's pass or apart) and the hidden-state term count
    the positions transformers' loss counts, divided as it is (also by the Trainer's ``num_items_in_batch``),
    and the logged terms are per such position."""
    distilling, plain = _models(**{**DISTILL, "lm_weight": lm_weight})
    distilling.set_teacher_bf16(False)  # as the hand computation's teacher
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(21))
    labels, extra = ids.clone(), {}
    if case.endswith(
        "shift-labels"
    ):  # positions that the shifted labels of ``labels`` would count are left out
        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
        shift[0, :5], shift[1, 7:] = -100, -100
        extra["shift_labels"] = shift.flatten() if case == "flat-shift-labels" else shift
        valid = shift != -100
    else:
        labels[0, :4], labels[1, 9:] = -1, -1
        extra["ignore_index"] = -1
        valid = predicted_positions(labels, ignore_index=-1)
    assert not torch.equal(valid, predicted_positions(ids))  # a different set of positions than the default
    if items is not None:
        extra["num_items_in_batch"] = torch.tensor(items)
    torch.manual_seed(5)
    out = distilling(input_ids=ids, labels=labels, **extra)
    out.loss.backward()
    with torch.no_grad(), plain.disable_masks():
        plain.eval()
        teacher = plain(input_ids=ids, output_hidden_states=True)
        plain.train()
    torch.manual_seed(5)
    student = plain(input_ids=ids, labels=labels, output_hidden_states=True, **extra)
    kl = logit_distillation(student.logits, teacher.logits, valid, 2.0, items)
    mse = hidden_distillation(student.hidden_states[1:], teacher.hidden_states[1:], valid, items)
    (lm_weight * student.loss + 0.7 * kl + 0.3 * mse).backward()
    per_token = 1.0 if items is None else items / int(valid.sum())  # the logged terms: per counted position
    assert out.loss.item() == pytest.approx(student.loss.item(), rel=1e-6)
    assert out.distill_logits_loss.item() == pytest.approx(0.7 * kl.item() * per_token, rel=1e-5)
    assert out.distill_hidden_loss.item() == pytest.approx(0.3 * mse.item() * per_token, rel=1e-5)
    for name, layer in distilling.masked_layers().items():
        expected = plain.get_submodule(f"base_model.{name}").mask_logits.grad
        torch.testing.assert_close(layer.mask_logits.grad, expected, rtol=1e-4, atol=1e-9)


def test_shift_labels_of_another_size_are_refused_with_the_fix():
    """``shift_labels`` must hold one label per position of ``labels``: another count is named, not indexed."""
    labels = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="one shifted label per position"):
        predicted_positions(labels, torch.zeros(2, 5, dtype=torch.long))
    flat = torch.arange(12) % 3 - 1
    assert torch.equal(predicted_positions(labels, flat, ignore_index=-1), (flat != -1).reshape(2, 6))


def _own_loss(logits, labels, vocab_size, **kwargs):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()) * 2


@pytest.mark.parametrize("case", ["lm-weight-0", "own-loss", "no-loss-function-call", "loss-on-other-logits"])
def test_the_kl_is_computed_apart_where_the_loss_cannot_carry_it(case, monkeypatch):
    """With ``lm_weight=0``, a loss function the user set on the model, a model that computes its loss
    without ``loss_function`` or on other logits than it returns, the model's own loss stays as it is and
    the KL is computed by itself: the same gradient as the hand-computed objective, and the user's loss
    function is left in place."""
    fields = {"distill_logits": 0.7, "lm_weight": 0.0 if case == "lm-weight-0" else 0.5}
    distilling, plain = _models(**fields)
    distilling.set_teacher_bf16(False)  # as the hand computation's teacher
    for model in (distilling, plain):
        if case == "own-loss":
            model.base_model.loss_function = _own_loss
    if case in ("no-loss-function-call", "loss-on-other-logits"):  # a forward that computes its own loss
        from transformers.loss.loss_utils import ForCausalLMLoss

        forward = type(distilling.base_model).forward

        def own_forward(self, *args, labels=None, **kwargs):
            out = forward(self, *args, **kwargs)
            if labels is not None and case == "no-loss-function-call":
                out["loss"] = ForCausalLMLoss(out.logits, labels, self.config.vocab_size)
            elif labels is not None:  # the loss on all but the first position
                out["loss"] = self.loss_function(
                    out.logits[:, 1:].contiguous(), labels[:, 1:], self.config.vocab_size
                )
            return out

        monkeypatch.setattr(type(distilling.base_model), "forward", own_forward)
    calls = []
    call = objective.FusedCausalLMLoss.__call__
    monkeypatch.setattr(
        objective.FusedCausalLMLoss, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k)
    )
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(33))
    torch.manual_seed(9)
    out = distilling(input_ids=ids, labels=ids)
    out.loss.backward()
    assert calls == []  # not a model whose loss the fused pass can carry: the KL computed apart
    if case == "own-loss":
        assert distilling.base_model.loss_function is _own_loss
    torch.manual_seed(9)
    with torch.no_grad(), plain.disable_masks():
        teacher = plain(input_ids=ids)
    student = plain(input_ids=ids, labels=ids)
    kl = logit_distillation(student.logits, teacher.logits, predicted_positions(ids))
    (fields["lm_weight"] * student.loss + 0.7 * kl).backward()
    assert out.loss.item() == pytest.approx(student.loss.item(), rel=1e-6)
    assert out.distill_logits_loss.item() == pytest.approx(0.7 * kl.item(), rel=1e-5)
    for name, layer in distilling.masked_layers().items():
        expected = plain.get_submodule(f"base_model.{name}").mask_logits.grad
        torch.testing.assert_close(layer.mask_logits.grad, expected, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.bfloat16, 1 / 128), (torch.float16, 1 / 1024)])
def test_the_fused_loss_of_16_bit_logits_has_a_gradient_of_their_dtype_within_its_rounding(dtype, rtol):
    """As mixed precision runs: the gradient in the logits' dtype, within its rounding of float64 (float16
    keeps it in float32 until the loss scale arrives); an upstream scale such as 1/3 (gradient accumulation)
    is applied unrounded, so the bfloat16 gradient carries no bias."""
    gen = torch.Generator().manual_seed(41)
    student = (torch.randn(2, 9, 300, generator=gen, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    teacher = (torch.randn(2, 9, 300, generator=gen, dtype=torch.float64) * 4).to(dtype)
    labels = _labels(2, 9, 42)
    config = MaskConfig(distill_logits=1.0)
    s64 = student.detach().double().requires_grad_()
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    valid = targets != -100
    s, t = torch.log_softmax(s64, -1), torch.log_softmax(teacher.double(), -1)
    ce = torch.nn.functional.cross_entropy(s64.flatten(0, 1), targets.flatten(), reduction="sum")
    reference = (ce + (t.exp() * (t - s)).sum(-1)[valid].sum()) / valid.sum()
    (expected,) = torch.autograd.grad(reference, s64)
    for scale in (1.0 / 3.0, 1024.0) if dtype == torch.bfloat16 else (1024.0,):
        loss = objective.FusedCausalLMLoss(teacher, config)(student, labels, 300)
        (grad,) = torch.autograd.grad(loss * scale, student)
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(grad.double() / scale, expected, rtol=rtol, atol=1e-9)
        large = expected.abs() > 1e-3 * expected.abs().max()
        bias = (grad.double() / scale)[large].div(expected[large]).mean() - 1
        assert abs(bias.item()) < 2e-4, bias  # rounding the scale to bfloat16 would shift every entry 2e-3


def test_the_fused_loss_is_computed_beside_the_model_which_keeps_its_loss_function():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = tiny_llama()
    gen = torch.Generator().manual_seed(43)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=gen)
    with torch.no_grad():
        outputs = model(input_ids=ids)
    teacher = type("Teacher", (), {"logits": torch.randn(2, 6, model.config.vocab_size, generator=gen)})()
    labels = torch.randint(0, model.config.vocab_size, (2, 6), generator=gen)
    config = MaskConfig(distill_logits=1.0)
    assert objective.fuses_logit_kl(model, teacher, config)
    with_loss, fused = objective.fused_lm_loss(outputs, teacher, config, {"labels": labels})
    expected = ForCausalLMLoss(outputs.logits, labels, model.config.vocab_size)
    assert with_loss.loss.item() == pytest.approx(expected.item(), rel=1e-6) and fused.kl > 0
    assert (
        list(with_loss.keys())[0] == "loss" and with_loss.to_tuple()[0] is with_loss.loss
    )  # first, as the model's
    assert fused.teacher is None  # the teacher's logits are not kept
    assert "_loss_function" not in vars(model) and model.loss_function is ForCausalLMLoss  # never replaced
    assert not objective.fuses_logit_kl(model, teacher, MaskConfig(distill_logits=1.0, lm_weight=0.0))
    model.config.output_router_logits = True  # a router loss is added to the model's own: not fused
    assert not objective.fuses_logit_kl(model, teacher, config)
