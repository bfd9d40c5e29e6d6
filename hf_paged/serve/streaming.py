"""`EventStream`: a server-sent-event response bound to a `Call`, whose requests are aborted the moment the client
disconnects (or the stream ends any other way before they finish)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .calls import Call, watch_disconnect


class EventStream(Response):
    """ASGI response streaming `events` (`data: ...` strings) while watching for the client's disconnect, which
    aborts `call`'s requests at once (`Call.client_gone`) and ends `events`. Whatever ends the stream — the last
    event, a disconnect, a failed send, a cancellation — `call.close()` runs, which never awaits.

    Args:
        events (`AsyncIterator[str]`): the events, usually produced from `call.outputs()`.
        call (`Call`): the requests the events come from.
    """

    def __init__(self, events: AsyncIterator[str], call: Call):
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events = events
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(watch_disconnect(receive, self.call))
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone (ASGI 2.4 servers raise on send)
            self.call.client_gone()
        finally:
            watcher.cancel()
            self.call.close()
