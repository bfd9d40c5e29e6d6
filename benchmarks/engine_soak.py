"""The Engine's memory over many requests: a tiny Llama serves `--requests` requests (default 50,000) arriving 64 at
a time (short prompts drawn from a few hundred, greedy and sampled, 5% aborted), in a pool of half their demand. After
a warm-up, the process's resident memory and, with `--tracemalloc`, the memory Python holds (traced from the start,
so that what the warm-up allocated and later requests free counts as freed; tracing halves the speed) are read
every `--every` requests; a per-request leftover shows as a slope.

Usage: python benchmarks/engine_soak.py [--requests 50000] [--warm-up 5000] [--every 5000] [--tracemalloc] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from common import environment, markdown_table

from hf_paged import Engine
from hf_paged.reference_models import tiny_model

IN_FLIGHT = 64


def resident_bytes() -> int:
    """The process's resident memory (Linux: VmRSS), or 0 where unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--warm-up", type=int, default=5_000)
    parser.add_argument("--every", type=int, default=5_000)
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python's allocations too (slower)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 12))] for _ in range(400)]
    engine = Engine(
        tiny_model("llama"), block_size=4, num_blocks=IN_FLIGHT * 5 // 2, max_batch_size=IN_FLIGHT, exact=True
    )
    if args.tracemalloc:
        tracemalloc.start()
    done, offered, rows, start = 0, 0, [], time.perf_counter()
    baseline = None
    checkpoints = range(args.warm_up, args.requests + 1, args.every)
    for checkpoint in checkpoints:
        while done < checkpoint:
            while offered < args.requests and engine.num_running + engine.num_waiting < IN_FLIGHT:
                new = rng.randint(1, 6)
                request_id = engine.add_request(rng.choice(prompts), max_new_tokens=new, do_sample=rng.random() < 0.3)
                offered += 1
                if rng.random() < 0.05:
                    engine.abort(request_id)
            done += sum(output.finished for output in engine.step())
        gc.collect()
        traced, rss = tracemalloc.get_traced_memory()[0], resident_bytes()  # traced: 0 without --tracemalloc
        if baseline is None:
            baseline = (done, traced, rss)
        rows.append([f"{done:,}", f"{time.perf_counter() - start:.0f}", f"{traced:,}", f"{traced - baseline[1]:+,}",
                     f"{rss / 2**20:.1f}", f"{(rss - baseline[2]) / 2**20:+.1f}"])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    if args.tracemalloc:
        tracemalloc.stop()
    measured = done - baseline[0]
    traced_growth = int(rows[-1][3].replace(",", ""))
    print(f"\n{environment()}; {engine.latency.e2e_request_latency.count:,} requests ended with stop or length, "
          f"{engine.pool.stats().num_used} blocks in use at the end")  # fmt: skip
    print(markdown_table(
        ["requests done", "seconds", "traced bytes", "traced since warm-up", "RSS MiB", "RSS since warm-up"], rows
    ))  # fmt: skip
    rss_growth = float(rows[-1][5])
    print(f"\nafter the warm-up, over {measured:,} requests: resident memory {rss_growth:+.1f} MiB "
          f"({rss_growth * 2**20 / max(measured, 1):+.1f} bytes a request)"
          + (f", traced {traced_growth:+,} bytes ({traced_growth / max(measured, 1):+.2f} a request)"
             if args.tracemalloc else ""))  # fmt: skip


if __name__ == "__main__":
    main()
