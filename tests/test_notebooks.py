"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and is stored executed, with its pictures.

The run uses a tiny random model (`HF_PAGED_NOTEBOOK_TINY=1`) unless the variable is already set, e.g.
`HF_PAGED_NOTEBOOK_TINY=0 python -m pytest tests/test_notebooks.py` runs them on SmolLM2-135M as committed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def execute(notebook, folder: Path, monkeypatch) -> None:
    """Run `notebook` in a fresh kernel started in `folder`, importing hf_paged from this checkout; raises
    `CellExecutionError`, naming the cell, if any cell fails."""
    monkeypatch.setenv("HF_PAGED_NOTEBOOK_TINY", os.environ.get("HF_PAGED_NOTEBOOK_TINY", "1"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    client.execute()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    execute(notebook, path.parent, monkeypatch)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells and all(cell.execution_count for cell in code_cells)


@pytest.mark.slow
def test_a_failing_cell_fails_the_run_negative_control(tmp_path, monkeypatch):
    cells = ["import hf_paged", "hf_paged.BlockAllocator(num_blocks=0, block_size=16)", "print('never reached')"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="num_blocks must be a positive int"):
        execute(notebook, tmp_path, monkeypatch)
    assert notebook.cells[2].execution_count is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_is_stored_executed(path: Path):
    notebook = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells, f"{path.name} has no code"
    counts = [cell.execution_count for cell in code_cells]
    assert counts == list(range(1, len(code_cells) + 1)), f"{path.name}: not executed top to bottom once ({counts})"
    outputs = [output for cell in code_cells for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name} is stored with an error"
    if any("plot_" in cell.source for cell in code_cells):
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} is stored without its pictures"
