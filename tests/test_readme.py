"""The README has a runnable quick start; tests/test_doc_outputs.py runs its Python blocks in order and compares
what they print with the README's text blocks."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_a_quick_start():
    assert len(python_blocks()) >= 3
    assert "hf_paged.release_pool(model)" in README.read_text()
