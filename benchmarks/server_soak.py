"""`hf-paged serve`'s memory under sustained load: the real server in a subprocess, on loopback only, serving a tiny
random Llama with SmolLM2's tokenizer (every forward takes milliseconds, so the server's own per-request work
dominates) to `--clients` threads for at most `--requests` requests or `--seconds` seconds, whichever comes first.
The mix: completions and chat, streamed and not, with `logprobs` and `stop` strings, clients that close a stream
after a few chunks, and bad requests (400s). The server's resident memory (VmRSS) is read after the warm-up and every
`--every` requests; its latency histograms from `/metrics` are printed at the end.

Usage: python benchmarks/server_soak.py [--requests 20000] [--seconds 300] [--clients 16] [--warm-up 2000]
[--every 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MODEL = "tiny"


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
    args = parser.parse_args()

    folder = save_model(Path(tempfile.mkdtemp(prefix="hf_paged_soak_")) / "model")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "hf_paged.serve", "serve", str(folder), "--served-model-name", MODEL, "--host",
               "127.0.0.1", "--port", str(port), "--num-blocks", "2048", "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
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
                print(f"{rows[-1][0]:,} requests, {rows[-1][1]:.0f} s: server RSS {rows[-1][2]:.1f} MiB", flush=True)
                next_read += args.every
        stop.set()
        time.sleep(1)
        rows.append((count[0], time.monotonic() - start, resident_mib(server.pid)))
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"\n{count[0]:,} requests from {args.clients} clients in {rows[-1][1]:.0f} s")
    if len(rows) > 1:
        (n0, _, rss0), (n1, _, rss1) = rows[0], rows[-1]
        per_request = (rss1 - rss0) * 2**20 / max(n1 - n0, 1)
        print(f"server RSS after the warm-up ({n0:,} requests): {rss0:.1f} MiB; at the end: {rss1:.1f} MiB "
              f"({rss1 - rss0:+.1f} MiB over {n1 - n0:,} requests, {per_request:+.1f} bytes a request)")  # fmt: skip
    for line in metrics.splitlines():
        if line.endswith(("_count", "_sum")) or "_seconds_count " in line or "_seconds_sum " in line:
            print(line)
        elif line.startswith(("hf_paged_requests_total", "hf_paged_kv_blocks_used ")):
            print(line)


if __name__ == "__main__":
    main()
