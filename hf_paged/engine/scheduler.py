"""`Scheduler`: which requests run the next forward — admission, decode, preemption. Pure Python over the
allocator; it never touches tensors."""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

from ..allocator import BlockAllocator
from ..prefix import group_roots
from ..rows import Row
from .request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One forward: `requests` each storing `new_tokens[i]` tokens. A prefill step admits waiting requests (their
    prompt, or prompt plus output after a preemption), or computes the next chunk of a prompt longer than the
    prefill budget; a decode step feeds every decoding request its last token. `admitted` are the requests this
    step admits."""

    kind: str
    requests: list[Request]
    new_tokens: list[int]
    admitted: tuple[Request, ...] = ()


class Scheduler:
    """First come, first served continuous batching over one block pool.

    Each `schedule()` admits waiting requests in arrival order while the pool holds their uncached prompt blocks
    on top of what the running requests need for their next token (and the padded prefill stays within
    `max_prefill_tokens`); admitted requests are prefilled in one forward. A prompt longer than `max_prefill_tokens`
    is admitted alone and prefilled in chunks of that many tokens, one chunk per step, with decode steps of the
    other running requests in between (no other request is admitted until its last chunk). Otherwise every running
    request decodes one token; when the pool cannot hold that, the most recently admitted request is preempted: its
    blocks go back (full ones stay in the prefix cache) and it waits at the head of the queue to be recomputed.

    Args:
        allocator (`BlockAllocator`): the pool's allocator.
        root (`bytes`, *optional*): prefix-cache namespace root; `None` turns prefix reuse off.
        max_batch_size (`int`): most requests running at once.
        max_prefill_tokens (`int`): most padded positions (rows x width) in one prefill forward; a longer prompt
            is admitted alone and prefilled in chunks of this many tokens.
        windows (`list[int | None]`, *optional*): the release window of every layer group of the cache the rows
            serve (`PagedCache.release_windows`; default one full-attention group): a row holds a table per group,
            and the blocks the cache gives back behind sliding windows before a decode step count as free for it.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> from hf_paged.engine.params import SamplingParams
    >>> from hf_paged.engine.request import Request
    >>> scheduler = Scheduler(BlockAllocator(num_blocks=4, block_size=4), root=None)
    >>> scheduler.add(Request("a", [1, 2, 3, 4, 5], SamplingParams()))
    >>> step, failed = scheduler.schedule()
    >>> step.kind, step.new_tokens, step.requests[0].row.table.block_ids
    ('prefill', [5], [])

    ```
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        root: bytes | None,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 4096,
        windows: list[int | None] | None = None,
    ):
        self.allocator = allocator
        self.root = root
        self.windows = list(windows) if windows else [None]
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._last_kind: str | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End `request` (finished, aborted or failed) and return its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._drop_row(request)
        request.finish(reason, error)

    def schedule(self) -> tuple[Step | None, list[Request]]:
        """The next forward (or `None` when idle), and the requests that failed because they can never fit."""
        failed: list[Request] = []
        step = self._next_step(failed)
        self._last_kind = None if step is None else step.kind
        return step, failed

    def _next_step(self, failed: list[Request]) -> Step | None:
        partial = next((r for r in self.running if self.pending_tokens(r) > 1), None)
        if partial is not None:
            others_decode = len(self.running) > 1 and self._last_kind == "prefill"
            if not others_decode and self._room_for_chunk(partial, failed):
                return Step("prefill", [partial], [self._chunk(partial)])
        else:
            admitted = self._admit(failed)
            if admitted:
                return Step("prefill", admitted, [self._chunk(r) for r in admitted], tuple(admitted))
        self._make_room_for_decode(failed)
        decoding = self._decoding()
        if decoding:
            return Step("decode", decoding, [1] * len(decoding))
        partial = next(iter(self.running), None)  # a chunked prefill alone: its next chunk
        if partial is not None and self._room_for_chunk(partial, failed):
            return Step("prefill", [partial], [self._chunk(partial)])
        return None

    @staticmethod
    def pending_tokens(request: Request) -> int:
        """Tokens of `request` not yet in its blocks: 1 when it decodes (its last token), more while its prompt is
        being prefilled."""
        return request.num_tokens - request.row.num_tokens

    def _chunk(self, request: Request) -> int:
        return min(self.pending_tokens(request), self.max_prefill_tokens)

    def _decoding(self) -> list[Request]:
        return [r for r in self.running if self.pending_tokens(r) == 1]

    def never_fits(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` tokens can never run in this pool (`blocks_to_run` exceeds the whole
        pool), or `None`."""
        allocator = self.allocator
        blocks = self.blocks_to_run(num_tokens)
        if blocks <= allocator.num_blocks:
            return None
        groups = "" if len(self.windows) == 1 else f" over its {len(self.windows)} layer groups"
        return (
            f"the request needs {blocks} blocks of {allocator.block_size} tokens{groups} for its {num_tokens} tokens "
            f"and the next one, but the whole pool has {allocator.num_blocks} blocks"
        )

    def blocks_to_run(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once on its way to its next token: every
        block in a full-attention group; in a sliding group, at most its window and one prefill chunk (blocks
        behind the window go back before each forward)."""
        size = self.allocator.block_size
        total = 0
        for window in self.windows:
            blocks = -(-(num_tokens + 1) // size)
            if window is not None:
                blocks = min(blocks, -(-(window - 1 + self.max_prefill_tokens) // size) + 1)
            total += blocks
        return total

    def _prefill_appends(self, row: Row, new_tokens: int, chunk: int) -> list:
        """What admitting `row` with `new_tokens` to prefill must find room for: the whole prompt in full-attention
        groups, its first `chunk` in sliding groups (which give back blocks behind their window between chunks)."""
        return [(table, new_tokens if w is None else chunk) for table, w in zip(row.tables, self.windows)]

    # ------------------------------------------------------------------ admission
    def _admit(self, failed: list[Request]) -> list[Request]:
        allocator = self.allocator
        reserve = allocator.num_blocks_needed_for(self._decode_appends())
        admitted: list[Request] = []
        width = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            request = self.waiting[0]
            tokens = request.token_ids
            error = self.never_fits(len(tokens))
            if error is not None:  # a preempted request that grew too big ends with what it has
                self.waiting.popleft()
                request.finish(_outgrown_reason(request), error)
                failed.append(request)
                continue
            row = self._new_row(tokens)
            new = len(tokens) - row.num_tokens
            chunk = min(new, self.max_prefill_tokens)
            needed = allocator.num_blocks_needed_for(self._prefill_appends(row, new, chunk))
            over_budget = admitted and (len(admitted) + 1) * max(width, chunk) > self.max_prefill_tokens
            if over_budget or needed + reserve > allocator.num_free:
                row.free(allocator)
                if not admitted and not self.running:  # no request of this engine will free a block for it
                    self.waiting.popleft()
                    request.finish("error", self._held_elsewhere(needed))
                    failed.append(request)
                    continue
                break
            self.waiting.popleft()
            reserve += needed
            width = max(width, chunk)
            request.row = row
            request.prefix_tokens_reused += row.num_tokens
            request.status = RequestStatus.RUNNING
            admitted.append(request)
        self.running.extend(admitted)
        return admitted

    def _held_elsewhere(self, needed: int) -> str:
        allocator = self.allocator
        return (
            f"the request needs {needed} free blocks but only {allocator.num_free} of the pool's "
            f"{allocator.num_blocks} are free and this engine holds none: the others are held by caches outside it "
            "(release them, e.g. PagedCache.release(), or give the pool more blocks)"
        )

    def _new_row(self, tokens: list[int]) -> Row:
        if self.root is None:
            return Row.empty(self.allocator, len(self.windows), track_tokens=False)
        roots = group_roots(self.root, len(self.windows))
        return Row.from_prefix_cache(self.allocator, roots, self.windows, tokens)

    def _decode_appends(self) -> list:
        return [append for request in self._decoding() for append in request.row.appends(1)]

    # ------------------------------------------------------------------ chunks, decode and preemption
    def _room_for_chunk(self, request: Request, failed: list[Request]) -> bool:
        """Whether the pool holds the next chunk of `request`; if not, `request` is preempted (or, alone, fails)."""
        allocator = self.allocator
        needed = allocator.num_blocks_needed_for(request.row.appends(self._chunk(request)))
        if needed <= allocator.num_free + self._num_freed_by_release([request]):
            return True
        if len(self.running) == 1:
            self._fail_alone(request, f"its next prompt chunk needs {needed} more", failed)
        else:
            self._preempt(request)
        return False

    def _make_room_for_decode(self, failed: list[Request]) -> None:
        allocator = self.allocator
        while self.running:
            needed = allocator.num_blocks_needed_for(self._decode_appends())
            if needed <= allocator.num_free + self._num_freed_by_release(self._decoding()):
                return
            victim = self.running[-1]
            if len(self.running) == 1:
                self._fail_alone(victim, f"needs {needed} more", failed)
                return
            self._preempt(victim)

    def _fail_alone(self, request: Request, need: str, failed: list[Request]) -> None:
        """End the only running request, which the whole pool cannot hold (`need`: what it needs more): with
        `"length"` and the tokens it has when it generated some, `"error"` when its prompt does not fit."""
        held = len(request.row.live_block_ids)
        message = (
            f"the request holds {held} blocks and {need}, but the pool has {self.allocator.num_blocks} blocks in all"
        )
        self.finish(request, _outgrown_reason(request), message)
        failed.append(request)

    def _num_freed_by_release(self, requests: list[Request]) -> int:
        """Blocks that become free when the cache gives back the rows' blocks behind their sliding windows at the
        start of the forward of `requests` (a block shared by several rows only when all of them give it back)."""
        if all(window is None for window in self.windows):
            return 0
        behind = Counter(
            block_id
            for request in requests
            for block_id in request.row.blocks_behind(self.windows, self.allocator.block_size)
        )
        return sum(1 for block_id, count in behind.items() if self.allocator.ref_count(block_id) == count)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._drop_row(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("hf_paged: preempted request %s (%d tokens)", request.request_id, request.num_tokens)

    def _drop_row(self, request: Request) -> None:
        if request.row is not None:
            request.row.free(self.allocator)
            request.row = None


def _outgrown_reason(request: Request) -> str:
    """The finish reason of a request the whole pool cannot hold: `"length"` once it has generated tokens (it
    ends with them, as at the model's context), `"error"` while it has none (its prompt does not fit)."""
    return "length" if request.output_token_ids else "error"
