"""`GracefulServer`: uvicorn's server with a bounded shutdown. The first SIGINT/SIGTERM stops admitting requests
and gives those in flight a grace period, after which they are aborted (streams get a final error event); while
they drain, the server keeps listening, so `/health` answers 503 (a load balancer sees the server leave) and a new
request gets 503 `server_shutdown`; once none is left it stops listening and exits. A second signal aborts them at
once, a third stops waiting for connections. Signals are not re-raised afterwards, so the process exits normally,
without a traceback."""

from __future__ import annotations

import logging
import signal

import uvicorn

from .loop import EngineLoop

logger = logging.getLogger("hf_paged.serve")


class GracefulServer(uvicorn.Server):
    """`uvicorn.Server` whose shutdown is bounded by `grace_s` seconds (see the module docstring).

    Args:
        config (`uvicorn.Config`): the server's config (its `timeout_graceful_shutdown` is a backstop).
        loop (`EngineLoop`): the engine loop whose requests are aborted after the grace period.
        grace_s (`float`): seconds in-flight requests may keep running after the first signal.
    """

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, grace_s: float):
        super().__init__(config)
        self.engine_loop = loop
        self.grace_s = grace_s
        self._aborting = False
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        name = signal.Signals(sig).name
        if not self._draining:
            logger.info("hf_paged: %s: shutting down; in-flight requests have %.1f s to finish", name, self.grace_s)
            self._draining = True  # `on_tick` stops the server once the engine loop has no request left
            self.engine_loop.begin_shutdown(self.grace_s)
        elif not self._aborting:
            logger.info("hf_paged: %s again: aborting every request now", name)
            self._aborting = True
            self.engine_loop.begin_shutdown(0.0)
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: once shutdown began and no request is left in flight (finished, or aborted at the end of
        the grace period), stop listening and let uvicorn close the connections."""
        if self._draining and not self.should_exit and self.engine_loop.idle:
            self.should_exit = True
        return await super().on_tick(counter)
