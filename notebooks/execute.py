"""Run notebooks top to bottom with nbclient and store their outputs in place (how the committed outputs are made).

Usage: `python notebooks/execute.py [notebooks/NAME.ipynb ...]` (default: every notebook in this folder). The kernel
imports hf_paged from this checkout. `HF_PAGED_NOTEBOOK_TINY=1` swaps SmolLM2-135M for a tiny random model (a quick
check; commit outputs of the real model).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent
REPO = NOTEBOOKS.parent


def execute(path: Path, timeout: int = 900) -> nbformat.NotebookNode:
    """Execute the notebook at `path` in a fresh kernel whose working directory is the notebook's folder."""
    notebook = nbformat.read(path, as_version=4)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    client = NotebookClient(
        notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # per-run timestamps: noise in diffs
    return notebook


def main(paths: list[str]) -> None:
    for path in [Path(p) for p in paths] or sorted(NOTEBOOKS.glob("*.ipynb")):
        start = time.perf_counter()
        nbformat.write(execute(path), path)
        print(f"{path.name}: executed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
