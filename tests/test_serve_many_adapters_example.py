"""examples/serve_many_adapters.py end to end: two LoRA adapters trained with PEFT, saved, served with the base model
from one `hf-paged serve` process and asked with the `openai` client; every adapter's answers equal PEFT's
`generate` with that adapter alone, and the three models answer differently. On a tiny Llama, and on SmolLM2."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "serve_many_adapters.py"
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("serve_many_adapters", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def check(report, script) -> None:
    assert [(m["id"], m["parent"]) for m in report.models] == [("base", None), ("json", "base"), ("greet", "base")]
    for name in script.TASKS:
        assert report.served[name] == report.reference[name], name  # the server = PEFT generate, adapter alone
        assert report.losses[name][-1] < report.losses[name][0]
    base, json, greet = (report.served[name] for name in ("base", "json", "greet"))
    assert all(len({b, j, g}) == 3 for b, j, g in zip(base, json, greet))  # three models, three answers


def test_tiny(script, tmp_path):
    report = script.main(["--tiny", "--steps", "20", "--max-new-tokens", "12", "--output-dir", str(tmp_path)])
    check(report, script)


def test_smollm2(script, tmp_path):
    report = script.main(["--steps", "8", "--output-dir", str(tmp_path)])
    check(report, script)
    assert sum('"person"' in answer for answer in report.served["json"]) >= 3  # learned its schema
    assert sum(answer.startswith("Hello") for answer in report.served["greet"]) >= 3
