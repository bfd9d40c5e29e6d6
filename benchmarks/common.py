"""Helpers shared by the benchmark scripts: environment line, markdown tables, timed functions."""

from __future__ import annotations

import functools
import platform
import sys
import time

import torch
import transformers


def environment() -> str:
    threads = torch.get_num_threads()
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU, {threads} torch threads"
    )


def load_model(name: str):
    """`(model, label)` for a benchmark model name: "tiny" (a 2-layer Llama, width 64) or "smollm2" (SmolLM2-135M)."""
    from hf_paged.reference_models import load_smollm2, tiny_model

    if name == "tiny":
        return tiny_model("llama", max_position_embeddings=4096), "tiny Llama (2 layers, width 64)"
    return load_smollm2()[0], "SmolLM2-135M (fp32)"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def timing(function, record):
    """`function` wrapped so that every call passes the seconds it took to `record` (the wrapper costs about a
    microsecond a call)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    return wrapper
