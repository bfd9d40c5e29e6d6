"""benchmarks/gpu_check.py: without a CUDA device it says so and exits cleanly; every part runs end to end on tiny
CPU shapes (`--device cpu`, the Triton kernel under its interpreter) and prints one markdown table; the verdicts
fail beyond their tolerances (negative controls), and a part that raises prints one failed row while the next part
still runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.benchmark_helpers import run_script

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
HEADER = "| part | case | result | verdict |"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table(out: str) -> list[list[str]]:
    """The cells of every markdown table line of `out` (header and separator included); an escaped `\\|` stays
    inside its cell."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def test_without_a_cuda_device_it_says_so_and_exits_cleanly():
    result = run_script(SCRIPT, CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "no CUDA device: benchmarks/gpu_check.py measures the GPU backends and needs one (see docs/gpu.md)"
    )


def test_every_part_runs_on_tiny_cpu_shapes_into_one_table():
    arguments = [
        "--device", "cpu", "--contexts", "16", "--batches", "1", "2", "--decode-tokens", "3", "--layers", "1",
        "--hidden", "128", "--requests", "4", "--budget-tokens", "512", "--scale", "0.02", "--repeats", "2",
    ]  # fmt: skip
    # the Triton kernel on CPU tensors, as in tests/test_triton.py
    result = run_script(SCRIPT, *arguments, timeout=600, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("# gpu_check\n\nCPU smoke run, torch ")
    assert out.splitlines().count(HEADER) == 1
    header, separator, *rows = table(out)
    assert header == ["part", "case", "result", "verdict"] and separator == ["---"] * 4
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    by_part = {
        part: [row[1:] for row in rows if row[0] == part] for part in ("kernels", "exactness", "decode", "serving")
    }
    assert sum(map(len, by_part.values())) == len(rows)
    for part, cells in by_part.items():
        assert cells[0][0] == "setup" and cells[-1][0] == "wall time", part
        assert not any(case.startswith("failed") for case, _, _ in cells), part

    fp32_kernels = [verdict for case, _, verdict in by_part["kernels"] if " fp32, block " in case]
    if importlib.util.find_spec("triton") is not None:
        assert len(fp32_kernels) == 3  # the Triton kernel, blocks of 16, 32, 256
    assert all(verdict == "ok" for verdict in fp32_kernels)
    fp32_exactness = [verdict for case, _, verdict in by_part["exactness"] if " fp32, " in case]
    assert len(fp32_exactness) >= 4 and all(verdict == "ok" for verdict in fp32_exactness)  # 2 models x 2 searches
    decode = by_part["decode"][1:-1]
    assert [case for case, _, _ in decode] == ["batch 1, context 16", "batch 2, context 16"]
    assert all(result.count(" tok/s (") == 4 for _, result, _ in decode)  # paged, paged eager, Dynamic, Static
    verdict = r"paged \d+\.\d\dx DynamicCache; paged \d+\.\d\dx StaticCache"
    assert all(re.fullmatch(verdict, found) for _, _, found in decode)
    (engine, engine_result, _), (baseline, _, ratio) = by_part["serving"][1:-1]
    assert engine.startswith("hf_paged Engine exact (kernel ") and " 0 graph steps of " in engine
    assert " tok/s, " in engine_result and engine_result.endswith("; 4/4 as exact")
    assert baseline.startswith("generate_batch (") and baseline.endswith(", use_cuda_graph=False)")  # no CUDA here
    assert re.fullmatch(r"Engine \(fastest variant\) \d+\.\d\dx generate_batch", ratio)


def test_negative_control_the_verdicts_fail_beyond_their_tolerances():
    gpu_check = load_script()
    fp32, bf16 = gpu_check.KERNEL_TOLERANCE[torch.float32], gpu_check.KERNEL_TOLERANCE[torch.bfloat16]
    assert gpu_check.within(fp32, fp32) == "ok" and gpu_check.within(2 * fp32, fp32) == "FAIL"
    assert gpu_check.within(bf16, bf16) == "ok" and gpu_check.within(2 * bf16, bf16) == "FAIL"
    assert gpu_check.within(float("nan"), bf16) == "FAIL"
    # fp32 generate: the tokens decide, however close the scores; bf16: the scores decide, whatever the tokens
    assert gpu_check.exactness_verdict(torch.float32, tokens_equal=False, scores_diff=0.0) == "FAIL"
    assert gpu_check.exactness_verdict(torch.float32, tokens_equal=True, scores_diff=0.0) == "ok"
    scores = gpu_check.BF16_SCORES_TOLERANCE
    assert gpu_check.exactness_verdict(torch.bfloat16, tokens_equal=False, scores_diff=scores / 2) == "ok"
    assert gpu_check.exactness_verdict(torch.bfloat16, tokens_equal=True, scores_diff=2 * scores) == "FAIL"
    assert gpu_check.speed_ratio("paged", 142.0, "DynamicCache", 100.0) == "paged 1.42x DynamicCache"
    assert gpu_check.speed_ratio("paged", None, "DynamicCache", 100.0) == "n/a"


@pytest.mark.parametrize(
    "offset,verdicts", [(1e-4, {"fp32": "FAIL", "bf16": "ok"}), (0.1, {"fp32": "FAIL", "bf16": "FAIL"})]
)
def test_negative_control_a_kernel_off_by_more_than_the_tolerance_fails_its_rows(monkeypatch, offset, verdicts):
    """A backend returning the reference plus `offset` is measured and judged like a real one."""
    import hf_paged.kernels
    from hf_paged.kernels.reference import gather_paged_attention

    class OffBackend:
        supports = staticmethod(lambda query, key_cache: True)

        @staticmethod
        def attention(query, key_cache, value_cache, *rest):
            exact = gather_paged_attention(query.float(), key_cache.float(), value_cache.float(), *rest[:-1])
            return (exact + offset).to(query.dtype)

    gpu_check = load_script()
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(hf_paged.kernels, "in_place_backend", lambda name: OffBackend)
    rows = list(gpu_check.kernel_part(["gather", "off"], scale=0.01))[1:]
    assert len(rows) == 6  # fp32 and bf16, blocks of 16, 32, 256
    for case, result, verdict in rows:
        assert verdict == verdicts[case.split()[1].rstrip(",")], (case, result)


def test_a_failing_part_prints_one_failed_row_and_the_next_part_still_runs(monkeypatch, capsys):
    gpu_check = load_script()

    def kernels_then_raise(names, scale):
        yield "triton fp32, block 16", "max abs error 1.00e-06", "ok"
        raise RuntimeError("bad | input\non two lines")

    def exactness(names, new_tokens):
        yield "llama fp32, gather block 16, greedy", "tokens equal: yes", "ok"

    monkeypatch.setattr(gpu_check, "kernel_part", kernels_then_raise)
    monkeypatch.setattr(gpu_check, "exactness_part", exactness)
    assert gpu_check.main(["--device", "cpu", "--parts", "kernels", "exactness"]) == 0
    _, _, *rows = table(capsys.readouterr().out)
    kernels_row, failed_row, *later_rows = rows
    assert kernels_row[:2] == ["kernels", "triton fp32, block 16"]
    assert failed_row[0] == "kernels" and failed_row[1].startswith("failed after ")
    assert failed_row[2:] == ["RuntimeError: bad \\| input on two lines", "FAIL"]
    assert [row[:2] for row in later_rows] == [
        ["exactness", "llama fp32, gather block 16, greedy"],
        ["exactness", "wall time"],
    ]
