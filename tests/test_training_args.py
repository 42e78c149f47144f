"""The recipe's training arguments: a run that departs from them is named departure by departure (by
MaskAnnealCallback, unless check_recipe=False); the paper's cosine schedule is not a departure."""

from __future__ import annotations

import warnings

import pytest
from models import single_thread, tiny_llama  # noqa: F401  (single_thread is an autouse fixture)
from trainer_helpers import TokenDataset, cyclic_language, training_args
from transformers import Trainer

from hf_maskllm import MaskAdamW, MaskAnnealCallback, MaskConfig, MaskTrainingArguments, get_mask_model
from hf_maskllm.training_args import PAPER_LR_SCHEDULE, recipe_departures


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


def test_the_default_and_the_papers_lr_schedules_are_the_recipe_others_depart(tmp_path):
    mm = get_mask_model(tiny_llama(), MaskConfig())
    optimizer = MaskAdamW(
        [{"params": [p for p in mm.parameters() if p.requires_grad], "weight_decay": 0.1}],
        lr=5e-4, betas=(0.9, 0.95), compile=False,
    )  # fmt: skip

    def departures(**kwargs) -> list[str]:
        return recipe_departures(MaskTrainingArguments(output_dir=str(tmp_path), **kwargs), optimizer, mm)

    defaults = MaskTrainingArguments(output_dir=str(tmp_path))
    assert defaults.lr_scheduler_type == "constant"
    assert (defaults.per_device_train_batch_size, defaults.gradient_accumulation_steps) == (2, 1)
    assert departures() == []
    assert departures(**PAPER_LR_SCHEDULE) == []
    assert departures(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.2}) == [
        "LR schedule 'cosine_with_min_lr' (recipe: lr_scheduler_type='constant'; the paper's cosine to 10%, "
        "lr_scheduler_type='cosine_with_min_lr' with lr_scheduler_kwargs={'min_lr_rate': 0.1}, is accepted too)"
    ]
    assert departures(warmup_steps=5) == [  # transformers' constant schedule drops warm-up silently
        "warm-up requested, but transformers ignores it with lr_scheduler_type='constant': "
        "use lr_scheduler_type='constant_with_warmup'"
    ]
    assert departures(lr_scheduler_type="constant_with_warmup", warmup_steps=5) == []
    assert departures(gradient_accumulation_steps=16) == []  # tokens per step are the budget's
    assert departures(per_device_train_batch_size=1, gradient_accumulation_steps=2) == []  # the reference's
    assert departures(per_device_train_batch_size=4) == [
        "micro-batches of 4 sequences share one mask sample (recipe: at most 2 per sample, "
        "per_device_train_batch_size=2; raise gradient_accumulation_steps for more tokens per step)"
    ]
    assert [d.split(" (")[0] for d in departures(lr_scheduler_type="linear", max_grad_norm=0.0)] == [
        "LR schedule 'linear'",
        "gradient clipping at 0.0",
    ]
