"""`Call`: the engine requests of one HTTP call (`n` choices), their outputs, and their abort when the client goes
away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from starlette.types import Receive

from ..engine import RequestOutput
from .loop import EngineLoop

_GONE = object()


class Call:
    """The `n` engine requests of one HTTP call. Outputs arrive in `outputs()` as `(choice index, output)`;
    `client_gone()` (from `watch_disconnect`) aborts every unfinished request at once and ends `outputs()`;
    `close()` aborts whatever is unfinished and is safe to call from any `finally` (it never awaits).

    Args:
        loop (`EngineLoop`): the engine's loop.
        n (`int`): number of choices (engine requests).
    """

    def __init__(self, loop: EngineLoop, n: int):
        self.loop = loop
        self.n = n
        self.request_ids: list[str] = []
        self.disconnected = False
        self._event_loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished: set[int] = set()

    async def start(self, prompt_ids: list[int], choices: Sequence[dict]) -> None:
        """Submit one request per choice (see `EngineLoop.submit` for what it raises)."""
        self.request_ids = await self.loop.submit(prompt_ids, choices, self._deliver)
        self._unfinished = set(range(len(self.request_ids)))

    def _deliver(self, index: int, output: RequestOutput) -> None:  # the engine thread
        self._event_loop.call_soon_threadsafe(self._queue.put_nowait, (index, output))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output until all choices finished; stops early when the client went away."""
        while self._unfinished and not self.disconnected:
            item = await self._queue.get()
            if item is _GONE:
                return
            index, output = item
            if output.finished:
                self._unfinished.discard(index)
            yield index, output

    def client_gone(self) -> None:
        """The client disconnected: abort every unfinished request now and end `outputs()`."""
        self.disconnected = True
        self.close()
        self._queue.put_nowait(_GONE)

    def close(self) -> None:
        """Abort the requests not finished yet (idempotent, never awaits)."""
        if self._unfinished:
            self.loop.abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()


async def watch_disconnect(receive: Receive, call: Call) -> None:
    """Wait for the client's `http.disconnect` (the request body was already read), then `call.client_gone()`."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            call.client_gone()
            return
