"""The Python blocks of docs/engine.md and docs/serving.md run as written (docs/quickstart.md's run, with their
printed outputs compared, in tests/test_doc_outputs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hf_paged

QUICKSTART = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.slow
def test_engine_page_example_runs(smollm2, capsys):
    namespace: dict = {}
    for block in python_blocks(QUICKSTART.parent / "engine.md"):
        exec(compile(block, "docs/engine.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.count("length") + printed.count("stop") >= 3 and "EngineStats(" in printed
    assert hf_paged.get_pool(namespace["model"]).stats().num_used == 0


@pytest.mark.slow
def test_serving_page_client_snippet_runs_against_the_server_it_describes(tmp_path, monkeypatch, capsys):
    """docs/serving.md's client, as written, against `hf-paged serve` started as that page shows (with a key from
    `HF_PAGED_API_KEY`, served as `smollm2`; a tiny model with SmolLM2's tokenizer, on a free port instead of 8000)."""
    from .serve_helpers import ServerProcess, save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    server = ServerProcess(folder, "--served-model-name", "smollm2", env={"HF_PAGED_API_KEY": "secret"})
    try:
        monkeypatch.setenv("HF_PAGED_API_KEY", "secret")
        block = python_blocks(QUICKSTART.parent / "serving.md")[0]  # the client; the LoRA section's comes later
        assert "http://127.0.0.1:8000/v1" in block
        block = block.replace("http://127.0.0.1:8000/v1", f"{server.base}/v1")
        exec(compile(block, "docs/serving.md", "exec"), {})
    finally:
        server.close()
    assert "CompletionUsage(completion_tokens=" in capsys.readouterr().out
