"""examples/quickstart.ipynb runs top to bottom in a fresh Jupyter kernel of this interpreter."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the `test` extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs the `test` extra (nbclient)")
pytest.importorskip("ipykernel", reason="the notebook test needs the `test` extra (ipykernel)")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
# 2 x 64 calibration tokens, 2 steps of 2 x 64 tokens, 1 x 128 held-out tokens per perplexity
TEST_BUDGET = "CALIB_SAMPLES, CALIB_SEQLEN, STEPS, SEQLEN, EVAL_WINDOWS, EVAL_SEQLEN = 2, 64, 2, 64, 1, 128"


def _executor():
    """``examples/execute_notebook.py``: the one way the notebook is run (to store its outputs, and here)."""
    spec = importlib.util.spec_from_file_location(
        "execute_notebook", ROOT / "examples" / "execute_notebook.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stream_text(nb) -> str:
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    return "".join(out.get("text", "") for out in outputs if out.output_type == "stream")


def test_notebook_is_stored_with_the_outputs_of_a_full_run():
    """The page a reader opens shows a whole run at the notebook's own budget: every code cell ran, in
    order, without an error, and the training curve is an image."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), (
        "store examples/quickstart.ipynb as `python examples/execute_notebook.py` writes it (a run from the top)"
    )
    outputs = [out for cell in code for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    budget = next(cell.source for cell in code if "STEPS, SEQS, SEQLEN = " in cell.source)
    steps = int(budget.split("STEPS, SEQS, SEQLEN = ")[1].split(",")[0])
    assert f"learned mask after {steps} steps" in _stream_text(nb)  # the stored run used the stored budget
    assert any("image/png" in out.get("data", {}) for out in outputs), "the training curve is not stored"


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:  # run from a clean slate: nothing stored counts
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    start = time.perf_counter()
    try:
        # every cell runs as written, on a smaller budget (each learning step costs seconds on a CPU)
        _executor().execute(nb, tmp_path, budget=TEST_BUDGET)
    finally:
        nbformat.write(nb, tmp_path / "quickstart.executed.ipynb")  # the outputs, for a look after a failure
    seconds = time.perf_counter() - start
    print(f"quickstart.ipynb executed in {seconds:.0f} s")

    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable  # the kernel ran this interpreter
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = _stream_text(nb)
    assert "learned mask after 2 steps (256 tokens)" in text  # the test's budget took effect
    for line in ("| dense ", "| Wanda prior ", "| MaskLLM (learned) ", "2:4 check:", "reloaded sparse model"):
        assert line in text, f"the notebook printed no {line!r}"
    assert any("image/png" in out.get("data", {}) for out in outputs), "the training curve was not plotted"
    workdir = tmp_path / "run"
    assert (workdir / "outputs" / "quickstart" / "mask" / "mask_config.json").is_file()
    assert (workdir / "outputs" / "quickstart" / "sparse-model" / "config.json").is_file()
