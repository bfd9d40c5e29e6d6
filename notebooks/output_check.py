"""Re-run the notebooks and the documented examples, and compare what they print with what is committed.

What is compared:

- a notebook (`notebooks/*.ipynb`), run top to bottom in a fresh kernel on SmolLM2-135M (`HF_PAGED_NOTEBOOK_TINY`
  is set to 0): the text outputs of every code cell, that is its stdout and stderr streams and the `text/plain` of
  its results and displays (pictures are not compared);
- a Markdown document (README.md, docs/quickstart.md): its ```python blocks run in order, in one fresh kernel whose
  working directory is the repository. The convention for an example with printed output is a ```python block
  followed directly (blank lines allowed) by a ```text block, which holds exactly what the python block prints on
  stdout. A python block with no text block after it runs but its output is not compared. A python block preceded by
  the line `<!-- output-check: skip -->` is a fragment shown in passing and does not run.

Before comparing, both sides go through `MASKS`, the one list of what may vary from run to run (timings, temporary
paths, object addresses) or from CPU to CPU (notebook 02's answers over quantized pages). Everything else must match
line by line, trailing spaces aside: token ids, block ids, counts and losses are not masked.

`python notebooks/execute.py --check [paths]` is the command line; tests/test_doc_outputs.py runs it in CI.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent
REPO = NOTEBOOKS.parent
DOCUMENTS = (REPO / "README.md", REPO / "docs" / "quickstart.md")
SKIP_MARKER = "<!-- output-check: skip -->"
CELL_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mask:
    """A run-dependent part of an output: what matches `pattern` reads `placeholder` on both sides."""

    pattern: str
    placeholder: str
    why: str


_TEMP_DIRS = "|".join(sorted({re.escape(tempfile.gettempdir()), "/tmp", r"(?:/private)?/var/folders/[\w/]+?/T"}))

MASKS = (
    Mask(r"\b(elapsed_s|\w*ttft_s)=[-+\d.e]+", r"\1=<seconds>", "elapsed times and time to first token"),
    Mask(r"\b(\w+_per_s)=[-+\d.e]+", r"\1=<rate>", "throughput (tokens/s, requests/s) follows the elapsed time"),
    Mask(rf"(?:{_TEMP_DIRS})(?:/[\w.-]+)+", "<tempdir>", "a path in the temporary folder: random names (mkdtemp)"),
    Mask(r"\b0x[0-9a-fA-F]{6,}\b", "0x<address>", "object addresses in default reprs"),
    Mask(
        r"(tokens identical to unquantized pages, answer by answer: )\[[\d, ]*\]|(haiku, int4 pages: ).*",
        r"\1\2<CPU-dependent>",
        "quantized pages' greedy answers: CPUs' matmul kernels round differently, and a page's quantization turns a "
        "rounding difference into another code now and then (notebook 02 says so)",
    ),
)


def mask(text: str) -> str:
    """`text` with every run-dependent part replaced by its placeholder (`MASKS`)."""
    for rule in MASKS:
        text = re.sub(rule.pattern, rule.placeholder, text)
    return text


@dataclass(frozen=True)
class Printed:
    """What one notebook cell or one documented example printed."""

    source: str  # the notebook or document, relative to the repository
    label: str  # which cell or example: "code cell 3", "example at line 52"
    text: str


@dataclass(frozen=True)
class Mismatch:
    """A cell or example whose output differs from the committed one."""

    source: str
    label: str
    line: int  # 1-based, in the masked output
    committed: str | None  # None: the committed output is shorter
    fresh: str | None  # None: the fresh output is shorter
    diff: str

    def __str__(self) -> str:
        return (
            f"{self.source}, {self.label}, output line {self.line}:\n"
            f"  committed: {self.committed!r}\n  now:       {self.fresh!r}\n{self.diff}"
        )


class ExecutionFailed(Exception):
    """A notebook cell or a documented example raised."""


# ---------------------------------------------------------------------------------------------- running notebooks
def kernel_env(tiny: bool = False) -> dict[str, str]:
    """The kernel's environment: this one, hf_paged imported from this checkout, the model chosen by `tiny`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_PAGED_NOTEBOOK_TINY": "1" if tiny else "0"}


def execute(notebook: nbformat.NotebookNode, folder: Path, tiny: bool = False) -> nbformat.NotebookNode:
    """Run `notebook` in place in a fresh kernel started in `folder`; raises `CellExecutionError` if a cell fails."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    client.execute(env=kernel_env(tiny))
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # per-run timestamps: noise in diffs
    return notebook


def relative(path: Path) -> str:
    """`path` relative to the repository where it lies inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def cell_text(outputs) -> str:
    """A code cell's text outputs as one text: stdout as printed, stderr lines prefixed `[stderr] `, results and
    displays by their `text/plain` prefixed `[out] `; consecutive pieces of one stream are joined first."""
    pieces: list[tuple[str, str]] = []
    for output in outputs:
        if output.output_type == "stream":
            kind, text = output.name, output.text
        elif output.output_type in ("execute_result", "display_data"):
            kind, text = "out", output.get("data", {}).get("text/plain", "")
        else:  # an error
            kind, text = "error", f"{output.ename}: {output.evalue}"
        if pieces and kind == pieces[-1][0] and kind in ("stdout", "stderr"):
            pieces[-1] = (kind, pieces[-1][1] + text)
        else:
            pieces.append((kind, text if kind in ("stdout", "stderr") else text + "\n"))
    lines = []
    for kind, text in pieces:
        prefix = "" if kind == "stdout" else f"[{kind}] "
        lines += [prefix + line for line in text.splitlines()]
    return "\n".join(lines)


def notebook_printed(notebook: nbformat.NotebookNode, source: str) -> list[Printed]:
    """Every code cell's text outputs, labelled `code cell N` (N counts code cells from 1)."""
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    return [Printed(source, f"code cell {n}", cell_text(cell.outputs)) for n, cell in enumerate(code_cells, 1)]


def run_notebook(path: Path) -> list[Printed]:
    """Execute a copy of the notebook at `path` on SmolLM2 and return what its cells print now."""
    notebook = nbformat.read(path, as_version=4)
    try:
        execute(notebook, Path(path).parent)
    except CellExecutionError as error:
        raise ExecutionFailed(f"{relative(path)}, {failed_cell(notebook)} raised:\n{error}") from None
    return notebook_printed(notebook, relative(path))


def failed_cell(notebook: nbformat.NotebookNode) -> str:
    """The label of the first code cell with an error output."""
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for n, cell in enumerate(code_cells, 1):
        if any(output.output_type == "error" for output in cell.outputs):
            return f"code cell {n}"
    return "a code cell"


# ---------------------------------------------------------------------------------------------- documents
@dataclass(frozen=True)
class Example:
    """A ```python block of a document, and the ```text block that follows it, if any (its expected stdout)."""

    line: int  # of the opening fence, 1-based
    code: str
    expected: str | None


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.M | re.S)


def document_examples(text: str) -> list[Example]:
    """The python blocks of a Markdown text that run, in order, each with its expected output if one follows."""
    blocks = [(match.group(1), match.group(2), match.start(), match.end()) for match in FENCE.finditer(text)]
    examples = []
    for index, (language, body, start, _) in enumerate(blocks):
        if language != "python" or text[:start].rstrip().endswith(SKIP_MARKER):
            continue
        expected = None
        if index + 1 < len(blocks):
            next_language, next_body, next_start, _ = blocks[index + 1]
            if next_language == "text" and not text[blocks[index][3] : next_start].strip():
                expected = next_body
        examples.append(Example(text.count("\n", 0, start) + 1, body, expected))
    return examples


def document_notebook(examples: list[Example]) -> nbformat.NotebookNode:
    """A notebook with one code cell per example, in order."""
    cells = [nbformat.v4.new_code_cell(example.code) for example in examples]
    return nbformat.v4.new_notebook(cells=cells)


def document_committed(path: Path) -> list[Printed]:
    """The expected stdout of every example of the document at `path` that shows one."""
    examples = document_examples(Path(path).read_text())
    return [
        Printed(relative(path), f"example at line {example.line}", example.expected.rstrip("\n"))
        for example in examples
        if example.expected is not None
    ]


def run_document(path: Path) -> list[Printed]:
    """Run the document's python blocks in order in one fresh kernel; the stdout of those that show an output."""
    examples = document_examples(Path(path).read_text())
    notebook = document_notebook(examples)
    try:
        execute(notebook, REPO)
    except CellExecutionError as error:
        failed = next(
            (e for e, c in zip(examples, notebook.cells) if any(o.output_type == "error" for o in c.outputs)), None
        )
        where = f"example at line {failed.line}" if failed else "an example"
        raise ExecutionFailed(f"{relative(path)}, {where} raised:\n{error}") from None
    return [
        Printed(relative(path), f"example at line {example.line}", stdout_of(cell.outputs))
        for example, cell in zip(examples, notebook.cells)
        if example.expected is not None
    ]


def stdout_of(outputs) -> str:
    """What a cell printed on stdout."""
    return "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout").rstrip("\n")


# ---------------------------------------------------------------------------------------------- comparing
def committed(path: Path) -> list[Printed]:
    """The committed outputs of a notebook or a document."""
    if Path(path).suffix == ".ipynb":
        return notebook_printed(nbformat.read(path, as_version=4), relative(path))
    return document_committed(path)


def run(path: Path) -> list[Printed]:
    """The outputs of a notebook or a document, run now."""
    return run_notebook(path) if Path(path).suffix == ".ipynb" else run_document(path)


def masked_lines(text: str) -> list[str]:
    """`text` masked, split into lines without trailing spaces, trailing blank lines dropped."""
    lines = [line.rstrip() for line in mask(text).splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def compare(expected: list[Printed], actual: list[Printed]) -> list[Mismatch]:
    """The cells or examples whose masked outputs differ, each with its first differing line."""
    if [p.label for p in expected] != [p.label for p in actual]:
        source = (expected or actual)[0].source
        diff = f"committed: {[p.label for p in expected]}\nnow:       {[p.label for p in actual]}"
        return [Mismatch(source, "cells", 0, None, None, diff)]
    return [m for old, new in zip(expected, actual) if (m := first_difference(old, new)) is not None]


def first_difference(old: Printed, new: Printed) -> Mismatch | None:
    """Where `new` first differs from `old`, after masking, with a unified diff of the two."""
    old_lines, new_lines = masked_lines(old.text), masked_lines(new.text)
    if old_lines == new_lines:
        return None
    line = next(
        (i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b), min(len(old_lines), len(new_lines))
    )
    diff = difflib.unified_diff(old_lines, new_lines, "committed", "now", n=1, lineterm="")
    return Mismatch(
        old.source,
        old.label,
        line + 1,
        old_lines[line] if line < len(old_lines) else None,
        new_lines[line] if line < len(new_lines) else None,
        "\n".join(list(diff)[:40]),
    )


def check(path: Path) -> list[Mismatch]:
    """Run the notebook or document at `path` and compare its outputs with the committed ones."""
    return compare(committed(path), run(path))
