"""The Python blocks of docs/quickstart.md run as written, in order, on SmolLM2-135M."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hf_paged

QUICKSTART = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.slow
def test_quickstart_python_blocks_run_in_order(smollm2, capsys):
    pytest.importorskip("matplotlib")
    namespace: dict = {}
    for block in python_blocks(QUICKSTART):
        exec(compile(block, str(QUICKSTART), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "Paris" in printed
    assert re.search(r"^\* \[\d+\] shared by A B \(refcount 2\)$", printed, flags=re.M)  # the template's first block
    assert hf_paged.get_pool(namespace["model"]).stats().num_used == 0


@pytest.mark.slow
def test_engine_page_example_runs(smollm2, capsys):
    namespace: dict = {}
    for block in python_blocks(QUICKSTART.parent / "engine.md"):
        exec(compile(block, "docs/engine.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.count("length") + printed.count("stop") >= 3 and "EngineStats(" in printed
    assert hf_paged.get_pool(namespace["model"]).stats().num_used == 0
