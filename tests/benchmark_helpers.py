"""Shared piece of the tests that run a benchmark script end to end: the script in a fresh interpreter with extra
environment variables (no CUDA device, or Triton's interpreter for its kernel on CPU tensors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_script(script: Path, *arguments: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`python script arguments...` from the script's folder, with `env` added to this process's environment;
    its output as text."""
    return subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=script.parent,
        env={**os.environ, **env},
    )
