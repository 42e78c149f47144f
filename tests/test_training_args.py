"""The recipe's training arguments: a run that departs from them is named departure by departure (by
MaskAnnealCallback, unless check_recipe=False)."""

from __future__ import annotations

import warnings

import pytest
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from trainer_helpers import TokenDataset, cyclic_language, training_args
from transformers import Trainer

from hf_maskllm import MaskAdamW, MaskAnnealCallback, MaskConfig, get_mask_model


def _no_departure_warning(run) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    assert not [w for w in caught if "departs from the MaskLLM recipe" in str(w.message)]


def test_plain_training_arguments_are_named_as_departures(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    trainer = Trainer(
        model=mm,
        args=training_args(tmp_path, max_steps=1, learning_rate=5e-5, lr_scheduler_type="linear"),
        train_dataset=TokenDataset(cyclic_language(8, seed=0)),
        optimizer_cls_and_kwargs=(MaskAdamW, {"lr": 5e-4, "compile": False}),
        callbacks=[MaskAnnealCallback(compile_sampling=False)],
    )
    with pytest.warns(UserWarning, match="departs from the MaskLLM recipe") as caught:
        trainer.train()
    message = next(str(w.message) for w in caught if "departs" in str(w.message))
    for words in ("weight decay on the logits [0.0]", "LR schedule 'linear'", "learning rate [0.0005] differs",
                  "MaskTrainingArguments", "check_recipe=False"):  # fmt: skip
        assert words in message
    quiet = Trainer(
        model=get_mask_model(tiny_llama(), MaskConfig()),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=TokenDataset(cyclic_language(8, seed=0)),
        callbacks=[MaskAnnealCallback(compile_sampling=False, check_recipe=False)],
    )
    _no_departure_warning(quiet.train)
