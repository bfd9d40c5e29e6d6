"""`OutputRouter`: hands each step's outputs to the `generate`/`stream` call whose requests they are, whoever ran
the step, so that calls interleaved in one thread (two streams read in turn, a `generate` while a stream is paused)
each see all of their own outputs."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from .request import RequestOutput


class OutputRouter:
    """Routes step outputs to the calls collecting them; outputs nobody collects are returned by `route`, and other
    requests' final outputs that a collecting call's steps produced wait for the next `route`.

    Example:

    ```python
    >>> from hf_paged.engine.request import RequestOutput
    >>> def output(request_id, tokens, new, finished):
    ...     return RequestOutput(request_id, [1], tokens, None, new, None, finished)
    >>> router = OutputRouter()
    >>> steps = iter([[output("b", [5], [5], True), output("a", [7], [7], False)], [output("a", [7, 8], [8], True)]])
    >>> [output.new_token_ids for output in router.collect(lambda: router.route(next(steps)), {"a"})]
    [[7], [8]]
    >>> [output.request_id for output in router.route([])]  # "b" finished during the call: kept for the next step
    ['b']

    ```
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[RequestOutput] = []  # other callers' final outputs a collecting call's steps produced
        self._collectors: dict[str, deque] = {}  # request id -> the outputs its call has to take

    def route(self, outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
        """Give each of a step's `outputs` to the call collecting its request; returns the held outputs and those
        nobody collects (what `step()` reports)."""
        with self._lock:
            uncollected, self._held = self._held, []
            for output in outputs:
                collector = self._collectors.get(output.request_id)
                if collector is None:
                    uncollected.append(output)
                else:
                    collector.append(output)
        return uncollected

    def collect(self, step: Callable[[], list[RequestOutput]], pending: set[str]) -> Iterator[RequestOutput]:
        """The outputs of the requests `pending`, in order, until every one has finished (`pending` is left holding
        the unfinished ones). `step` (which routes through this router) runs only when none is waiting: another
        call may have stepped and left them here. Final outputs of requests no call collects are kept for the next
        `route`."""
        collected: deque[RequestOutput] = deque()
        ids = list(pending)
        with self._lock:
            for request_id in ids:
                self._collectors[request_id] = collected
        try:
            while pending:
                if not collected:
                    others = [output for output in step() if output.finished]
                    with self._lock:
                        self._held.extend(others)
                while collected:
                    output = collected.popleft()
                    if output.finished:
                        pending.discard(output.request_id)
                    yield output
        finally:
            with self._lock:
                for request_id in ids:
                    if self._collectors.get(request_id) is collected:
                        del self._collectors[request_id]
