"""Run a function in N spawned ranks of a gloo process group on this machine, with a deadline: the first rank to
fail, or the deadline, kills every rank, and the error carries the ranks' tracebacks. Imports only torch, so ranks
whose work loads no model start quickly."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

JOB_TIMEOUT_S = 240
PORT_ATTEMPTS = 4
COLLECTIVE_TIMEOUT_S = 60  # a rank waiting in a collective for a rank that is gone gives up after this


def gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def free_port() -> int:
    """A loopback port free now; whoever binds it later may find it taken (see `lost_its_port`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lost_its_port(output: str) -> bool:
    """Whether a process's output (or a rank's traceback) says the port it was given had been taken meanwhile."""
    return "address already in use" in output.lower()


def rank_main(work, rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    """Entry point of one spawned rank: join the gloo group, run `work(rank, *args)`, write its result (rank 0) or
    the traceback (any rank, which then exits with 1)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        result = work(rank, *args)
        if rank == 0:
            Path(out_dir, "result.pkl").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        sys.exit(1)


def start_ranks(work, args: tuple, out_dir: Path, world_size: int = 2) -> list:
    """Start `work(rank, *args)` in `world_size` spawned ranks of one gloo group; their (daemon) processes."""
    context = mp.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=rank_main, args=(work, rank, world_size, port, str(out_dir), args), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return processes


def run_ranks(work, args: tuple, out_dir: Path, world_size: int = 2, timeout_s: float = JOB_TIMEOUT_S):
    """Run `work(rank, *args)` (a module-level function) in `world_size` spawned ranks; rank 0's result.

    The rendezvous port is picked free and bound later, so another process can take it in between: a job whose
    ranks failed because the address was in use is run again on another port, up to `PORT_ATTEMPTS` times.

    Raises:
        RuntimeError: a rank failed or the job ran past `timeout_s`; every rank has been killed and reaped.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_ranks_once(work, args, out_dir, world_size, timeout_s)
        except RuntimeError as error:
            if not lost_its_port(str(error)) or attempt == PORT_ATTEMPTS:
                raise
            for path in Path(out_dir).glob("rank*.err"):
                path.unlink()


def _run_ranks_once(work, args: tuple, out_dir: Path, world_size: int, timeout_s: float):
    processes = start_ranks(work, args, out_dir, world_size)
    deadline = time.monotonic() + timeout_s
    try:
        while any(process.is_alive() for process in processes):
            if any(process.exitcode not in (None, 0) for process in processes) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    codes = [process.exitcode for process in processes]
    errors = "\n".join(path.read_text() for path in sorted(Path(out_dir).glob("rank*.err")))
    if codes != [0] * world_size or errors:
        raise RuntimeError(
            f"the {world_size}-rank job failed (exit codes {codes}, limit {timeout_s:.0f} s):\n"
            + (errors or "no traceback: a rank died before its work started (see its stderr)")
        )
    return pickle.loads((Path(out_dir) / "result.pkl").read_bytes())


def fail_on_rank_1(rank: int) -> None:
    """A job that fails: rank 1 raises while rank 0 waits in a collective for it."""
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()
