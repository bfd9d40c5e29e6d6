"""`hf-paged serve --tp N`: check the degree against the model, start the N ranks and supervise them.

The command's own process starts every rank as `python -m hf_paged.serve <the same arguments>` in a session of its
own, with the variables torchrun would set (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT` on a free loopback port) and `HF_PAGED_TP_RANK`. Rank 0 serves HTTP; the others follow it. The
supervisor forwards SIGINT/SIGTERM to rank 0 (whose graceful shutdown releases the followers), and when any rank
exits with an error it stops every other rank (SIGTERM, then SIGKILL) and exits with 1, so no rank outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

from ..support import layer_configs

logger = logging.getLogger("hf_paged.serve")

RANK_ENV = "HF_PAGED_TP_RANK"  # set in the ranks this module starts
STOP_GRACE_S = 10.0  # seconds a rank has to exit after SIGTERM before SIGKILL


def launched_rank() -> int | None:
    """This process's rank when `hf-paged serve --tp` started it, else `None`."""
    value = os.environ.get(RANK_ENV)
    return None if value is None else int(value)


def check_tp_degree(model_path: str, tp: int, *, gguf_file: str | None = None, device: str | None = None) -> None:
    """Refuse a tensor-parallel degree that cannot split the model's heads, before any rank starts.

    Raises:
        ValueError: `tp` exceeds or does not divide the KV heads or the attention heads, asks for more CUDA
            devices than are visible, or comes with `--device`; or the model's config cannot be read.
    """
    if tp == 1:
        return
    if device is not None:
        raise ValueError(f"--device {device} cannot be combined with --tp {tp}: rank r runs on cuda:r (or the CPU)")
    import torch
    from transformers import AutoConfig

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(model_path, **extra).get_text_config(decoder=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the config of {model_path} to check --tp {tp}: {error}") from error
    kv_counts, head_counts = set(), set()
    for layer_config in layer_configs(config, 1):  # a heterogeneous config sets head counts layer by layer
        head_counts.add(layer_config.num_attention_heads)
        kv_counts.add(getattr(layer_config, "num_key_value_heads", None) or layer_config.num_attention_heads)
    checks = [(count, "KV heads (num_key_value_heads)") for count in sorted(kv_counts)]
    for count, name in checks + [(count, "attention heads") for count in sorted(head_counts)]:
        divisors = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
        if tp > count:
            raise ValueError(
                f"--tp {tp} is more than the model's {count} {name}: every rank needs at least one; use one of "
                f"{divisors}"
            )
        if count % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {count} {name}; use one of {divisors}")
    if torch.cuda.is_available() and tp > torch.cuda.device_count():
        raise ValueError(f"--tp {tp} needs {tp} CUDA devices (one per rank); {torch.cuda.device_count()} visible")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(argv: list[str], tp: int) -> int:
    """Start `tp` ranks of `hf-paged serve` with `argv` and wait for them; the command's exit status (0 after a
    clean stop, 1 when a rank failed, 130 when interrupted before the server ran)."""
    port = free_port()
    logger.info("hf_paged: starting %d tensor-parallel ranks (rendezvous on 127.0.0.1:%d)", tp, port)
    ranks: list[subprocess.Popen] = []
    stopping = []

    def forward(sig: int, frame) -> None:  # noqa: ARG001 - signal handler signature
        stopping.append(sig)
        if ranks and ranks[0].poll() is None:
            ranks[0].send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(tp):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(tp),
                "LOCAL_WORLD_SIZE": str(tp),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                RANK_ENV: str(rank),
            }
            command = [sys.executable, "-m", "hf_paged.serve", *argv]
            ranks.append(subprocess.Popen(command, env=env, start_new_session=True))
        logger.info("hf_paged: rank processes %s", " ".join(f"{r}:{p.pid}" for r, p in enumerate(ranks)))
        return _supervise(ranks, stopping)
    finally:
        _stop(ranks)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(ranks: list[subprocess.Popen], stopping: list) -> int:
    """Wait until rank 0 exits (then give the followers time to leave) or a rank fails."""
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = [(r, code) for r, code in enumerate(codes) if code not in (None, 0)]
        if failed and not (stopping and failed == [(0, codes[0])]):
            rank, code = failed[0]
            logger.error("hf_paged: rank %d exited with status %d; stopping the other ranks", rank, code)
            return 1
        if codes[0] is not None:  # rank 0 stopped: the followers got its shutdown and leave
            deadline = time.monotonic() + STOP_GRACE_S
            while any(rank.poll() is None for rank in ranks[1:]) and time.monotonic() < deadline:
                time.sleep(0.05)
            return 130 if codes[0] == 130 else (0 if codes[0] == 0 or stopping else 1)
        time.sleep(0.1)  # a follower that exited with 0 was released by rank 0, which is about to exit too


def _stop(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, SIGKILL those left after `STOP_GRACE_S`, and reap them all."""
    for rank in ranks:
        if rank.poll() is None:
            rank.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
