"""notebooks/walkthrough.ipynb: it runs top to bottom in a fresh kernel of this interpreter, from a
scratch working directory, as a fresh clone's CI runs it, and leaves nothing behind; and the copy in
the repository carries its outputs, so that it renders with its pictures where people read it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "walkthrough.ipynb"
KERNEL = "walkthrough-test"


def kernel_manager(kernels: Path) -> KernelManager:
    """A kernel that runs this interpreter (`sys.executable`), whatever kernels Jupyter finds installed
    elsewhere: the notebook must import the package under test from this environment."""
    spec = kernels / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "the interpreter running the tests", "language": "python"}))
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def pictures(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in output.get("data", {})
               for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs)


def test_committed_notebook_carries_its_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code), "commit the notebook executed"
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "run top to bottom, once"
    assert not [output for cell in code for output in cell.outputs if output.output_type == "error"]
    assert pictures(notebook) >= 10


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    workdir, scratch = tmp_path / "workdir", tmp_path / "tmp"
    workdir.mkdir()
    scratch.mkdir()
    client = NotebookClient(notebook, km=kernel_manager(tmp_path / "kernels"), timeout=600,
                            resources={"metadata": {"path": str(workdir)}})
    # Raises CellExecutionError, with the cell and its traceback, at the first cell that fails.
    client.execute(env={**os.environ, "TMPDIR": str(scratch)})

    assert pictures(notebook) == pictures(committed)  # no figure went missing
    # It writes only to its own temporary directory (the tiny run, the datasets cache), and removes it.
    assert list(workdir.iterdir()) == []
    assert not [path for path in scratch.iterdir() if path.name.startswith("transformer-walkthrough-")]
