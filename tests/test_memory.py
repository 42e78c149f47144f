"""training_state_bytes: what a training run holds per masked weight, the callback's state included."""

from __future__ import annotations

import pytest
import torch
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from trainer_helpers import TokenDataset, cyclic_language

from hf_maskllm import MaskAnnealCallback, MaskConfig, get_mask_model
from hf_maskllm.learn import learn_mask
from hf_maskllm.memory import training_state_bytes


def test_state_held_across_steps_is_counted_and_within_8_bytes(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = learn_mask(mm, TokenDataset(cyclic_language(8, seed=0)), max_steps=2, output_dir=str(tmp_path),
                         compile_sampling=False, disable_tqdm=True)  # fmt: skip
    sizes = training_state_bytes(mm, trainer.optimizer, trainer.callback_handler.callbacks)
    layers = mm.masked_layers().values()
    groups = sum(layer.mask_logits.shape[0] for layer in layers)
    masked = sum(layer.out_features * layer.in_features for layer in layers)
    # one byte per group (the previous hard choice, for the flip rate) and the [C, C] uint8 Hamming table
    assert sizes["callbacks"] == groups + 6 * 6
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total")
    # 3 + 3 + 1.5 + 0.25, plus a few fixed bytes (step counters, the table) on this tiny model
    assert sizes["total"] / masked == pytest.approx(7.75, abs=2e-3)
    assert sizes["total"] / masked <= 8
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MaskAnnealCallback))
    assert all(t.dtype == torch.uint8 for t in callback._previous.values())
