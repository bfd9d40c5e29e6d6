"""A rank of a `DistributedEngine` that is killed or stops answering stops the others with `RankFailedError`
within a bounded time, and no process is left behind.

Each scenario starts 2 gloo ranks (`distributed_helpers.start_ranks`) of a tiny Llama loaded with
`tp_plan="auto"`, runs requests, and makes one rank fail in its 3rd step: killed (SIGKILL), stopped (SIGSTOP) so
that only the control group's timeout can tell, or diverging (its step reports other tokens), which the per-step
comparison catches on every rank.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import warnings
from pathlib import Path

import pytest

import hf_paged
from hf_paged.engine.distributed import DistributedEngine, RankFailedError
from hf_paged.reference_models import tiny_model
from tests.distributed_helpers import gloo_available, start_ranks

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with the gloo backend")

LIMIT_S = 60  # the bound for the survivors to exit
CONTROL_TIMEOUT_S = 5


def rank_work(rank: int, folder: str, victim: int, how: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64, progress=False, exact=True)
    step = engine.step

    def failing_step():
        outputs = step()
        if rank == victim and engine.num_steps == 3:
            Path(out_dir, "failed_at").write_text(str(time.time()))
            if how == "diverge":  # this rank reports a step the others did not take
                return outputs[:-1]
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        return outputs

    engine.step = failing_step
    distributed = DistributedEngine(engine, timeout_s=CONTROL_TIMEOUT_S)
    try:
        if rank == 0:
            distributed.generate([[5, 6, 7, 8], [9, 10, 11]], max_new_tokens=20)
        else:
            distributed.follow()
    except RankFailedError as error:
        Path(out_dir, f"survivor{rank}.txt").write_text(f"{time.time()}\n{error}")
        os._exit(3)  # the group is broken: leave without its teardown


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_fail") / "llama"
    tiny_model("llama", num_key_value_heads=4).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("victim", "how"), [(1, "kill"), (0, "kill"), (1, "stop")])
def test_the_surviving_rank_exits_with_a_clear_error_in_bounded_time(folder, tmp_path, victim, how):
    processes = start_ranks(rank_work, (folder, victim, how, str(tmp_path)), tmp_path, 2)
    survivor = 1 - victim
    deadline = time.monotonic() + 120 + LIMIT_S  # loading, then the bound
    try:
        while processes[survivor].is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        survivor_exit = processes[survivor].exitcode
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()  # the stopped victim, or anything left after a failure
            process.join(timeout=10)
    assert survivor_exit == 3, f"rank {survivor} exit code {survivor_exit}: {list(tmp_path.glob('*.err'))}"
    failed_at = float((tmp_path / "failed_at").read_text())
    ended_at, message = (tmp_path / f"survivor{survivor}.txt").read_text().split("\n", 1)
    assert float(ended_at) - failed_at < LIMIT_S
    if how == "stop":
        assert float(ended_at) - failed_at >= CONTROL_TIMEOUT_S - 1  # only the timeout could tell
    assert f"rank {survivor} of 2: the tensor-parallel group stopped" in message
    assert f"{CONTROL_TIMEOUT_S:g} s timeout" in message
    assert multiprocessing.active_children() == []


def test_ranks_that_diverge_stop_with_lockstep_error(folder, tmp_path):
    processes = start_ranks(rank_work, (folder, 1, "diverge", str(tmp_path)), tmp_path, 2)
    try:
        for process in processes:
            process.join(timeout=120)
        codes = [process.exitcode for process in processes]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    assert codes == [3, 3], list(tmp_path.glob("*.err"))
    for rank in (0, 1):
        message = (tmp_path / f"survivor{rank}.txt").read_text().split("\n", 1)[1]
        assert f"rank {rank} of 2: the tensor-parallel group stopped: step 3: rank 1 diverged from rank 0" in message
        assert "the ranks' engines diverged" in message
