"""Run one benchmark script against two versions of hf_paged in the same run, alternating: a git revision (default
the parent of HEAD) and the working tree. The script itself is always the working tree's, so both versions are
measured by the same code; only `import hf_paged` differs (through `PYTHONPATH`). After every run's own output it
prints the last markdown table of the script with each number replaced by its median over the rounds, before and
after side by side.

Usage: python benchmarks/before_after.py [--before REV] [--rounds 2] SCRIPT [SCRIPT ARGS...]
e.g.   python benchmarks/before_after.py --before e192899 decode_speed.py --models tiny --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent


def run(script: str, args: list[str], package_root: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), str(BENCHMARKS)])}
    command = [sys.executable, str(BENCHMARKS / script), *args]
    result = subprocess.run(command, env=env, cwd=BENCHMARKS, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed under {package_root}:\n{result.stderr[-3000:]}")
    return result.stdout


def last_table(output: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the last markdown table in `output`."""
    lines = [line.strip() for line in output.splitlines()]
    end = max(i for i, line in enumerate(lines) if line.startswith("|"))
    start = end
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start : end + 1]]
    return cells[0], [row for row in cells[2:]]


def number(cell: str) -> float | None:
    try:
        return float(cell.replace(",", "").replace("*", "").rstrip("x"))
    except ValueError:
        return None


def medians(tables: list[list[list[str]]]) -> list[list[str]]:
    """Row by row, each numeric cell replaced by its median over `tables` (same shape), other cells kept."""
    merged = []
    for rows in zip(*tables):
        row = []
        for cells in zip(*rows):
            values = [number(cell) for cell in cells]
            if None in values:
                row.append(cells[0])
            else:
                median = statistics.median(values)
                row.append(f"{median:.2f}" if cells[0].endswith("x") else f"{median:,.0f}")
        merged.append(row)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD~1", help="git revision of the 'before' version")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each version")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    revision = subprocess.run(
        ["git", "rev-parse", "--short", args.before], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hf_paged_before_") as folder:
        before = Path(folder) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(before), revision], cwd=REPO, check=True, capture_output=True
        )
        try:
            versions = {f"before ({revision})": before, "after (working tree)": REPO}
            tables: dict[str, list] = {label: [] for label in versions}
            header: list[str] = []
            for round_index in range(args.rounds):
                for label, root in versions.items():
                    print(f"## {label}, round {round_index + 1}", flush=True)
                    output = run(args.script, args.script_args, root)
                    print(output, flush=True)
                    header, rows = last_table(output)
                    tables[label].append(rows)
            print(f"## medians over {args.rounds} rounds")
            print("| version | " + " | ".join(header) + " |")
            print("|---" * (len(header) + 1) + "|")
            for label, runs in tables.items():
                for row in medians(runs):
                    print(f"| {label} | " + " | ".join(row) + " |")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
