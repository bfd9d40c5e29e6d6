"""`EngineLoop`: one thread steps the `Engine` while asyncio handlers add requests and await their outputs."""

from __future__ import annotations

import asyncio
import logging
import threading

from ..engine import Engine, RequestOutput

logger = logging.getLogger(__name__)


class EngineLoop:
    """Drives `engine.step()` on a background thread whenever requests are pending, and hands every output to the
    asyncio queue of the handler that submitted the request. Concurrent HTTP requests therefore share one batch.

    Example:

    ```python
    >>> import asyncio
    >>> from hf_paged import Engine
    >>> from hf_paged.reference_models import tiny_model
    >>> loop = EngineLoop(Engine(tiny_model("llama"), block_size=4, num_blocks=32))
    >>> async def ask():
    ...     queue = asyncio.Queue()
    ...     await asyncio.to_thread(loop.submit, asyncio.get_running_loop(), queue, [1, 2, 3], max_new_tokens=2)
    ...     while not (output := await queue.get()).finished:
    ...         pass
    ...     return output.token_ids
    >>> len(asyncio.run(ask()))
    2
    >>> loop.stop()

    ```
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.totals = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hf_paged-engine", daemon=True)
        self._thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, prompt, **options) -> str:
        """Add a request (see `Engine.add_request`, whose errors it raises) whose outputs go to `queue` on `loop`.
        Thread-safe; it may wait for a running step, so call it from a worker thread (`asyncio.to_thread`)."""
        with self._lock:
            request_id = self.engine.add_request(prompt, **options)
            self._subscribers[request_id] = (loop, queue)
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its blocks are freed at once."""
        with self._lock:
            self._subscribers.pop(request_id, None)
        self.engine.abort(request_id)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.close()

    def _run(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # the failed batch's requests are reported with the error on the next step
                logger.exception("hf_paged: an engine step failed")
                continue
            for output in outputs:
                self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished:
            self.totals["requests"] += 1
            self.totals["prompt_tokens"] += len(output.prompt_token_ids)
            self.totals["generation_tokens"] += len(output.token_ids)
        with self._lock:
            subscriber = self._subscribers.get(output.request_id)
            if output.finished:
                self._subscribers.pop(output.request_id, None)
        if subscriber is not None:
            loop, queue = subscriber
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:  # the handler's event loop is closed
                pass
