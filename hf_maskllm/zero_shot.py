"""Zero-shot accuracy with lm-evaluation-harness, as pruning papers report it (``pip install hf_maskllm[eval]``).

:func:`evaluate_zero_shot` runs lm-eval's Hugging Face wrapper (``HFLM``) on a model in memory: a
masked model (:class:`~hf_maskllm.MaskModel`, evaluated with its hard masks), a merged one, or a
compressed 2:4 checkpoint loaded with ``from_pretrained``, which lm-eval's own command line cannot load
(it does not import hf_maskllm, which registers the format). ``hf-maskllm zero-shot`` is the same from
the command line. :data:`PAPER_TASKS` are the tasks the MaskLLM paper reports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import nn

from .errors import ConfigError

__all__ = ["PAPER_TASKS", "evaluate_zero_shot"]

PAPER_TASKS = ("hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa", "race")


def evaluate_zero_shot(
    model: nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    batch_size: int = 1,
    limit: int | float | None = None,
    include_path: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` (e.g. ``acc,none``, ``acc_norm,none``) of lm-eval's ``tasks`` on ``model``.

    ``limit``: documents per task (a fraction for a share); ``include_path``: a folder of lm-eval task
    YAML files of your own; ``num_fewshot``: ``None`` or 0 for zero-shot. A :class:`MaskModel` is put in
    eval mode (hard masks) and evaluated through its base model; its masks stay attached.
    """
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError(
            f"Zero-shot evaluation needs lm-evaluation-harness ({e}); install it with "
            "`pip install 'hf_maskllm[eval]'`."
        ) from None
    from .adapters import MaskModel

    if isinstance(tasks, str) or not tasks:
        raise ConfigError(f"tasks must be a non-empty list of lm-eval task names, got {tasks!r}.")
    folder = None if include_path is None else _folder_state(include_path)
    task_manager = None
    if folder is not None:  # your own tasks alone need no index of lm-eval's (seconds to build)
        own = _task_manager(TaskManager, folder, False)
        if all(task in own.all_subtasks for task in tasks):  # tasks, not groups or tags that may name others
            task_manager = own
    if task_manager is None:
        task_manager = _task_manager(TaskManager, folder, True)
    unknown = [task for task in tasks if task not in task_manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"lm-eval knows no task {unknown}; check the names (`lm_eval --tasks list`), or pass the folder of "
            "your task files as include_path."
        )
    if isinstance(model, MaskModel):
        model.eval()
        model = model.get_base_model()
    model.eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=task_manager,
        log_samples=False,
        bootstrap_iters=0,
    )
    return {
        task: {
            k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for task, metrics in results["results"].items()
    }


def _folder_state(include_path: str | os.PathLike) -> tuple[str, tuple[tuple[str, int], ...]]:
    """A task folder (or file) and the modification time of every file in it: a changed folder is indexed anew."""
    root = Path(include_path).resolve()
    files = sorted(path for path in root.rglob("*") if path.is_file()) if root.is_dir() else [root]
    files = [path for path in files if path.exists()]
    return str(root), tuple((str(path), path.stat().st_mtime_ns) for path in files)


@lru_cache(maxsize=8)
def _task_manager(
    task_manager_class: type, folder: tuple[str, tuple[tuple[str, int], ...]] | None, defaults: bool = True
) -> Any:
    """lm-eval's index of ``folder``'s tasks and, with ``defaults``, of its own, built once per process:
    indexing lm-eval's own reads every task file it ships, over ten seconds on a CPU, and evaluating several
    models would repeat it."""
    if folder is None:
        return task_manager_class()
    return task_manager_class(include_path=folder[0], include_defaults=defaults)
