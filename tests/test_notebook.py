"""examples/quickstart.ipynb runs top to bottom in a fresh Jupyter kernel of this interpreter."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the `test` extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs the `test` extra (nbclient)")
pytest.importorskip("ipykernel", reason="the notebook test needs the `test` extra (ipykernel)")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
KERNEL = "hf-maskllm-test"
TEST_BUDGET = "CALIB_SAMPLES, STEPS, EVAL_WINDOWS = 4, 2, 2"


def _kernelspec(folder: Path) -> None:
    """A kernelspec that starts ipykernel with this very interpreter (not whatever `python3` is on PATH)."""
    spec = folder / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )


def test_notebook_is_valid_and_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    assert all(not cell.outputs and cell.execution_count is None for cell in code), (
        "store examples/quickstart.ipynb without outputs (Kernel > Restart & Clear Output)"
    )


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    _kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # the kernel inherits this environment: offline, and this checkout's hf_maskllm first on the path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    workdir = tmp_path / "run"
    workdir.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Every cell runs as written, on a smaller budget: the budget cell's values are overridden right after it
    # (as papermill injects parameters), since each learning step costs seconds on a CPU.
    budget = [i for i, cell in enumerate(nb.cells) if "STEPS, BATCH, SEQLEN = " in cell.source]
    assert len(budget) == 1, "the notebook has no single cell that sets STEPS, BATCH, SEQLEN"
    nb.cells.insert(budget[0] + 1, nbformat.v4.new_code_cell(TEST_BUDGET))
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))

    start = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=900, resources={"metadata": {"path": str(workdir)}}
    )
    try:
        client.execute()  # raises CellExecutionError (with the cell and its traceback) on any error
    finally:
        nbformat.write(nb, tmp_path / "quickstart.executed.ipynb")  # the outputs, for a look after a failure
    seconds = time.perf_counter() - start
    print(f"quickstart.ipynb executed in {seconds:.0f} s")

    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable  # the kernel ran this interpreter
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "learned mask after 2 steps" in text  # the test's budget took effect
    for line in ("| dense ", "| Wanda prior ", "| MaskLLM (learned) ", "2:4 check:", "reloaded sparse model"):
        assert line in text, f"the notebook printed no {line!r}"
    assert any("image/png" in out.get("data", {}) for out in outputs), "the training curve was not plotted"
    assert (workdir / "outputs" / "quickstart" / "mask" / "mask_config.json").is_file()
    assert (workdir / "outputs" / "quickstart" / "sparse-model" / "config.json").is_file()
