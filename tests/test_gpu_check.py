"""benchmarks/gpu_check.py: without a CUDA device it says so and exits cleanly; its decode and serving parts run
end to end on tiny CPU shapes (`--device cpu`), so the script a device run depends on is exercised here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"


def test_without_a_cuda_device_it_says_so_and_exits_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "no CUDA device: benchmarks/gpu_check.py measures the GPU backends and needs one (see docs/gpu.md)"
    )


def test_decode_and_serving_parts_run_on_tiny_cpu_shapes():
    arguments = [
        "--device", "cpu", "--parts", "decode", "serving", "--contexts", "16", "--batches", "1", "2",
        "--decode-tokens", "3", "--layers", "1", "--hidden", "128", "--requests", "4", "--budget-tokens", "512",
        "--scale", "0.02",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "## decode speed" in out and "## serving" in out and "failed" not in out
    assert "| batch | context | paged | DynamicCache | StaticCache |" in out
    assert out.count(" tok/s, ") == 6  # 2 batches x 3 systems
    assert "| hf_paged Engine (kernel " in out and "| generate_batch (" in out
