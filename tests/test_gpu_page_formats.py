"""benchmarks/gpu_page_formats.py: without a CUDA device it says so and exits cleanly; on tiny CPU shapes (the Triton
kernel under its interpreter) it prints one row per format and keys-a-step choice, with the real bytes a token."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_helpers import run_script

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_page_formats.py"

pytest.importorskip("triton")


def test_without_a_cuda_device_it_says_so_and_exits_cleanly():
    result = run_script(SCRIPT, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "no CUDA device: benchmarks/gpu_page_formats.py measures the Triton kernel on a GPU (see docs/gpu.md)"
    )


def test_every_format_and_tile_gets_a_row_on_tiny_cpu_shapes():
    arguments = [
        "--device", "cpu", "--batches", "2", "--contexts", "40", "--repeats", "1", "--warmup", "1", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32", "--tile-n", "16", "0",
    ]  # fmt: skip
    result = run_script(SCRIPT, *arguments, timeout=600, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 2 ")]
    cells = [[cell.strip() for cell in row] for row in rows]
    # K and V of 2 KV heads x 64 dims a token: fp32 4 bytes a value; int8 one byte plus a bf16 scale a head;
    # int4 two values a byte plus the scale; int4-channel: its block rows (blocks of 64) over 64 tokens
    assert [(row[2], row[3], row[4]) for row in cells] == [
        ("float32", "16", "1024"), ("float32", "default", "1024"), ("int8", "16", "264"), ("int8", "default", "264"),
        ("int4", "16", "136"), ("int4", "default", "136"), ("int4-channel", "16", "140"),
        ("int4-channel", "default", "140"),
    ]  # fmt: skip
    assert cells[0][-1] == "1.00x" and all(float(row[5]) > 0 for row in cells)
