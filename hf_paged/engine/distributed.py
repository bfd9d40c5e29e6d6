"""`DistributedEngine`: one `Engine` per rank of a tensor-parallel model, kept in lockstep over torch.distributed.

Rank 0 owns the request queue. Before every step it broadcasts, over a CPU (gloo) process group, what the step
needs: the requests added since the previous step with fully resolved `SamplingParams` (a sampled request's seed is
drawn on rank 0, so every rank seeds its own generator identically), the aborts, and the command (`step`, `ping`,
`shutdown`). Every rank replays those calls on its own `Engine` in the same order and runs the same `step()`, so
the schedulers and allocators make the same decisions and every rank runs the same forward (the model's own
collectives join the ranks' shards inside it). After every step the ranks exchange a fingerprint (the tokens each
request got and the pool's allocator stats) and stop with `LockstepError` if any rank differs.

Failures are bounded: every collective has the process group's timeout, rank 0 pings the followers while it is
idle (`keepalive`), and a rank whose peer died or stopped answering raises `RankFailedError` naming its rank and the
timeout instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..pool import PoolStats
from .engine import Engine
from .params import SamplingParams
from .prompts import Prompt, as_prompt_list
from .request import RequestOutput
from .routing import OutputRouter
from .stats import EngineStats

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
EXIT_RANK_FAILED = 3  # the exit status of a process that `exit_on_failure` ends


class RankFailedError(RuntimeError):
    """A rank of the tensor-parallel group exited, was killed, failed its step or did not answer in time; the group
    cannot continue."""


class LockstepError(RankFailedError):
    """The ranks' engines diverged: a step gave different tokens or allocator stats on two ranks."""


@dataclasses.dataclass(frozen=True)
class RankState:
    """One rank's pool after a step (what `/metrics` shows per rank).

    Attributes:
        rank (`int`): the rank.
        pool (`PoolStats`): its pool's stats.
        kv_bytes_used (`int`): bytes of the blocks in use.
        kv_bytes_total (`int`): bytes of the whole pool.
    """

    rank: int
    pool: PoolStats
    kv_bytes_used: int
    kv_bytes_total: int

    @classmethod
    def of(cls, rank: int, engine: Engine) -> RankState:
        stats = engine.pool.stats()
        return cls(rank, stats, stats.kv_bytes_used or 0, stats.kv_bytes_total or 0)


@dataclasses.dataclass(frozen=True)
class _Message:
    """What rank 0 broadcasts before a step: the calls to replay (`("add", request_id, prompt_ids, params)`,
    `("abort", request_id)`, `("reset_stats",)`) and the command."""

    ops: tuple[tuple, ...]
    command: str  # "step", "ping" or "shutdown"


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group that torchrun's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`)
    describe, unless one exists: nccl on CUDA (each rank on `cuda:LOCAL_RANK`), gloo on CPU, with a timeout of
    `timeout_s` seconds (transformers' own default waits 2 hours for a dead rank). Call it before loading the model
    with `tp_plan="auto"`.

    Raises:
        RuntimeError: the variables are missing (the process was not started by torchrun or `hf-paged serve --tp`).
    """
    if dist.is_initialized():
        return
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"tensor parallelism needs a distributed launch: {', '.join(missing)} not set; start every rank with "
            "torchrun (or use `hf-paged serve --tp N`, which starts the ranks itself)"
        )
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


class DistributedEngine:
    """An `Engine` on every rank of a tensor-parallel model, driven from rank 0 with the `Engine`'s own methods.

    Every rank builds its `Engine` with the same options over its shard of the model (loaded with
    `tp_plan="auto"` after `init_distributed()`), then wraps it. On rank 0 the wrapper is used like an `Engine`
    (`add_request`, `abort`, `step`, `generate`, `stream`, `stats`, `close`); outputs are delivered on rank 0 only.
    Every other rank calls `follow()`, which replays rank 0's calls until rank 0 closes.

    Args:
        engine (`Engine`): this rank's engine.
        timeout_s (`float`): seconds a rank waits for the others in a control message before `RankFailedError`.
        heartbeat_s (`float`, *optional*): rank 0's `keepalive()` pings the followers when this long passed
            without a message (default: a quarter of `timeout_s`).
        verify (`bool`): compare every step's tokens and allocator stats across ranks (`LockstepError`).
        exit_on_failure (`bool`): on `RankFailedError`, log it and end the process at once (status
            `EXIT_RANK_FAILED`) instead of raising: what a server rank wants, whose broken group cannot recover.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the process group has more than one rank but the model is not split across them.

    Example (`torchrun --nproc-per-node 2 script.py ./model`):

    ```python
    import sys
    import hf_paged
    from transformers import AutoModelForCausalLM
    from hf_paged.engine.distributed import DistributedEngine, init_distributed

    init_distributed()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto").eval()
    engine = DistributedEngine(hf_paged.Engine(model, block_size=16, max_memory="1GiB"))
    if engine.rank == 0:
        print(engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=8))
        engine.close()  # releases the followers
    else:
        engine.follow()
    ```
    """

    def __init__(
        self,
        engine: Engine,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat_s: float | None = None,
        verify: bool = True,
        exit_on_failure: bool = False,
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedEngine needs torch.distributed initialized on every rank: start the ranks with torchrun "
                "(or `hf-paged serve --tp N`) and call hf_paged.engine.distributed.init_distributed() first"
            )
        self.engine = engine
        self.failed: RankFailedError | None = None
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        tp_world_size = engine.pool.tp_world_size
        if tp_world_size != self.world_size:
            raise ValueError(
                f"the model is split over tp_world_size={tp_world_size} rank(s) but the process group has "
                f"{self.world_size}; load it with tp_plan='auto' on every rank of the group"
            )
        self.timeout_s = timeout_s
        self.heartbeat_s = timeout_s / 4 if heartbeat_s is None else heartbeat_s
        self.verify = verify
        self.exit_on_failure = exit_on_failure
        self.rank_states: list[RankState] = [RankState.of(r, engine) for r in range(self.world_size)]
        self._group = self._collective("creating the control group", dist.new_group, backend="gloo",
                                       timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self._ops: list[tuple] = []
        self._ids = itertools.count()
        self._last_message = time.monotonic()
        self._steps = 0
        self._closed = False
        self._router = OutputRouter()  # rank 0: each generate/stream call's outputs go to it, whoever steps

    # ------------------------------------------------------------------ rank 0: the Engine's API
    def add_request(
        self,
        prompt: Prompt,
        generation_config=None,
        *,
        request_id: str | None = None,
        **options,
    ) -> str:
        """`Engine.add_request` on rank 0; the followers add the same request (same id, tokens and seed) before
        the next step."""
        self._check_driver("add_request")
        params = self._params(generation_config, options)
        prompt_ids = self._prompt_ids(prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request_id = self.engine.add_request(prompt_ids, params, request_id=request_id)
        self._ops.append(("add", request_id, prompt_ids, params))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """`Engine.abort` on rank 0; the followers abort it before the next step."""
        self._check_driver("abort")
        output = self.engine.abort(request_id)
        if output is not None:
            self._ops.append(("abort", request_id))
        return output

    def step(self) -> list[RequestOutput]:
        """Broadcast the pending calls, then run one step on every rank; this rank's (rank 0's) outputs, except
        those a `generate` or `stream` call is collecting (they go to that call, as with `Engine.step`)."""
        self._check_driver("step")
        self._send("step")
        return self._router.route(self._step())

    def keepalive(self) -> None:
        """Ping the followers if no message went to them for `heartbeat_s` seconds (call it while idle, at least
        every `heartbeat_s`, so they can tell an idle rank 0 from a dead one)."""
        if self.rank == 0 and not self._closed and time.monotonic() - self._last_message >= self.heartbeat_s:
            self._send("ping")
            self._exchange_states([])

    def reset_stats(self) -> None:
        self._check_driver("reset_stats")
        self.engine.reset_stats()
        self._ops.append(("reset_stats",))

    def close(self) -> None:
        """Abort every request on every rank and release the followers (their `follow()` returns). Idempotent."""
        if self._closed or self.rank != 0:
            self.engine.close()
            return
        try:
            if self.failed is None:
                self._send("shutdown")
        finally:
            self._closed = True
            self.engine.close()

    def generate(self, prompts, generation_config=None, **options) -> list[RequestOutput]:
        """`Engine.generate` over every rank: run every prompt to completion; outputs in input order."""
        prompts = self._prompt_list(prompts, generation_config, options)
        self.reset_stats()
        ids = [self.add_request(p, generation_config, **options) for p in prompts]
        results = {}
        for output in self._until_done(ids):
            if output.finished:
                results[output.request_id] = output
        self.engine.last_stats = self.stats()
        return [results[i] for i in ids]

    def stream(self, prompts, generation_config=None, **options) -> Iterator[RequestOutput]:
        """`Engine.stream` over every rank; closing the iterator early aborts the unfinished requests."""
        prompts = self._prompt_list(prompts, generation_config, options)
        ids = [self.add_request(p, generation_config, **options) for p in prompts]
        yield from self._until_done(ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def pool(self):
        return self.engine.pool

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    def __getattr__(self, name: str):  # read-only views of this rank's engine: tokenizer, vocab_size, scheduler...
        if name.startswith("_") or name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __enter__(self) -> DistributedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the followers
    def follow(self) -> None:
        """Replay rank 0's calls and steps until rank 0 closes (ranks other than 0).

        Raises:
            RankFailedError: rank 0 (or another rank) died, failed or did not answer within `timeout_s`.
            LockstepError: this rank's step differed from the others'.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives the engine; follow() is for the other ranks")
        logger.info("hf_paged: following rank 0 (rank %d of %d)", self.rank, self.world_size)
        while True:
            message = self._receive()
            self._replay(message.ops)
            if message.command == "shutdown":
                self._closed = True
                self.engine.close()
                logger.info("hf_paged: rank 0 closed the engine (rank %d leaves)", self.rank)
                return
            if message.command == "step":
                self._step()
            else:
                self._exchange_states([])

    # ------------------------------------------------------------------ internals
    def _check_driver(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what}() is called on rank 0 only; rank {self.rank} runs follow()")
        if self.failed is not None:
            raise self.failed
        if self._closed:
            raise RuntimeError("this DistributedEngine is closed")

    def _send(self, command: str) -> None:
        message = _Message(tuple(self._ops), command)
        self._ops.clear()
        self._collective(f"sending '{command}'", dist.broadcast_object_list, [message], src=0, group=self._group)
        self._last_message = time.monotonic()

    def _receive(self) -> _Message:
        box = [None]
        self._collective("waiting for rank 0", dist.broadcast_object_list, box, src=0, group=self._group)
        return box[0]

    def _replay(self, ops: Sequence[tuple]) -> None:
        for op in ops:
            if op[0] == "add":
                _, request_id, prompt_ids, params = op
                self.engine.add_request(prompt_ids, params, request_id=request_id)
            elif op[0] == "abort":
                self.engine.abort(op[1])
            else:
                self.engine.reset_stats()

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.engine.step()
        except Exception as error:
            raise self._fail(f"its step failed ({type(error).__name__}: {error})") from error
        self._steps += 1
        digest = [(o.request_id, tuple(o.new_token_ids), o.finish_reason) for o in outputs]
        self._exchange_states(digest)
        return outputs

    def _exchange_states(self, digest: list) -> None:
        """Every rank's pool state (and step digest): kept for metrics, compared when `verify`."""
        mine = (RankState.of(self.rank, self.engine), digest)
        gathered: list = [None] * self.world_size
        self._collective("exchanging step results", dist.all_gather_object, gathered, mine, group=self._group)
        self.rank_states = [state for state, _ in gathered]
        if not self.verify:
            return
        reference_state, reference_digest = gathered[0]
        for rank, (state, step_digest) in enumerate(gathered[1:], start=1):
            same_pool = dataclasses.replace(state.pool, tp_rank=0) == dataclasses.replace(
                reference_state.pool, tp_rank=0
            )
            if step_digest != reference_digest or not same_pool:
                raise self._fail(
                    f"step {self._steps}: rank {rank} diverged from rank 0 (tokens {step_digest[:4]} vs "
                    f"{reference_digest[:4]}, pool {state.pool} vs {reference_state.pool})",
                    LockstepError,
                )

    def _collective(self, what: str, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise self._fail(f"{what} failed: {cause}") from error

    def _fail(self, reason: str, kind: type[RankFailedError] = RankFailedError) -> RankFailedError:
        why = "the ranks' engines diverged" if kind is LockstepError else (
            f"a rank exited, was killed or did not answer within the {self.timeout_s:g} s timeout"
        )  # fmt: skip
        self.failed = kind(
            f"rank {self.rank} of {self.world_size}: the tensor-parallel group stopped: {reason} ({why})"
        )
        logger.error("hf_paged: %s", self.failed)
        if self.exit_on_failure:
            logging.shutdown()
            os._exit(EXIT_RANK_FAILED)
        return self.failed

    def _until_done(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            yield from self._router.collect(self.step, pending)
        finally:
            if self.failed is None and not self._closed:
                for request_id in pending:
                    with contextlib.suppress(KeyError):
                        self.abort(request_id)

    def _prompt_list(self, prompts, generation_config, options: dict) -> list:
        """The prompts of a `generate`/`stream` call, as `Engine.generate` takes them (a 2-D tensor without its pad
        tokens, a tokenizer's output...)."""
        return as_prompt_list(prompts, self.engine.masked_pad(generation_config, options))

    def _params(self, generation_config, options: dict) -> SamplingParams:
        if isinstance(generation_config, SamplingParams):
            fields = {f.name: getattr(generation_config, f.name) for f in dataclasses.fields(generation_config)}
            params = SamplingParams.from_generation_config(None, **{**fields, **options})
        else:
            config = generation_config if generation_config is not None else self.engine.model.generation_config
            params = SamplingParams.from_generation_config(config, **options)
        if params.response_format is not None:  # every rank would need the tokenizer and the same matcher states
            raise ValueError("response_format is not supported by the tensor-parallel engine yet; serve on one device")
        if params.do_sample and params.seed is None:  # drawn here, so that every rank seeds the same generator
            params = params.with_seed(int(torch.randint(0, 2**62, (1,))))
        return params

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: Engine(model, tokenizer)")
            return list(self.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            return prompt.reshape(-1).tolist()
        return list(prompt)


__all__ = ["DistributedEngine", "LockstepError", "RankFailedError", "RankState", "init_distributed"]
