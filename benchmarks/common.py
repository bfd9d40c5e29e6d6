"""Helpers shared by the benchmark scripts: environment line and markdown tables."""

from __future__ import annotations

import platform
import sys

import torch
import transformers


def environment() -> str:
    threads = torch.get_num_threads()
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU, {threads} torch threads"
    )


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
