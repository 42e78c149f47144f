"""Zero-shot accuracy through lm-evaluation-harness, on a local multiple-choice task written as an lm-eval
task file: the dense SmolLM2-135M, a masked one and its compressed checkpoint, each checked against the
accuracy computed here from the model's own log-likelihoods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_maskllm.errors import ConfigError

DOCS = [
    ("The capital of France is", [" Paris", " a banana", " blue"], 0),
    ("Water freezes at zero degrees", [" Celsius", " kilograms", " happily"], 0),
    ("The sun rises in the", [" east", " fridge", " seven"], 0),
    ("A week has seven", [" days", " cars", " oceans"], 0),
    ("Cats often chase", [" galaxies", " mice", " taxes"], 1),
    ("The opposite of hot is", [" loud", " square", " cold"], 2),
    ("Two plus two equals", [" purple", " four", " Tuesday"], 1),
    ("Birds can fly because they have", [" receipts", " wheels", " wings"], 2),
    ("The largest planet in the solar system is", [" Jupiter", " Mercury", " Mars"], 0),
    ("Photosynthesis takes place in the", [" chloroplasts", " mitochondria", " nucleus"], 0),
    ("The chemical symbol for gold is", [" Ag", " Au", " Fe"], 1),
    ("Shakespeare wrote the play", [" Hamlet", " Faust", " Candide"], 0),
]


def task_folder(root: Path) -> Path:
    """An lm-eval task file ``tiny_mc`` and its data, in ``root``."""
    data = root / "tiny_mc.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS),
        encoding="utf-8",
    )
    (root / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n",
        encoding="utf-8",
    )
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """One task folder for the module: lm-eval indexes an unchanged folder once per process."""
    return task_folder(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def magnitude_mask(tmp_path_factory):
    """The real SmolLM2 under a magnitude 2:4 mask (eval mode), its tokenizer, and that mask saved."""
    from hf_maskllm import MaskConfig, get_mask_model
    from hf_maskllm.embedded import load_smollm2

    model, tokenizer = load_smollm2()
    mask_model = get_mask_model(model, MaskConfig(prior="magnitude"))
    saved = tmp_path_factory.mktemp("magnitude") / "mask"
    mask_model.save_pretrained(saved)
    return mask_model, tokenizer, saved


@torch.no_grad()
def own_accuracy(model, tokenizer) -> float:
    """The share of documents whose answer has the highest summed log-probability (lm-eval's ``acc``)."""
    model.eval()
    right = 0
    for question, choices, answer in DOCS:
        context = tokenizer(question)["input_ids"]
        scores = []
        for choice in choices:
            whole = tokenizer(question + choice)["input_ids"]
            continuation = whole[len(context) :]
            logits = model(input_ids=torch.tensor([whole[:-1]])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)[len(context) - 1 :]
            scores.append(float(logprobs.gather(1, torch.tensor(continuation)[:, None]).sum()))
        right += int(max(range(len(choices)), key=scores.__getitem__) == answer)
    return right / len(DOCS)


@pytest.mark.slow
def test_lm_eval_scores_the_dense_masked_and_compressed_model(tmp_path, tasks, magnitude_mask):
    from transformers import AutoModelForCausalLM

    from hf_maskllm.embedded import load_smollm2
    from hf_maskllm.zero_shot import evaluate_zero_shot

    model, _ = load_smollm2()
    mask_model, tokenizer, _ = magnitude_mask
    dense = evaluate_zero_shot(model, tokenizer, ["tiny_mc"], include_path=tasks)["tiny_mc"]
    assert dense["acc,none"] == own_accuracy(model, tokenizer)
    assert dense["acc,none"] >= 0.75  # easy questions for the dense model

    masked = evaluate_zero_shot(mask_model, tokenizer, ["tiny_mc"], include_path=tasks)["tiny_mc"]
    assert masked["acc,none"] == own_accuracy(mask_model, tokenizer)  # the hard masks were applied

    mask_model.save_pretrained(tmp_path / "sparse", merged=True, tokenizer=tokenizer)
    compressed = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    loaded = evaluate_zero_shot(compressed, tokenizer, ["tiny_mc"], include_path=tasks)["tiny_mc"]
    assert loaded["acc,none"] == masked["acc,none"]
    assert loaded["sample_len"] == len(DOCS)


@pytest.mark.slow
def test_the_cli_runs_a_task_on_a_saved_mask(tmp_path, tasks, magnitude_mask, capsys):
    from hf_maskllm.cli import main

    mask_model, tokenizer, saved = magnitude_mask
    main(["zero-shot", "--mask", str(saved), "--tasks", "tiny_mc", "--include-path", str(tasks)]
         + ["--output", str(tmp_path / "zs.json")])  # fmt: skip
    results = json.loads((tmp_path / "zs.json").read_text())
    assert results["tiny_mc"]["acc,none"] == own_accuracy(mask_model, tokenizer)
    assert "| tiny_mc | acc,none |" in capsys.readouterr().out


def test_bad_task_names_are_refused_before_any_work(tasks):
    from models import tiny_llama

    from hf_maskllm.zero_shot import evaluate_zero_shot

    with pytest.raises(ConfigError, match="non-empty list"):
        evaluate_zero_shot(tiny_llama(), None, "hellaswag")
    with pytest.raises(ConfigError, match=r"knows no task \['no_such_task'\]"):
        evaluate_zero_shot(tiny_llama(), None, ["no_such_task"], include_path=tasks)


def test_the_task_index_is_built_once_per_folder_state(tmp_path):
    """lm-eval's task index (seconds to build) is reused across calls, and built anew once the folder changes."""
    from hf_maskllm.zero_shot import _folder_state, _task_manager

    built = []

    class Index:
        def __init__(self, include_path=None, include_defaults=True):
            built.append(include_path)

    task_folder(tmp_path)
    first = _task_manager(Index, _folder_state(tmp_path))
    assert _task_manager(Index, _folder_state(tmp_path)) is first and built == [str(tmp_path.resolve())]
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "other.yaml").write_text("task: other\n", encoding="utf-8")  # a task file added
    assert _task_manager(Index, _folder_state(tmp_path)) is not first and len(built) == 2
    _task_manager(Index, None)
    assert built[-1] is None  # lm-eval's own tasks alone


def test_own_tasks_are_evaluated_without_indexing_lm_evals_tasks(tmp_path, monkeypatch):
    """Tasks all defined in include_path need no index of lm-eval's own tasks; any other name (one of lm-eval's
    tasks, a group or tag of the folder, which may name lm-eval's tasks, or an unknown name) gets the full one."""
    import lm_eval
    import lm_eval.models.huggingface
    import lm_eval.tasks
    from models import tiny_llama

    from hf_maskllm.zero_shot import _folder_state, _task_manager, evaluate_zero_shot

    built, used = [], []

    class Index:
        def __init__(self, include_path=None, include_defaults=True):
            built.append(include_defaults)
            self.all_subtasks = ["tiny_mc", *(["hellaswag"] if include_defaults else [])]
            self.all_tasks = [*self.all_subtasks, "tiny_group"]

    def simple_evaluate(model, tasks, task_manager, **kwargs):
        used.append(task_manager)
        return {"results": {task: {"acc,none": 0.5} for task in tasks}}

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Index)
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    monkeypatch.setattr(lm_eval.models.huggingface, "HFLM", lambda **kwargs: None)
    _task_manager.cache_clear()
    folder = task_folder(tmp_path)
    assert evaluate_zero_shot(tiny_llama(), None, ["tiny_mc"], include_path=folder) == {
        "tiny_mc": {"acc,none": 0.5}
    }
    assert built == [False] and used == [_task_manager(Index, _folder_state(folder), False)]
    for names in (["tiny_mc", "hellaswag"], ["tiny_group"]):
        evaluate_zero_shot(tiny_llama(), None, names, include_path=folder)
        assert used[-1] is _task_manager(Index, _folder_state(folder), True)
    assert built == [False, True]  # each index built once
    with pytest.raises(ConfigError, match="knows no task"):
        evaluate_zero_shot(tiny_llama(), None, ["no_such_task"], include_path=folder)
    _task_manager.cache_clear()


def test_a_missing_lm_eval_names_the_extra(monkeypatch):
    import sys

    from models import tiny_llama

    from hf_maskllm.zero_shot import evaluate_zero_shot

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'hf_maskllm\[eval\]'"):
        evaluate_zero_shot(tiny_llama(), None, ["tiny_mc"])
