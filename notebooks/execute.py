"""Run notebooks top to bottom and store their outputs in place (how the committed outputs are made), or check them.

Usage:

    python notebooks/execute.py [notebooks/NAME.ipynb ...]       # run and store (default: every notebook here)
    python notebooks/execute.py --check [PATH ...]                # run, compare with the committed outputs

`--check` takes notebooks and Markdown documents (default: every notebook here, README.md and docs/quickstart.md),
re-runs each and compares what it prints with what is committed, after masking what varies from run to run
(`output_check.MASKS`); it exits with status 1 and names the file, the cell or example and the differing line if
any differs. The kernel imports hf_paged from this checkout. `HF_PAGED_NOTEBOOK_TINY=1` makes a stored run use a
tiny random model (a quick check; commit outputs of the real model); `--check` always runs the real model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from output_check import DOCUMENTS, NOTEBOOKS, ExecutionFailed, check, execute


def store(paths: list[Path]) -> None:
    """Execute every notebook of `paths` and write it back with its new outputs."""
    tiny = os.environ.get("HF_PAGED_NOTEBOOK_TINY") == "1"
    for path in paths:
        start = time.perf_counter()
        notebook = execute(nbformat.read(path, as_version=4), path.parent, tiny=tiny)
        nbformat.write(notebook, path)
        print(f"{path.name}: executed in {time.perf_counter() - start:.0f} s")


def check_all(paths: list[Path]) -> bool:
    """Check every notebook or document of `paths`, print what differs; True if all match."""
    ok = True
    for path in paths:
        start = time.perf_counter()
        try:
            mismatches = check(path)
        except ExecutionFailed as error:
            mismatches, ok = [], False
            print(error)
        for mismatch in mismatches:
            print(mismatch, end="\n\n")
        ok = ok and not mismatches
        verdict = f"{len(mismatches)} outputs differ" if mismatches else "outputs match"
        print(f"{path.name}: {verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
    return ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed outputs; store nothing")
    parser.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args(argv)
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.check:
        return 0 if check_all(args.paths or [*notebooks, *DOCUMENTS]) else 1
    store(args.paths or notebooks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
