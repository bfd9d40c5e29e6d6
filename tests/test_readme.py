"""The README's Python blocks run as written (the quick start stays runnable)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_a_quick_start():
    assert len(python_blocks()) >= 3


@pytest.mark.slow
def test_readme_python_blocks_run_in_order(smollm2, capsys):
    namespace: dict = {}
    blocks = python_blocks()[1:]  # the first block is the one-line teaser
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "Paris" in printed
    import hf_paged

    assert hf_paged.get_pool(namespace["model"]).stats().num_used == 0
