"""Run one benchmark script against two versions of hf_paged in the same run, alternating: a git revision (default
the parent of HEAD) and the working tree. The script itself is always the working tree's, so both versions are
measured by the same code; only `import hf_paged` differs (through `PYTHONPATH`).

Usage: python benchmarks/before_after.py [--before REV] [--rounds 2] SCRIPT [SCRIPT ARGS...]
e.g.   python benchmarks/before_after.py --before e192899 decode_speed.py --models tiny --repeats 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent


def run(script: str, args: list[str], package_root: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), str(BENCHMARKS)])}
    command = [sys.executable, str(BENCHMARKS / script), *args]
    result = subprocess.run(command, env=env, cwd=BENCHMARKS, capture_output=True, text=True, check=True)
    return result.stdout


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
            for round_index in range(args.rounds):
                for label, root in versions.items():
                    print(f"## {label}, round {round_index + 1}", flush=True)
                    print(run(args.script, args.script_args, root), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
