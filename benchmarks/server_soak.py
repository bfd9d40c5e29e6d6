"""`hf-paged serve`'s memory under sustained load: the real server in a subprocess, on loopback only, serving a tiny
random Llama with SmolLM2's tokenizer (every forward takes milliseconds, so the server's own per-request work
dominates) to `--clients` threads for at most `--requests` requests or `--seconds` seconds, whichever comes first.
The mix: completions and chat, streamed and not, with `logprobs` and `stop` strings, clients that close a stream
after a few chunks, and bad requests (400s). The server's resident memory (VmRSS) is read after the warm-up and every
`--every` requests, with glibc's heap figures (`mallinfo2`: bytes malloc has handed out, bytes it holds free); at
the end, the server calls `malloc_trim(0)` and its RSS is read again; its latency histograms from `/metrics` are
printed last. With `--trace`, the server runs under `tracemalloc` and the allocation sites whose Python memory grew
most between the warm-up and the end are printed (much slower; the RSS figures then include tracemalloc's own
bookkeeping). Linux with glibc only.

Usage: python benchmarks/server_soak.py [--requests 20000] [--seconds 300] [--clients 16] [--warm-up 2000]
[--every 2000] [--trace]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import httpx

MODEL = "tiny"

# Runs `hf-paged serve`, under tracemalloc when $HF_PAGED_SOAK_TRACE is set. Signals, each answered in a file
# $HF_PAGED_SOAK_STEM.<kind>.<n>: SIGUSR1 a tracemalloc snapshot (`trace`), SIGUSR2 glibc's heap figures (`malloc`:
# bytes in use, bytes free but held), SIGURG `malloc_trim(0)` (hand back free heap pages) then the same figures.
SERVER = """
import ctypes, gc, json, os, signal, sys, tracemalloc
if os.environ.get("HF_PAGED_SOAK_TRACE"):
    tracemalloc.start(12)
counts = {}
def answer(kind, write):
    counts[kind] = counts.get(kind, 0) + 1
    path = os.environ["HF_PAGED_SOAK_STEM"] + f".{kind}.{counts[kind]}"
    write(path + ".part")
    os.replace(path + ".part", path)
def trace(*_):
    gc.collect()  # what only the cyclic collector frees is not a leak
    answer("trace", lambda path: tracemalloc.take_snapshot().dump(path))
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def heap(path):
    info = libc.mallinfo2()
    with open(path, "w") as file:
        json.dump({"in_use": info.uordblks + info.hblkhd, "free_held": info.fordblks}, file)
def malloc(*_):
    answer("malloc", heap)
def trim(*_):
    libc.malloc_trim(0)
    answer("trim", heap)
signal.signal(signal.SIGUSR1, trace)
signal.signal(signal.SIGUSR2, malloc)
signal.signal(signal.SIGURG, trim)
from hf_paged.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_model(folder: Path) -> Path:
    """A 2-layer Llama of width 64 with SmolLM2's tokenizer and vocabulary, context 8,192."""
    from transformers import AutoTokenizer

    from hf_paged.reference_models import smollm2_path, tiny_model

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=8192).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def ask(server: subprocess.Popen, stem: str, kind: str, counts: dict) -> Path:
    """Send the server the signal of `kind` (`trace`, `malloc` or `trim`; see `SERVER`) and wait for its answer."""
    counts[kind] = counts.get(kind, 0) + 1
    server.send_signal({"trace": signal.SIGUSR1, "malloc": signal.SIGUSR2, "trim": signal.SIGURG}[kind])
    path = Path(f"{stem}.{kind}.{counts[kind]}")
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the server did not answer {kind!r}")
        time.sleep(0.1)
    return path


def heap_mib(path: Path) -> tuple[float, float]:
    """(MiB malloc has handed out and not got back, MiB free but held by malloc) from a `malloc`/`trim` answer."""
    figures = json.loads(path.read_text())
    return figures["in_use"] / 2**20, figures["free_held"] / 2**20


def print_growth(before, after, top: int = 15) -> None:
    """The allocation sites (whole tracebacks) whose memory grew most from `before` to `after`."""
    differences = after.compare_to(before, "traceback")
    total = sum(d.size_diff for d in differences)
    print(f"\ntracemalloc: Python memory {total / 2**20:+.2f} MiB from the warm-up to the end; what grew most:")
    grown = sorted((d for d in differences if d.size_diff > 0), key=lambda d: -d.size_diff)
    for difference in grown[:top]:
        print(f"{difference.size_diff / 1024:+9.1f} KiB in {difference.count_diff:+7d} blocks")
        for line in difference.traceback.format(limit=6, most_recent_first=True):
            print("    " + line)


def one_request(client: httpx.Client, base: str, rng: random.Random) -> None:
    """One request of the mix (its answer is read and dropped)."""
    kind = rng.random()
    tokens = rng.randint(1, 12)
    if kind < 0.05:  # a bad request: 400
        client.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 9})
    elif kind < 0.35:
        messages = [{"role": "user", "content": f"Tell me about {rng.random()}"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": rng.choice([0, 0.8]),
                "logprobs": True, "top_logprobs": 2}  # fmt: skip
        client.post(f"{base}/v1/chat/completions", json=body)
    elif kind < 0.75:
        body = {"model": MODEL, "prompt": f"Once upon a time {rng.randrange(10**6)}", "max_tokens": tokens,
                "stop": ["\n\n"], "logprobs": 1}  # fmt: skip
        client.post(f"{base}/v1/completions", json=body)
    else:  # streamed; a fifth of the streams are closed after two chunks (the client leaves)
        body = {"model": MODEL, "prompt": f"Story {rng.randrange(10**6)}:", "max_tokens": tokens + 8, "stream": True}
        with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            for index, _ in enumerate(response.iter_lines()):
                if index == 2 and rng.random() < 0.2:
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warm-up", type=int, default=2_000)
    parser.add_argument("--every", type=int, default=2_000)
    parser.add_argument("--trace", action="store_true", help="run the server under tracemalloc; print what grew")
    args = parser.parse_args()

    folder = save_model(Path(tempfile.mkdtemp(prefix="hf_paged_soak_")) / "model")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    stem = str(folder.parent / "answer")
    # --exact: eager steps, as the documented runs
    command = [sys.executable, "-c", SERVER, "serve", str(folder), "--served-model-name", MODEL, "--host",
               "127.0.0.1", "--port", str(port), "--num-blocks", "2048", "--log-level", "warning",
               "--exact"]  # fmt: skip
    env = {**os.environ, "HF_PAGED_SOAK_STEM": stem, **({"HF_PAGED_SOAK_TRACE": "1"} if args.trace else {})}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    snapshots, counts = [], {}
    try:
        deadline = time.monotonic() + (600 if args.trace else 120)  # tracemalloc slows the imports down
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with status {server.returncode}: {' '.join(command)}")
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.3)
        count, lock, stop = [0], threading.Lock(), threading.Event()
        end = time.monotonic() + args.seconds

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=60) as client:
                while not stop.is_set() and time.monotonic() < end:
                    with lock:
                        if count[0] >= args.requests:
                            return
                        count[0] += 1
                    one_request(client, base, rng)

        threads = [threading.Thread(target=client_loop, args=(seed,), daemon=True) for seed in range(args.clients)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        rows, next_read = [], args.warm_up
        while any(thread.is_alive() for thread in threads):
            time.sleep(0.2)
            if count[0] >= next_read:
                rows.append((count[0], time.monotonic() - start, resident_mib(server.pid)))
                in_use, held = heap_mib(ask(server, stem, "malloc", counts))
                print(f"{rows[-1][0]:,} requests, {rows[-1][1]:.0f} s: server RSS {rows[-1][2]:.1f} MiB (malloc: "
                      f"{in_use:.1f} MiB in use, {held:.1f} MiB free but held)", flush=True)  # fmt: skip
                if args.trace and not snapshots:
                    snapshots.append(tracemalloc.Snapshot.load(str(ask(server, stem, "trace", counts))))
                next_read += args.every
        stop.set()
        time.sleep(1)
        rows.append((count[0], time.monotonic() - start, resident_mib(server.pid)))
        heaps = heap_mib(ask(server, stem, "malloc", counts)), heap_mib(ask(server, stem, "trim", counts))
        trimmed = resident_mib(server.pid)
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        if snapshots:
            snapshots.append(tracemalloc.Snapshot.load(str(ask(server, stem, "trace", counts))))
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"\n{count[0]:,} requests from {args.clients} clients in {rows[-1][1]:.0f} s")
    if len(rows) > 1:
        (n0, _, rss0), (n1, _, rss1) = rows[0], rows[-1]
        per_request = (rss1 - rss0) * 2**20 / max(n1 - n0, 1)
        print(f"server RSS after the warm-up ({n0:,} requests): {rss0:.1f} MiB; at the end: {rss1:.1f} MiB "
              f"({rss1 - rss0:+.1f} MiB over {n1 - n0:,} requests, {per_request:+.1f} bytes a request)")  # fmt: skip
        (in_use, held), (_, held_after) = heaps
        print(f"at the end, malloc: {in_use:.1f} MiB in use, {held:.1f} MiB free but held; after malloc_trim(0): "
              f"{held_after:.1f} MiB held, server RSS {trimmed:.1f} MiB")  # fmt: skip
    if len(snapshots) == 2:
        print_growth(*snapshots)
    for line in metrics.splitlines():
        if line.endswith(("_count", "_sum")) or "_seconds_count " in line or "_seconds_sum " in line:
            print(line)
        elif line.startswith(("hf_paged_requests_total", "hf_paged_kv_blocks_used ")):
            print(line)


if __name__ == "__main__":
    main()
