"""The prefix cache beyond memory (`kv_offload`) on SmolLM2-135M fp32, CPU.

- `restart`: process A answers a prompt whose first 2,048 tokens are a document (English text of Python's own
  documentation, `pydoc_data.topics`) with a disk tier; a new process B, and a process C without tiers, answer the
  same prompt. Reports the prompt tokens B loaded instead of computing, the time to first token of B and C (each the
  first prompt of its process, after one short warm-up prompt) and whether their 16 greedy tokens are identical.
- `multiturn`: 32 conversations x 6 turns through the Engine (`exact=True`), each turn's prompt the whole history
  (replies included; each user turn 48 tokens of the document from token 60,000 on), conversations interleaved turn
  by turn; the pool holds at most a quarter of the histories, so the prefix cache evicts. Twice: one request at a
  time (a time to first token is then the prompt's prefill or load), and each turn's 32 requests submitted together
  (8 run at once: the time to first token includes the queue).
  Without tiers, with the disk tier, and with the Redis tier (`--redis URL`; started on a free port when
  `redis-server` is installed and no URL is given): prompt tokens computed, time to first token p50 on turns >= 2,
  outputs compared.

`--engine default` runs the multi-turn pass through the Engine's defaults (compiled steps, each Engine compiling on
an untimed warm-up prompt) instead of `exact=True`; `--modes` picks the passes.

Usage: `python benchmarks/kv_offload.py [restart|multiturn|all] [--engine exact|default] [--modes ...]`
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PREFIX_TOKENS = 2048


@functools.cache
def _document(tokenizer) -> tuple[int, ...]:
    """The token ids of the document (113,108 with SmolLM2's tokenizer)."""
    from pydoc_data.topics import topics

    return tuple(tokenizer("\n\n".join(topics[name] for name in sorted(topics))).input_ids)


def _document_ids(tokenizer, count: int, offset: int = 0) -> list[int]:
    """`count` token ids of the document from `offset`; `ValueError` where the document ends before."""
    document = _document(tokenizer)
    if offset + count > len(document):
        raise ValueError(f"tokens {offset}..{offset + count} asked of a document of {len(document)} tokens")
    return list(document[offset : offset + count])


def role(name: str, directory: str) -> None:
    """One process of `restart`: `write`, `read` (both with the disk tier) or `recompute` (none)."""
    import torch

    from hf_paged import get_pool
    from hf_paged.reference_models import load_smollm2

    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    document = _document_ids(tokenizer, PREFIX_TOKENS)
    question = tokenizer("\n\nQuestion: what is this document about? Answer:").input_ids
    prompt = torch.tensor([document + question])
    config = {"block_size": 16, "max_memory": "512MiB"}
    if name != "recompute":
        config["kv_offload"] = {"dir": directory}
    options = dict(do_sample=False, cache_implementation="paged", cache_config=config)
    warmup = torch.tensor([_document_ids(tokenizer, 32, offset=50000)])
    start = time.perf_counter()
    model.generate(warmup, max_new_tokens=2, **options)  # one-time costs (and the weights digest with tiers)
    warmup_s = time.perf_counter() - start
    offload = get_pool(model).offload
    loaded_before = 0 if offload is None else offload.stats().tokens_loaded  # the warm-up's own prefix
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=1, **options)
    ttft = time.perf_counter() - start
    loaded = 0 if offload is None else offload.stats().tokens_loaded - loaded_before
    output = model.generate(prompt, max_new_tokens=16, **options)[0, prompt.shape[1] :].tolist()
    if offload is not None:
        offload.flush()
    result = {"ttft_s": ttft, "warmup_s": warmup_s, "loaded": loaded, "prompt": prompt.shape[1], "tokens": output}
    print(json.dumps(result))


def _run_role(name: str, directory: str) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--role", name, "--dir", directory], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def restart() -> list[str]:
    directory = tempfile.mkdtemp(prefix="hf_paged-kv-")
    try:
        _run_role("write", directory)
        read = _run_role("read", directory)
        recompute = _run_role("recompute", directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return [
        "| restart, SmolLM2 fp32, prompt of {} tokens | tokens loaded | TTFT | vs recompute | 16 tokens |".format(
            read["prompt"]
        ),
        "|---|---|---|---|---|",
        f"| new process, disk tier | {read['loaded']} ({read['loaded'] / read['prompt']:.1%}) | "
        f"{read['ttft_s']:.3f} s | {recompute['ttft_s'] / read['ttft_s']:.1f}x faster | "
        f"{'identical' if read['tokens'] == recompute['tokens'] else 'DIFFER'} |",
        f"| new process, no tiers (recompute) | 0 | {recompute['ttft_s']:.3f} s | 1.0x | - |",
        f"(first prompt of the process after a 32-token warm-up: {read['warmup_s']:.2f} s with tiers, including the "
        f"weights digest, vs {recompute['warmup_s']:.2f} s without)",
    ]


# ---------------------------------------------------------------------------- multi-turn
CONVERSATIONS, TURNS, USER_TOKENS, REPLY_TOKENS, SYSTEM_TOKENS = 32, 6, 48, 16, 96
USER_OFFSET = 60000  # the user turns' text: conversation c, turn t from token 60,000 + 1,500 c + 60 t


def _conversation_run(model, tokenizer, tiers: dict | None, num_blocks: int, together: bool, exact: bool) -> dict:
    """One pass of the conversations: each turn of every conversation submitted `together` (32 requests a turn,
    8 running at once), or one request at a time (so a time to first token is the prompt's prefill or load alone,
    not its wait in the queue). `exact`: the Engine's eager steps; else its defaults (compiled steps, compiled during
    a warm-up prompt that is not timed)."""
    import hf_paged
    from hf_paged import release_pool

    release_pool(model)
    options = {"block_size": 16, "num_blocks": num_blocks}
    if tiers is not None:
        options["kv_offload"] = tiers
    histories = [
        _document_ids(tokenizer, SYSTEM_TOKENS, offset=1000 * c) for c in range(CONVERSATIONS)
    ]  # each conversation its own opening
    replies, ttfts, computed = [], [], 0
    with hf_paged.Engine(model, tokenizer, exact=exact, max_batch_size=8, **options) as engine:
        if not exact:  # compile on a prompt that shares nothing with the conversations
            engine.generate([_document_ids(tokenizer, 32, offset=50000)], max_new_tokens=2)
        for turn in range(TURNS):
            prompts = []
            for c in range(CONVERSATIONS):
                histories[c] = histories[c] + _document_ids(
                    tokenizer, USER_TOKENS, offset=USER_OFFSET + 1500 * c + 60 * turn
                )
                prompts.append(list(histories[c]))
            before = engine.pool.stats().prefix_tokens_reused
            options = dict(max_new_tokens=REPLY_TOKENS, min_new_tokens=REPLY_TOKENS)
            if together:
                outputs = engine.generate(prompts, **options)
            else:
                outputs = [engine.generate([prompt], **options)[0] for prompt in prompts]
            reused = engine.pool.stats().prefix_tokens_reused - before
            computed += sum(len(p) for p in prompts) - reused
            if turn >= 1:
                ttfts.extend(o.time_to_first_token for o in outputs)
            for c, output in enumerate(outputs):
                histories[c] = histories[c] + output.token_ids
                replies.append(output.token_ids)
        offload = engine.pool.offload
        loaded = 0 if offload is None else offload.stats().tokens_loaded
    return {"computed": computed, "ttft_p50": statistics.median(ttfts), "replies": replies, "loaded": loaded}


def _start_redis() -> tuple[subprocess.Popen | None, str | None]:
    server = shutil.which("redis-server")
    if server is None:
        return None, None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


def multiturn(redis_url: str | None, modes: list[str], exact: bool) -> list[str]:
    import torch

    from hf_paged.reference_models import load_smollm2

    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    final = SYSTEM_TOKENS + TURNS * (USER_TOKENS + REPLY_TOKENS)
    num_blocks = max(CONVERSATIONS * final // 16 // 4, 8 * (final // 16 + 2))  # a quarter of the histories
    directory = tempfile.mkdtemp(prefix="hf_paged-kv-")
    process = None
    if redis_url is None:
        process, redis_url = _start_redis()
    runs = {"no tiers": None, "disk tier": {"dir": directory}}
    if redis_url is not None:
        runs["Redis tier"] = {"remote": redis_url}
    lines = []
    try:
        for together in [mode == "together" for mode in modes]:
            results = {}
            for name, tiers in runs.items():
                if tiers is not None and "dir" in tiers:
                    shutil.rmtree(directory, ignore_errors=True)
                if tiers is not None and "remote" in tiers:
                    import redis

                    redis.Redis.from_url(redis_url).flushdb()
                print(f"{name}, {'together' if together else 'one at a time'}", file=sys.stderr, flush=True)
                results[name] = _conversation_run(model, tokenizer, tiers, num_blocks, together, exact)
            lines += _table(results, num_blocks, together, exact)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if process is not None:
            process.terminate()
    return lines


def _table(results: dict, num_blocks: int, together: bool, exact: bool) -> list[str]:
    base = results["no tiers"]
    how = "each turn's 32 requests together" if together else "one request at a time"
    how += ", exact Engine" if exact else ", Engine defaults (compiled)"
    lines = [
        "",
        f"| {CONVERSATIONS} conversations x {TURNS} turns, {how}; pool {num_blocks} blocks | prompt tokens computed "
        "| vs no tiers | TTFT p50, turns >= 2 | vs no tiers | tokens loaded | outputs |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        same = "identical" if result["replies"] == base["replies"] else "DIFFER"
        lines.append(
            f"| {name} | {result['computed']} | {result['computed'] / base['computed']:.2f}x | "
            f"{result['ttft_p50']:.3f} s | {base['ttft_p50'] / result['ttft_p50']:.2f}x better | {result['loaded']} | "
            f"{same} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="all", choices=["restart", "multiturn", "all"])
    parser.add_argument("--redis", default=None, help="a Redis URL for the multi-turn Redis row")
    parser.add_argument(
        "--engine",
        default="exact",
        choices=["exact", "default"],
        help="multi-turn: the Engine's eager steps (exact=True) or its defaults (compiled steps)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["one-at-a-time", "together"],
        choices=["one-at-a-time", "together"],
        help="multi-turn: one request at a time, and/or each turn's requests together",
    )
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        role(args.role, args.dir)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.what in ("restart", "all"):
        print("\n".join(restart()), flush=True)
    if args.what in ("multiturn", "all"):
        print("\n".join(multiturn(args.redis, args.modes, args.engine == "exact")), flush=True)


if __name__ == "__main__":
    main()
