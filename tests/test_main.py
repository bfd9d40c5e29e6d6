"""`python -m hf_paged` is the `hf-paged` command."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=120)


def test_python_m_hf_paged_serve_is_the_hf_paged_command():
    module = run(sys.executable, "-m", "hf_paged", "serve", "--help")
    assert module.returncode == 0, module.stderr
    assert "usage: hf-paged serve" in module.stdout and "--max-memory" in module.stdout
    assert module.stdout == run(sys.executable, "-m", "hf_paged.serve", "serve", "--help").stdout


def test_python_m_hf_paged_without_a_command_fails_with_usage():
    module = run(sys.executable, "-m", "hf_paged")
    assert module.returncode == 2 and "serve" in module.stderr
