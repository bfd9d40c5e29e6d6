"""The Engine with tensor parallelism on CPU: tokens/s of one process vs N gloo ranks (`DistributedEngine`) on the
same requests, and each rank's KV bytes.

Workload: `--requests` random prompts of 16 to 64 tokens, `--new-tokens` greedy tokens each (end-of-sequence
ignored), one `generate` call after a short warm-up. The model is saved to a temporary folder and loaded from it:
in one process as is, in every rank with `tp_plan="auto"` (each rank holds 1/N of the heads, and of every token's
KV). One process runs with `--threads` torch threads and with `--threads / N`; each rank runs `--threads / N`, so
both setups use the same cores. The ranks' greedy tokens are compared with the single process's.

Usage: python benchmarks/tp_engine.py [--model tiny|smollm2] [--ranks 2] [--requests 64] [--new-tokens 32]
       [--threads 2]   (smollm2 has 3 KV heads: use --ranks 3)
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp
from common import environment, markdown_table

import hf_paged

BLOCK_SIZE = 16
NUM_BLOCKS = 512


def save_model(name: str, folder: Path) -> str:
    from hf_paged.reference_models import smollm2_path, tiny_model

    if name == "smollm2":
        return str(smollm2_path())
    tiny_model("llama", num_key_value_heads=4, max_position_embeddings=4096).save_pretrained(folder)
    return str(folder)


def workload(num_requests: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(16, 65))] for _ in range(num_requests)]


def load(path: str, tp: bool):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **({"tp_plan": "auto"} if tp else {}))


def timed_generate(engine, prompts: list[list[int]], new_tokens: int):
    engine.generate(prompts[:2], max_new_tokens=2, eos_token_id=())  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, max_new_tokens=new_tokens, eos_token_id=())
    seconds = time.perf_counter() - start
    return outputs, seconds


def kv_bytes(engine) -> tuple[int, int]:
    """`(bytes per token, peak bytes in use)` of this process's pool."""
    shape, stats = engine.pool.kv_shape, engine.pool.stats()
    return shape.bytes_per_token, stats.peak_used * stats.block_size * shape.bytes_per_block_token


def single(path: str, prompts, new_tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    engine = hf_paged.Engine(load(path, tp=False).eval(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, exact=True)
    outputs, seconds = timed_generate(engine, prompts, new_tokens)
    return {"tokens": [o.token_ids for o in outputs], "seconds": seconds, "kv": [kv_bytes(engine)]}


def rank_main(rank: int, world_size: int, port: int, path: str, prompts, new_tokens: int, threads: int, out: str):
    from hf_paged.engine.distributed import DistributedEngine, init_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    init_distributed(timeout_s=60)
    engine = hf_paged.Engine(load(path, tp=True).eval(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    distributed = DistributedEngine(engine, timeout_s=60)
    if rank == 0:
        outputs, seconds = timed_generate(distributed, prompts, new_tokens)
        result = {"tokens": [o.token_ids for o in outputs], "seconds": seconds}
        distributed.close()  # releases the followers
    else:
        distributed.follow()
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, kv_bytes(engine))
    if rank == 0:
        Path(out).write_bytes(pickle.dumps({**result, "kv": gathered}))
    torch.distributed.destroy_process_group()


def ranks(path: str, prompts, new_tokens: int, world_size: int, threads: int) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.pkl")
        mp.spawn(rank_main, (world_size, port, path, prompts, new_tokens, threads, out), nprocs=world_size)
        return pickle.loads(Path(out).read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split among the ranks)")
    args = parser.parse_args()
    per_rank = max(1, args.threads // args.ranks)
    with tempfile.TemporaryDirectory() as folder:
        path = save_model(args.model, Path(folder) / "model")
        from transformers import AutoConfig

        prompts = workload(args.requests, AutoConfig.from_pretrained(path).vocab_size)
        runs = [
            (f"1 process, {args.threads} threads", single(path, prompts, args.new_tokens, args.threads)),
            (f"1 process, {per_rank} thread(s)", single(path, prompts, args.new_tokens, per_rank)),
            (
                f"{args.ranks} ranks x {per_rank} thread(s)",
                ranks(path, prompts, args.new_tokens, args.ranks, per_rank),
            ),
        ]
    reference = runs[0][1]["tokens"]
    total = sum(len(tokens) for tokens in reference)
    rows = []
    for label, run in runs:
        same = sum(tokens == expected for tokens, expected in zip(run["tokens"], reference))
        per_token = ", ".join(f"{b:,}" for b, _ in run["kv"])
        peak = ", ".join(f"{p / 2**20:.2f}" for _, p in run["kv"])
        rows.append([label, f"{total / run['seconds']:.0f}", f"{run['seconds']:.2f}", per_token, peak,
                     f"{same}/{len(reference)}"])  # fmt: skip
    machine = environment().rsplit(", ", 1)[0]  # the threads are in the table
    print(f"{args.model}, {args.requests} requests x {args.new_tokens} new tokens, block size {BLOCK_SIZE}; "
          f"{machine}, {os.cpu_count()} cores")  # fmt: skip
    print(markdown_table(
        ["setup", "tokens/s", "seconds", "KV bytes/token per rank", "peak KV MiB per rank", "same tokens as 1 process"],
        rows,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
