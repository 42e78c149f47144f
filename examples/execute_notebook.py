"""Execute examples/quickstart.ipynb top to bottom in a fresh kernel of this interpreter.

    HF_HUB_OFFLINE=1 python examples/execute_notebook.py            # store the outputs in the notebook
    HF_HUB_OFFLINE=1 python examples/execute_notebook.py --out X.ipynb

The notebook runs at the budget written in it (its outputs are what a reader sees on the page), in a
temporary working folder (its ``outputs/`` do not land in the repository), with this checkout's
``hf_maskllm`` first on the path. ``tests/test_notebook.py`` runs it through :func:`execute` at a
smaller budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
KERNEL = "hf-maskllm-notebook"
BUDGET_CELL = "STEPS, SEQS, SEQLEN = "


def _kernelspec(folder: Path) -> None:
    """A kernelspec that starts ipykernel with this very interpreter (not whatever `python3` is on PATH)."""
    spec = folder / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )


def execute(nb: nbformat.NotebookNode, workdir: Path, budget: str | None = None) -> nbformat.NotebookNode:
    """Run ``nb`` in ``workdir`` and return it with its outputs; ``budget`` (code) runs right after the
    budget cell, overriding its values as papermill injects parameters. Raises ``CellExecutionError``
    (naming the cell, with its traceback) on any error."""
    if budget is not None:
        cells = [i for i, cell in enumerate(nb.cells) if BUDGET_CELL in cell.source]
        if len(cells) != 1:
            raise ValueError(f"the notebook has no single cell that sets {BUDGET_CELL.strip()}")
        nb.cells.insert(cells[0] + 1, nbformat.v4.new_code_cell(budget))
    _kernelspec(workdir / "jupyter")
    env = {
        "JUPYTER_PATH": str(workdir / "jupyter"),
        # the kernel inherits this environment: offline, and this checkout's hf_maskllm first on the path
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        (workdir / "run").mkdir(exist_ok=True)
        client = nbclient.NotebookClient(
            nb, kernel_name=KERNEL, timeout=1800, resources={"metadata": {"path": str(workdir / "run")}}
        )
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def coalesce_streams(nb: nbformat.NotebookNode) -> None:
    """Merge each cell's consecutive stream outputs and keep what a terminal shows of progress bars
    (the text after a line's last carriage return), as a notebook front-end displays them."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        merged: list = []
        for out in cell.outputs:
            if (
                out.output_type == "stream"
                and merged
                and merged[-1].output_type == "stream"
                and (merged[-1].name == out.name)
            ):
                merged[-1].text += out.text
            else:
                merged.append(out)
        for out in merged:
            if out.output_type == "stream":
                out.text = "\n".join(line.rsplit("\r", 1)[-1] for line in out.text.split("\n"))
        cell.outputs = merged


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=NOTEBOOK, help="where to write the executed notebook")
    args = p.parse_args()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    metadata = dict(nb.metadata)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        print(f"executing {NOTEBOOK.name} in {tmp} (several minutes on a CPU) ...", flush=True)
        execute(nb, Path(tmp))
    coalesce_streams(nb)
    nb.metadata = nbformat.from_dict(
        metadata
    )  # the kernel's name on this machine is not part of the notebook
    nbformat.validate(nb)
    nbformat.write(nb, args.out)
    print(f"executed in {time.perf_counter() - start:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
