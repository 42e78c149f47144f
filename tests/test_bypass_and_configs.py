"""Nothing in a MaskModel is rewired while it runs, configs stay as the caller wrote them, and PEFT on a
compressed model says how to make it work.

The unmasked (teacher) pass is a flag the masked layers read, not a swap of modules or modes; the
objective is computed beside the model, whose ``loss_function`` stays; a merged save reads new tensors and
leaves the model as it is.
"""

from __future__ import annotations

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (autouse fixture)
from torch import nn

from hf_maskllm import MaskConfig, MaskedLinear, get_mask_model


def _distilling(**fields) -> nn.Module:
    config = MaskConfig(prior="magnitude", logits_dtype="float32", **fields)
    mm = get_mask_model(tiny_llama(), config).train()
    mm.set_schedule_progress(0.0)
    return mm


def test_hooks_fire_on_the_same_module_objects_in_the_student_and_the_teacher_pass():
    mm = _distilling(distill_logits=1.0, distill_hidden=0.5)
    tree = {name: id(module) for name, module in mm.named_modules()}
    modes = {name: module.training for name, module in mm.named_modules()}
    seen: list[tuple[int, bool, bool]] = []  # (module, masks off, grad enabled) per call

    def hook(module, args, out):
        seen.append((id(module), module.schedule.masks_disabled, torch.is_grad_enabled()))
        assert {name: id(m) for name, m in mm.named_modules()} == tree  # nothing swapped mid-step
        assert {name: m.training for name, m in mm.named_modules()} == modes  # no mode flipped

    layers = mm.masked_layers()
    handles = [layer.register_forward_hook(hook) for layer in layers.values()]
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    mm(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    teacher = [module for module, off, grad in seen if off and not grad]
    student = [module for module, off, grad in seen if not off and grad]
    assert len(teacher) == len(student) == len(layers) == len(seen) / 2
    assert teacher == student == [id(layer) for layer in layers.values()]
    assert "_loss_function" not in vars(mm.base_model)  # the model's loss function was never replaced
    assert not mm.schedule.masks_disabled


def test_disable_masks_is_a_flag_that_runs_the_base_layers():
    mm = _distilling()
    mm.eval()
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    tree = {name: id(module) for name, module in mm.named_modules()}
    with torch.no_grad():
        masked = mm(input_ids=ids).logits
        with mm.disable_masks():
            assert {name: id(module) for name, module in mm.named_modules()} == tree
            dense = mm(input_ids=ids).logits
        plain = tiny_llama()(input_ids=ids).logits  # the same seeded weights, never wrapped
    assert torch.equal(dense, plain) and not torch.allclose(masked, dense, atol=1e-4)
    with pytest.raises(RuntimeError, match="inside"), mm.disable_masks():
        raise RuntimeError("inside")
    assert not mm.schedule.masks_disabled


def test_a_compiled_model_runs_ten_distilling_steps_without_recompiling():
    """``torch.compile`` of the whole MaskModel: the first step compiles (both passes), the next nine reuse it
    while tau, kappa and the regulariser's weight anneal, which the layers read as tensors (the backend does not
    matter for recompilation: dynamo's guards decide). The compiled run gives the eager run's losses exactly:
    the eager backend runs the same kernels in the same order, with the same noise."""
    import torch._dynamo

    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))

    def run(compile_model: bool) -> tuple[list[tuple[float, float, float]], list[tuple[float, float]]]:
        torch.manual_seed(0)
        mm = _distilling(distill_logits=1.0, sparse_reg=1e-3)
        optimizer = torch.optim.SGD([p for p in mm.parameters() if p.requires_grad], lr=0.1)
        model = torch.compile(mm, backend="eager") if compile_model else mm
        schedules, losses = [], []
        for i in range(10):
            mm.set_schedule_progress(i / 10)
            schedules.append((mm.schedule.tau, mm.schedule.kappa, mm.schedule.sparse_reg_weight))
            with torch._dynamo.config.patch(error_on_recompile=i > 0):  # only the first step compiles
                outputs = model(input_ids=ids, labels=ids)
            outputs.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append((outputs.loss.item(), outputs.sparse_reg_loss.item()))
        return schedules, losses

    torch._dynamo.reset()
    try:
        schedules, compiled_losses = run(compile_model=True)
    finally:
        torch._dynamo.reset()
    assert all(type(value) is float for values in schedules for value in values)  # what users read
    for before, after in zip(schedules, schedules[1:]):  # every step has a new tau, kappa and weight
        assert all(a != b for a, b in zip(before, after))
    assert all(weight > 0 for _, _, weight in schedules)
    eager_schedules, eager_losses = run(compile_model=False)
    assert eager_schedules == schedules
    assert compiled_losses == eager_losses
    assert len(set(compiled_losses)) == len(compiled_losses)  # the masks train: every step's losses differ


def test_a_merged_save_leaves_the_model_as_it_was(tmp_path):
    mm = _distilling()
    weights = {name: (p.data_ptr(), p.detach().clone()) for name, p in mm.base_model.named_parameters()}
    tree = {name: id(module) for name, module in mm.named_modules()}
    mm.save_pretrained(tmp_path / "merged", merged=True)
    mm.save_pretrained(tmp_path / "dense", merged=True, dense=True)
    assert {name: id(module) for name, module in mm.named_modules()} == tree
    for name, p in mm.base_model.named_parameters():
        assert p.data_ptr() == weights[name][0] and torch.equal(p, weights[name][1]), name
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    for name, layer in mm.masked_layers().items():
        expected = layer.base_layer.weight * layer.hard_mask()
        assert torch.equal(dense.get_submodule(name).weight, expected), name
    assert not any(isinstance(m, MaskedLinear) for m in dense.modules())


def test_a_config_stays_as_the_caller_wrote_it():
    """One config for two models: the resolved defaults live in the mask's copy, the caller's config is untouched."""
    ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    cfg = MaskConfig(prior="magnitude")
    a = get_mask_model(tiny_llama(seed=0), cfg, calibration_data=ids)
    b = get_mask_model(tiny_llama(seed=1), cfg)  # no calibration data: the Wanda order is off for this one
    assert cfg == MaskConfig(prior="magnitude")
    assert a.mask_config.wanda_strength == 4.0 and b.mask_config.wanda_strength == 0.0
    assert a.mask_config.distill_logits == 1.0 and a.mask_config is not cfg


def test_peft_on_a_compressed_model_without_register_lora_names_the_fix(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from sparse_helpers import merged_model
    from transformers import AutoModelForCausalLM

    from hf_maskllm.sparse import register_lora, save_compressed

    save_compressed(merged_model("llama"), tmp_path / "c")
    with pytest.raises(ValueError) as raised:
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(tmp_path / "c"), LoraConfig(r=2, target_modules=["q_proj"])
        )
    assert "SparseLinear(" in str(raised.value) and "hf_maskllm.sparse.register_lora(config)" in str(
        raised.value
    )
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "c"),
        register_lora(LoraConfig(r=2, target_modules=["q_proj"])),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError) as raised:  # loading the saved adapter needs the same
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "c"), tmp_path / "adapter")
    assert "hf_maskllm.sparse.register_lora(config)" in str(raised.value)


@pytest.mark.slow
def test_an_fsdp_run_with_the_distillation_terms_matches_the_single_process_sum(tmp_path, monkeypatch):
    """``tests/fsdp_distill.py`` in 2 CPU processes (gloo, FSDP2): each process distils its half of a batch
    (the teacher pass through the sharded model, masks bypassed by the flag). Repeated in this process with
    the same mask samples, the halves' terms summed in float64 and their gradients summed give the same
    values as the processes' shares and FSDP's reduced gradients."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    import fsdp_distill

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(here / "fsdp_distill.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    shares = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    fsdp_grads = load_file(tmp_path / "grads.safetensors")

    from hf_maskllm.adapters import layer as layer_module
    from hf_maskllm.numerics import sampling

    def seed_of(rank: int):  # draw_seed as it runs on process ``rank`` (each process offsets its noise)
        def draw(device="cpu"):
            seed = torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device) + 1_000_003 * rank
            return sampling._as_int32(seed & sampling._M32)

        return draw

    mm = fsdp_distill.build()
    ids, labels = fsdp_distill.batch()
    items = int((labels[:, 1:] != -100).sum())
    total = {"distill_logits": 0.0, "distill_hidden": 0.0}  # float64: Python floats
    for rank in (0, 1):
        part = slice(rank * 2, rank * 2 + 2)
        torch.manual_seed(fsdp_distill.seed(rank))
        monkeypatch.setattr(layer_module, "draw_seed", seed_of(rank))
        outputs = mm(input_ids=ids[part], labels=labels[part], num_items_in_batch=torch.tensor(items))
        outputs.loss.backward()  # the halves' gradients add up in .grad
        count = int((labels[part][:, 1:] != -100).sum())
        for name in total:
            total[name] += float(outputs[f"{name}_loss"]) * count / items
    for name, value in total.items():
        assert value > 0
        assert shares[0][name] + shares[1][name] == pytest.approx(value, rel=1e-6), name
    for name, layer in mm.masked_layers().items():
        # float32 sums in another order (FSDP's reduce-scatter of twice each half, halved): equal up to the
        # rounding of the largest entry where the halves cancel
        grad = layer.mask_logits.grad
        atol = 1e-6 * float(grad.abs().max())
        torch.testing.assert_close(fsdp_grads[name], grad, rtol=1e-5, atol=atol)


def test_a_fixture_run_gives_the_results_it_gave_before_the_bypass_bit_for_bit(tmp_path):
    """``fixtures/training_run.json``: logs and final logits of a 6-step distilling run recorded when the
    unmasked pass still swapped modules and modes. Compared exactly where torch, transformers and the
    CPU's instruction set are the recording's (the kernels and the teacher's precision follow them), else
    within float tolerance."""
    import hashlib
    import json
    import sys
    from pathlib import Path

    import transformers

    from hf_maskllm.learn import learn_mask
    from hf_maskllm.numerics.fused_linear import native_bf16_matmul

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    from trainer_helpers import TokenDataset

    expected = json.loads((here / "fixtures" / "training_run.json").read_text())
    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    mm = get_mask_model(tiny_llama(seed=1), MaskConfig())
    trainer = learn_mask(
        mm, TokenDataset(ids), max_steps=6, logging_steps=1, compile_sampling=False, disable_tqdm=True,
        output_dir=str(tmp_path),
    )  # fmt: skip
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch")
    logs = [{k: v for k, v in entry.items() if k not in timing} for entry in trainer.state.log_history]
    same = (
        expected["torch"] == torch.__version__
        and expected["transformers"] == transformers.__version__
        and expected["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        and expected["native_bf16"] == native_bf16_matmul(torch.device("cpu"))
    )
    if not same:  # other kernels: the same schedule, and losses within what rounding moves in 6 steps
        keys = ("step", "tau", "kappa", "loss")
        got = [{k: entry[k] for k in keys if k in entry} for entry in logs]
        want = [{k: entry[k] for k in keys if k in entry} for entry in expected["logs"]]
        assert got == [pytest.approx(entry, rel=1e-2) for entry in want]
        return
    assert logs == expected["logs"]
    for name, layer in mm.masked_layers().items():
        data = layer.mask_logits.detach().float().contiguous().numpy().tobytes()
        assert hashlib.sha256(data).hexdigest() == expected["logits_sha256"][name], name
