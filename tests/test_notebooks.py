"""Every notebook in notebooks/ is stored executed top to bottom, with its pictures, current classes and no
progress bars; tests/test_doc_outputs.py re-runs each on SmolLM2-135M and compares its outputs with the stored ones.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .test_doc_outputs import checker

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
PROGRESS_BAR = re.compile(r"\d+%\||\d+/\d+ \[\d+:\d+")  # tqdm: " 50%|█████     | 8/16 [00:14<00:13"


@pytest.mark.slow
def test_a_failing_cell_fails_the_run_negative_control(tmp_path):
    cells = ["import hf_paged", "hf_paged.BlockAllocator(num_blocks=0, block_size=16)", "print('never reached')"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    path = tmp_path / "failing.ipynb"
    nbformat.write(notebook, path)
    with pytest.raises(checker.ExecutionFailed, match=r"(?s)failing.ipynb, code cell 2 raised:.*num_blocks must be"):
        checker.run_notebook(path)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_carries_no_progress_bars(path: Path):
    notebook = nbformat.read(path, as_version=4)
    for index, cell in enumerate(c for c in notebook.cells if c.cell_type == "code"):
        for output in cell.outputs:
            text = output.get("text", "") + output.get("data", {}).get("text/plain", "")
            assert "\r" not in text and not PROGRESS_BAR.search(text), (
                f"{path.name}, code cell {index + 1}: a progress bar in the stored output: {text[:200]!r}"
            )


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


def hf_paged_classes() -> dict[str, type]:
    """Every class the hf_paged package defines, by name."""
    import importlib
    import inspect
    import pkgutil

    import hf_paged

    classes = {}
    for module_info in pkgutil.walk_packages(hf_paged.__path__, "hf_paged."):
        if module_info.name.endswith("__main__"):  # runs the command line when imported
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__.startswith("hf_paged"):
                classes[name] = value
    return classes


def printed_objects(text: str):
    """`(class name, the keyword names of its repr)` for every `Name(key=..., ...)` printed in `text`."""
    for match in re.finditer(r"\b([A-Z][A-Za-z0-9]+)\(", text):
        depth, keys, start = 1, [], match.end()
        for position in range(start, len(text)):
            char = text[position]
            depth += char in "([{"
            depth -= char in ")]}"
            if depth == 0:
                break
            if depth == 1 and (position == start or text[position - 2 : position] == ", "):
                key = re.match(r"(\w+)=", text[position:])
                if key:
                    keys.append(key.group(1))
        yield match.group(1), keys


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_stored_outputs_print_the_current_classes(path: Path):
    """The stored outputs are current: every object they print (`PoolStats(num_blocks=..., ...)`) is a class
    hf_paged still defines, with the fields it has now (a renamed class, `AllocatorStats`, or a renamed field means
    `python notebooks/execute.py` must be run again)."""
    classes = hf_paged_classes()
    notebook = nbformat.read(path, as_version=4)
    for index, cell in enumerate(c for c in notebook.cells if c.cell_type == "code"):
        for output in cell.outputs:
            text = output.get("text", "") + output.get("data", {}).get("text/plain", "")
            for name, keys in printed_objects(text):
                assert name in classes, (
                    f"{path.name}, code cell {index + 1}: prints {name}, which hf_paged no longer has"
                )
                fields = getattr(classes[name], "__dataclass_fields__", None)
                if fields is not None:
                    stale = [key for key in keys if key not in fields]
                    assert not stale, f"{path.name}, code cell {index + 1}: {name} has no field {stale}"
