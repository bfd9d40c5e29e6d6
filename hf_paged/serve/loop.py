"""`EngineLoop`: the one thread that touches the `Engine`. Asyncio handlers hand it requests and aborts through a
queue and receive outputs through callbacks; `/metrics` reads the snapshot it publishes between steps. Nothing on the
event loop ever waits for a forward."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from ..engine import Engine, RequestOutput
from .metrics import MetricsSnapshot

logger = logging.getLogger(__name__)

Deliver = Callable[[int, RequestOutput], None]  # (choice index, output), called on the engine thread


class ShuttingDown(Exception):
    """The server is shutting down and admits no new request."""


class EngineLoop:
    """Steps `engine` on a background thread whenever requests are pending. `submit` and `abort` only enqueue: the
        thread adds and aborts requests between two steps (an abort therefore takes effect within one step, and frees
        the request's blocks at once), then runs the next step and hands every output to its request's `deliver`
        callback. It publishes a `MetricsSnapshot` (`snapshot`) after a step that admitted or finished requests, at
        least every `snapshot_interval_s` seconds while it steps, and whenever it becomes idle. `engine` may be a
    `DistributedEngine` (rank 0 of `hf-paged serve --tp`), whose `keepalive()` it calls while idle.

        Shutdown: `begin_shutdown(grace_s)` refuses new requests (`submit` raises `ShuttingDown`) and lets running
        ones continue for `grace_s` seconds; then every request left is aborted (its output finishes with
        `finish_reason="abort"` and `shutdown_aborted` is set). `stop()` ends the thread and frees every block.

        Example:

        ```python
        >>> import asyncio
        >>> from hf_paged import Engine
        >>> from hf_paged.reference_models import tiny_model
        >>> loop = EngineLoop(Engine(tiny_model("llama"), block_size=4, num_blocks=32, exact=True))
        >>> async def ask():
        ...     done = asyncio.get_running_loop().create_future()
        ...     def deliver(index, output):
        ...         if output.finished:
        ...             done.get_loop().call_soon_threadsafe(done.set_result, output)
        ...     await loop.submit([1, 2, 3], [{"max_new_tokens": 2}], deliver)
        ...     return (await done).token_ids
        >>> len(asyncio.run(ask()))
        2
        >>> loop.stop()

        ```
    """

    def __init__(self, engine: Engine, *, snapshot_interval_s: float = 0.25, model_name: str = "base"):
        self.engine = engine
        self.model_name = model_name  # the base model's name in the per-model counters
        self.totals = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.model_totals: dict[str, dict[str, int]] = {}  # the same per model: the base's name or an adapter's
        self.snapshot_interval_s = snapshot_interval_s
        self.snapshot = MetricsSnapshot.take(engine, self.totals, time.monotonic(), self.model_totals)
        self.shutdown_aborted = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: dict[str, tuple[Deliver, int]] = {}
        self._wake = threading.Event()
        self._accepting = True
        self._deadline: float | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hf_paged-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from the event loop
    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def idle(self) -> bool:
        """Whether no request is in flight: none queued to add, none whose final output is still to deliver."""
        return self._inbox.empty() and not self._subscribers

    async def submit(self, prompt_ids: list[int], choices: Sequence[dict], deliver: Deliver) -> list[str]:
        """Add one engine request per entry of `choices` (options for `Engine.add_request`), all or none, and return
        their ids; outputs go to `deliver(choice index, output)` on the engine thread. Raises what `add_request`
        raises (`ValueError`, `TypeError`), or `ShuttingDown`. Waits at most for the running step, off the event
        loop; if the caller is cancelled meanwhile, the requests are aborted as soon as they exist."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("add", (prompt_ids, list(choices), deliver, future)))
        self._wake.set()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._abort_added)
            raise

    async def call(self, function: Callable[[Engine], object]):
        """Run `function(engine)` on the engine thread between two steps (loading or unloading an adapter) and return
        its result, or raise what it raised. Waits at most for the running step, off the event loop."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (function, future)))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (their client went away). Never blocks and never awaits, so it is safe in a `finally`
        of a cancelled task; the engine thread aborts them before its next step."""
        if request_ids:
            self._inbox.put(("abort", list(request_ids)))
            self._wake.set()

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; abort those still running `grace_s` seconds from now."""
        self._accepting = False
        deadline = time.monotonic() + max(grace_s, 0.0)
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
        self._wake.set()

    def stop(self, timeout_s: float = 60) -> None:
        """Stop the thread after its current step, abort what is left and free every block."""
        self._accepting = False
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.error("hf_paged: the engine thread did not stop within %.0f s", timeout_s)
            return
        self.engine.close()
        self._publish(force=True)

    # ------------------------------------------------------------------ the engine thread
    def _abort_added(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.abort(future.result())

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._iterate()
            except Exception:  # noqa: BLE001 - the thread must outlive any bug, or every handler would hang
                logger.exception("hf_paged: the engine loop failed; it keeps running")
                time.sleep(0.1)

    def _iterate(self) -> None:
        """Take queued adds and aborts, then run one step (or wait for work)."""
        self._drain_inbox()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._abort_everything()
        if not self.engine.has_unfinished_requests():
            keepalive = getattr(self.engine, "keepalive", None)  # a DistributedEngine tells its followers it lives
            if keepalive is not None:
                keepalive()
            self._publish(force=True)
            timeout = 0.5 if self._deadline is None else max(0.0, min(0.5, self._deadline - time.monotonic()))
            self._wake.wait(timeout=timeout)
            self._wake.clear()
            return
        try:
            outputs = self.engine.step()
        except Exception:  # the failed batch's requests are reported with the error on the next step
            logger.exception("hf_paged: an engine step failed")
            return
        for output in outputs:
            self._deliver(output)
        self._publish()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*item)
            elif kind == "call":
                self._call(*item)
            else:
                for request_id in item:
                    with contextlib.suppress(KeyError):  # finished and reported while the abort waited
                        self.engine.abort(request_id)

    def _add(self, prompt_ids, choices, deliver: Deliver, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        added: list[str] = []
        try:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down and accepts no new requests")
            for index, options in enumerate(choices):
                request_id = self.engine.add_request(prompt_ids, **options)
                added.append(request_id)
                self._subscribers[request_id] = (deliver, index)
        except Exception as error:  # noqa: BLE001 - handed to the submitter
            for request_id in added:
                self._subscribers.pop(request_id, None)
                self.engine.abort(request_id)
            future.set_exception(error)
            return
        future.set_result(added)

    def _call(self, function, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = function(self.engine)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            future.set_exception(error)
            return
        future.set_result(result)
        self._publish(force=True)

    def _abort_everything(self) -> None:
        self._deadline = None
        pending = list(self._subscribers)
        if pending:
            logger.warning("hf_paged: shutdown grace period over: aborting %d request(s)", len(pending))
            self.shutdown_aborted = True
        for request_id in pending:
            with contextlib.suppress(KeyError):
                self.engine.abort(request_id)

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished:
            self.totals["requests"] += 1
            self.totals["prompt_tokens"] += len(output.prompt_token_ids)
            self.totals["generation_tokens"] += len(output.token_ids)
            name = self.model_name if output.adapter is None else output.adapter
            counts = self.model_totals.setdefault(name, {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0})
            counts["requests"] += 1
            counts["prompt_tokens"] += len(output.prompt_token_ids)
            counts["generation_tokens"] += len(output.token_ids)
            subscriber = self._subscribers.pop(output.request_id, None)
        else:
            subscriber = self._subscribers.get(output.request_id)
        if subscriber is not None:
            deliver, index = subscriber
            try:
                deliver(index, output)
            except Exception:  # noqa: BLE001 - a vanished handler must not stop the engine
                logger.debug("hf_paged: dropped an output of %s", output.request_id, exc_info=True)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        values = self.snapshot.values
        changed = (
            values["hf_paged_requests_running"] != self.engine.num_running
            or values["hf_paged_requests_waiting"] != self.engine.num_waiting
        )
        if force or changed or now - self.snapshot.taken_at >= self.snapshot_interval_s:
            self.snapshot = MetricsSnapshot.take(self.engine, self.totals, now, self.model_totals)
