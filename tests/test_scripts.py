"""The scripts users run as ``python benchmarks/<name>.py`` or ``python examples/<name>.py``.

Python puts a script's folder first on ``sys.path``, so a script named like a module the stack imports
(or only probes for, as transformers probes for the optional ``kernels`` package) replaces that module in
every script of the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a script's imports pull in: transformers' model and Trainer modules import its optional integrations
STACK = "transformers.modeling_utils, transformers.trainer, peft, accelerate, datasets, hf_maskllm.learn"


def test_no_script_shadows_a_module_the_stack_imports() -> None:
    folders = [str(ROOT / folder) for folder in ("benchmarks", "examples")]
    # both folders first on the path, in one interpreter: a shadowing file in either is imported instead
    code = f"import sys; sys.path[:0] = {folders!r}; import {STACK}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"a file in benchmarks/ or examples/ shadows a module:\n{run.stderr[-3000:]}"
