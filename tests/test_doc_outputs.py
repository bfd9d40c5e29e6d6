"""The committed outputs of the notebooks and of the documented examples are current.

`notebooks/output_check.py` (`python notebooks/execute.py --check`) re-runs every notebook on SmolLM2-135M and the
python blocks of README.md and docs/quickstart.md in order, and compares what each cell or example prints with what
is committed, masking only what varies from run to run (`MASKS`). Each run here is also a negative control: the
same fresh outputs against a copy whose committed output has one line edited must fail, naming the file, the cell
and the line. The notebooks run with their own temporary folder, which they must leave (nearly) empty
(torch.compile's cache aside).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parent.parent
EXECUTE = REPO / "notebooks" / "execute.py"
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
LEFT_IN_TEMP_MAX_BYTES = 2**20


def load_checker():
    """notebooks/output_check.py as a module."""
    spec = importlib.util.spec_from_file_location("output_check", REPO / "notebooks" / "output_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


checker = load_checker()
CHECKED = [*NOTEBOOKS, *checker.DOCUMENTS]


@pytest.mark.slow
@pytest.mark.parametrize("path", CHECKED, ids=[path.name for path in CHECKED])
def test_committed_outputs_match_a_fresh_run(path: Path, tmp_path, monkeypatch):
    from hf_paged.reference_models import smollm2_path

    monkeypatch.setenv("HF_PAGED_MODEL_CACHE", str(smollm2_path().parent))  # the converted SmolLM2, as it is
    temp_folder = tmp_path / "kernel-tmp"
    temp_folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp_folder))  # the kernel's tempfile folder
    fresh = checker.run(path)
    mismatches = checker.compare(checker.committed(path), fresh)
    assert not mismatches, (
        "outputs changed; if expected, run python notebooks/execute.py (notebooks) or update the "
        + ("text blocks (documents):\n\n" + "\n\n".join(str(m) for m in mismatches))
    )
    # torch.compile's own cache (torchinductor_<user>, under the temporary folder by default) is kept on purpose: a
    # later process that compiles the same graphs reuses its kernels (the Engine compiles its steps by default)
    files = [f for f in temp_folder.rglob("*") if f.is_file()]
    left = sum(f.stat().st_size for f in files if not f.relative_to(temp_folder).parts[0].startswith("torchinductor_"))
    assert left < LEFT_IN_TEMP_MAX_BYTES, f"{path.name} leaves {left:,} bytes in its temporary folder"

    edited, label, line = edited_copy(path, tmp_path)
    [mismatch] = checker.compare(checker.committed(edited), fresh)
    assert (mismatch.label, mismatch.committed) == (label, line)
    assert path.name in str(mismatch) and label in str(mismatch) and line in str(mismatch)


def edited_copy(path: Path, folder: Path) -> tuple[Path, str, str]:
    """A copy of the notebook or document at `path`, in `folder`, whose first printed line of committed output has
    ` (edited)` appended; returns the copy, the label of its cell or example and the edited line."""
    target = folder / path.name
    if path.suffix == ".ipynb":
        notebook = nbformat.read(path, as_version=4)
        code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
        number, output = next(
            (n, o) for n, cell in enumerate(code_cells, 1) for o in cell.outputs if o.get("name") == "stdout"
        )
        line = output.text.splitlines()[0]
        output.text = output.text.replace(line, line + " (edited)", 1)
        nbformat.write(notebook, target)
        return target, f"code cell {number}", line + " (edited)"
    example = next(e for e in checker.document_examples(path.read_text()) if e.expected)
    line = example.expected.splitlines()[0]
    text = path.read_text()
    start = text.index("```text\n", text.index(example.code))
    target.write_text(text[:start] + text[start:].replace(line, line + " (edited)", 1))
    return target, f"example at line {example.line}", line + " (edited)"


@pytest.mark.slow
def test_check_command_fails_on_an_edited_output_negative_control(tmp_path):
    """`execute.py --check` on a copy of notebook 02's allocator part (no model), one committed line edited: exit
    status 1, and the report names the notebook, the cell and the line."""
    notebook = nbformat.read(REPO / "notebooks" / "02_block_pool_explained.ipynb", as_version=4)
    first_model_cell = next(i for i, cell in enumerate(notebook.cells) if "load_smollm2" in cell.source)
    notebook.cells = notebook.cells[:first_model_cell]
    [output] = [o for cell in notebook.cells if "all blocks back" in cell.source for o in cell.outputs]
    assert output.text == "all blocks back: True\n"
    output.text = "all blocks back: False\n"
    path = tmp_path / "allocator_part.ipynb"
    nbformat.write(notebook, path)
    run = subprocess.run([sys.executable, str(EXECUTE), "--check", str(path)], capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    code_cell = 1 + [c for c in notebook.cells if c.cell_type == "code"].index(
        next(c for c in notebook.cells if "all blocks back" in c.source)
    )
    assert f"allocator_part.ipynb, code cell {code_cell}, output line 1:" in run.stdout
    assert "committed: 'all blocks back: False'" in run.stdout and "now:       'all blocks back: True'" in run.stdout
    assert "allocator_part.ipynb: 1 outputs differ" in run.stdout  # every other cell matched


def test_masks_hide_timings_temporary_paths_and_cpu_dependent_answers_only():
    printed = (
        "EngineStats(num_requests=16, elapsed_s=1.5586, requests_per_s=10.26, tokens_per_s=210.4, "
        "mean_ttft_s=0.184, p90_ttft_s=0.185, num_steps=21, peak_blocks=29, prefix_hit_rate=0.75789)\n"
        "serve it over HTTP: hf-paged serve /tmp/finetuned-ku_bzht5\n"
        "<object at 0x7f3a2c1d9e50> loss 1.107 -> 0.016, blocks [0, 1, 12, 16]\n"
        "int8: tokens identical to unquantized pages, answer by answer: [48, 48, 40, 48] of 48\n"
        "haiku, int4 pages: 'In the depths of the blue.'"
    )
    assert checker.mask(printed) == (
        "EngineStats(num_requests=16, elapsed_s=<seconds>, requests_per_s=<rate>, tokens_per_s=<rate>, "
        "mean_ttft_s=<seconds>, p90_ttft_s=<seconds>, num_steps=21, peak_blocks=29, prefix_hit_rate=0.75789)\n"
        "serve it over HTTP: hf-paged serve <tempdir>\n"
        "<object at 0x<address>> loss 1.107 -> 0.016, blocks [0, 1, 12, 16]\n"
        "int8: tokens identical to unquantized pages, answer by answer: <CPU-dependent> of 48\n"
        "haiku, int4 pages: <CPU-dependent>"
    )
    assert all(rule.why for rule in checker.MASKS)


def test_documents_pair_python_blocks_with_the_text_block_that_follows():
    text = (
        "<!-- output-check: skip -->\n```python\nmodel.generate(**inputs)\n```\n\n"
        "```python\nprint(1)\n```\n\n```text\n1\n```\n\nprose\n\n"
        "```python\nx = 2\n```\nprose\n```text\nnot an output: prose comes between\n```\n"
    )
    examples = checker.document_examples(text)
    assert [(e.line, e.code, e.expected) for e in examples] == [(6, "print(1)\n", "1\n"), (16, "x = 2\n", None)]


@pytest.mark.parametrize("path", checker.DOCUMENTS, ids=[path.name for path in checker.DOCUMENTS])
def test_documents_show_printed_outputs(path: Path):
    examples = checker.document_examples(path.read_text())
    assert len(examples) >= 3 and sum(e.expected is not None for e in examples) >= 2
