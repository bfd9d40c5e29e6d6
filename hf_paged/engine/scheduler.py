"""`Scheduler`: which requests run the next forward — admission, decode, preemption — decided and allocated in one
call through the `ForwardPlanner` (what it decides is what runs)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from ..batch import ForwardBatch
from ..errors import PoolExhaustedError
from ..planner import ForwardPlanner
from ..rows import Row
from .request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One forward: `requests` each storing `new_tokens[i]` tokens. A prefill step admits waiting requests (their
    prompt, or prompt plus output after a preemption), or computes the next chunk of a prompt longer than the
    prefill budget; a decode step feeds every decoding request its last token. `admitted` are the requests this
    step admits; `batch` is the planned forward (its blocks already taken)."""

    kind: str
    requests: list[Request]
    new_tokens: list[int]
    admitted: tuple[Request, ...] = ()
    batch: ForwardBatch | None = None


class Scheduler:
    """First come, first served continuous batching over one block pool.

    Each `schedule()` first gives back the blocks the running requests' sliding windows skipped, then admits
    waiting requests in arrival order while the pool holds their uncached prompt blocks on top of what the running
    requests need for their next token (and the padded prefill stays within `max_prefill_tokens`); admitted
    requests are prefilled in one forward. A prompt longer than `max_prefill_tokens` is admitted alone and
    prefilled in chunks of that many tokens, one chunk per step, with decode steps of the other running requests in
    between (no other request is admitted until its last chunk). Otherwise every running request decodes one
    token; when the pool cannot hold that, the most recently admitted request is preempted: its blocks go back
    (full ones stay in the prefix cache) and it waits at the head of the queue to be recomputed. Every decision
    takes its blocks through the planner as it is made (all or nothing), and the step carries the planned
    `ForwardBatch`.

    Args:
        planner (`ForwardPlanner`): plans the forwards (its pool, layout and prefix root).
        max_batch_size (`int`): most requests running at once.
        max_prefill_tokens (`int`): most padded positions (rows x width) in one prefill forward; a longer prompt
            is admitted alone and prefilled in chunks of this many tokens.
        max_num_batched_tokens (`int`): most tokens in one packed step while requests decode: one per decoding
            request plus prompt tokens (a chunk, or admitted prompts), so a long prompt does not stall the decoding
            requests for more than one such step. A step with no decoding request takes up to `max_prefill_tokens`
            prompt tokens. Padded steps (stock attention) do not use it.
        device (`torch.device | str`): where the batches' index tensors go (the model's input device).

    Attributes:
        packed (`bool`): plan packed forwards (no pad position, `ForwardPlanner.plan_packed`) and **mixed steps**:
            every decoding request's next token and prompt tokens up to `max_num_batched_tokens` tokens in all (up
            to `max_prefill_tokens` prompt tokens when no request decodes) in one forward. The
            Engine sets it when its attention reads the block tables (`"hf_paged"`); otherwise steps are either
            prefill or decode, right-aligned.

    Example:

    ```python
    >>> from hf_paged.engine.params import SamplingParams
    >>> from hf_paged.engine.request import Request
    >>> from hf_paged.groups import KVLayout
    >>> from hf_paged.planner import ForwardPlanner
    >>> from hf_paged.pool import BlockPool
    >>> pool = BlockPool(num_blocks=4, block_size=4)
    >>> scheduler = Scheduler(ForwardPlanner(pool, KVLayout.for_windows([None]), root=None))
    >>> scheduler.add(Request("a", [1, 2, 3, 4, 5], SamplingParams()))
    >>> step, failed = scheduler.schedule()
    >>> step.kind, step.new_tokens, step.requests[0].row.table.block_ids
    ('prefill', [5], [0, 1])

    ```
    """

    def __init__(
        self,
        planner: ForwardPlanner,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 4096,
        device="cpu",
        max_num_batched_tokens: int = 512,
    ):
        self.planner = planner
        self.pool = planner.pool
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.packed = False  # plan packed, mixed steps (set by the Engine when its attention reads the tables)
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
        """The next forward (or `None` when idle), its blocks taken, and the requests that failed because they can
        never fit."""
        failed: list[Request] = []
        self.planner.prepare([request.row for request in self.running])
        step = self._next_step(failed)
        self._last_kind = None if step is None else step.kind
        return step, failed

    def _next_step(self, failed: list[Request]) -> Step | None:
        if self.packed:
            return self._mixed_step(failed)
        partial = next((r for r in self.running if self.pending_tokens(r) > 1), None)
        if partial is not None:
            others_decode = len(self.running) > 1 and self._last_kind == "prefill"
            if not others_decode and (step := self._chunk_step(partial, failed)) is not None:
                return step
        else:
            admitted, chunks = self._admit(failed, self.max_prefill_tokens)
            if admitted:
                return Step("prefill", admitted, chunks, tuple(admitted), self._plan(admitted, chunks, taken=True))
        step = self._decode_step(failed)
        if step is not None:
            return step
        partial = next(iter(self.running), None)  # a chunked prefill alone: its next chunk
        return None if partial is None else self._chunk_step(partial, failed)

    @staticmethod
    def pending_tokens(request: Request) -> int:
        """Tokens of `request` not yet in its blocks: 1 when it decodes (its last token), more while its prompt is
        being prefilled."""
        return request.num_tokens - request.row.num_tokens

    def _chunk(self, request: Request, budget: int | None = None) -> int:
        return min(self.pending_tokens(request), self.max_prefill_tokens if budget is None else budget)

    def _decoding(self) -> list[Request]:
        return [r for r in self.running if self.pending_tokens(r) == 1]

    def never_fits(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` tokens can never run in this pool, or `None` (see
        `ForwardPlanner.never_fits`)."""
        return self.planner.never_fits(num_tokens, self.max_prefill_tokens)

    def _plan(self, requests: list[Request], counts: list[int], taken: bool = False) -> ForwardBatch:
        """The forward of `requests` storing `counts[i]` tokens each (their blocks taken first unless `taken`):
        packed when `packed` and the step holds prompt tokens, else right-aligned."""
        token_ids = None
        if self.planner.prefix_caching:
            starts = [r.row.num_tokens - (count if taken else 0) for r, count in zip(requests, counts)]
            token_ids = [r.token_ids[start : start + n] for r, start, n in zip(requests, starts, counts)]
        rows = [r.row for r in requests]
        # a decode-only step has no pad position either way (one token per row): it stays right-aligned, which
        # extends the last decode step's slot maps instead of addressing every row again
        plan = self.planner.plan_packed if self.packed and max(counts) > 1 else self.planner.plan_step
        return plan(rows, counts, token_ids, taken=taken, device=self.device)

    # ------------------------------------------------------------------ mixed steps (packed forwards)
    def _mixed_step(self, failed: list[Request]) -> Step | None:
        """One packed forward: a token for every decoding request (the most recently admitted ones preempted while
        the pool cannot hold them), then prompt tokens within the step's budget (`prompt_budget`): the next chunk
        of a prompt being prefilled, or the first chunks of newly admitted requests."""
        decoding = self._take_decodes(failed)
        requests, counts = list(decoding), [1] * len(decoding)
        admitted: list[Request] = []
        budget = self.prompt_budget(len(decoding))
        partial = next((r for r in self.running if r not in decoding and self.pending_tokens(r) > 1), None)
        if budget == 0:
            pass  # the decoding requests fill the step
        elif partial is not None:
            chunk = self._chunk(partial, budget)
            try:
                self.planner.take([partial.row], [chunk], what=f"a prompt chunk of {chunk} token(s)")
                requests.append(partial)
                counts.append(chunk)
            except PoolExhaustedError as exhausted:
                if len(self.running) == 1:
                    self._fail_alone(partial, f"its next prompt chunk needs {exhausted.num_needed} more", failed)
                else:
                    self._preempt(partial)
        else:
            admitted, chunks = self._admit(failed, budget)
            requests += admitted
            counts += chunks
        if not requests:
            return None
        prefills = len(requests) - len(decoding)
        kind = "decode" if not prefills else "prefill" if not decoding else "mixed"
        return Step(kind, requests, counts, tuple(admitted), self._plan(requests, counts, taken=True))

    def prompt_budget(self, num_decoding: int) -> int:
        """Prompt tokens a packed step may carry next to `num_decoding` decoding requests' tokens:
        `max_prefill_tokens` when none decodes, else what `max_num_batched_tokens` leaves (at most
        `max_prefill_tokens`)."""
        if not num_decoding:
            return self.max_prefill_tokens
        return max(0, min(self.max_prefill_tokens, self.max_num_batched_tokens - num_decoding))

    def _take_decodes(self, failed: list[Request]) -> list[Request]:
        """Take one token's blocks for every decoding request; while the pool cannot hold them all, the most
        recently admitted request is preempted (alone, it fails). Returns the requests that got their blocks."""
        while self.running:
            decoding = self._decoding()
            if not decoding:
                return []
            try:
                self.planner.take([r.row for r in decoding], [1] * len(decoding), what="a decode step")
                return decoding
            except PoolExhaustedError as exhausted:
                victim = self.running[-1]
                if len(self.running) == 1:
                    self._fail_alone(victim, f"needs {exhausted.num_needed} more", failed)
                    return []
                self._preempt(victim)
        return []

    # ------------------------------------------------------------------ admission
    def _admit(self, failed: list[Request], budget: int) -> tuple[list[Request], list[int]]:
        """Admit waiting requests, taking the blocks of their first prefill chunk, within `budget` prompt tokens
        (packed) or padded positions; returns them and those chunks."""
        planner = self.planner
        decoding = [r for r in self.running if self.pending_tokens(r) <= 1]  # a packed step took theirs already
        reserve = planner.blocks_needed([r.row for r in decoding], [1] * len(decoding))
        admitted: list[Request] = []
        chunks: list[int] = []
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
            row = self._new_row(tokens, request.prefix_namespace)
            new = len(tokens) - row.num_tokens
            chunk = min(new, budget)
            over_budget = (
                width + chunk > budget  # packed: real prompt tokens
                if self.packed
                else (len(admitted) + 1) * max(width, chunk) > budget  # padded positions
            )
            if admitted and over_budget:
                self.pool.free_rows([row])
                break
            reused = row.num_tokens
            try:
                planner.admit(row, new, chunk, keep_free=reserve)
            except PoolExhaustedError as exhausted:
                self.pool.free_rows([row])
                if not admitted and not self.running:  # no request of this engine will free a block for it
                    self.waiting.popleft()
                    request.finish("error", self._held_elsewhere(exhausted, reused // self.pool.block_size))
                    failed.append(request)
                    continue
                break
            self.waiting.popleft()
            self.pool.count_prefix_reuse(reused)
            width = width + chunk if self.packed else max(width, chunk)
            request.row = row
            request.prefix_tokens_reused += reused
            request.status = RequestStatus.RUNNING
            admitted.append(request)
            chunks.append(chunk)
        self.running.extend(admitted)
        return admitted, chunks

    def _held_elsewhere(self, exhausted: PoolExhaustedError, cached_blocks: int) -> str:
        """Both numbers as they were when admission failed: the blocks its cached prefix took were not free then."""
        besides = f" besides the {cached_blocks} of its cached prefix" if cached_blocks else ""
        return (
            f"the request needs {exhausted.num_needed} free blocks{besides} but only {exhausted.num_free} of the "
            f"pool's {self.pool.num_blocks} are free and this engine holds none: the others are held by caches outside "
            "it (release them, e.g. PagedCache.release(), or give the pool more blocks)"
        )

    def _new_row(self, tokens: list[int], namespace: bytes | None = None) -> Row:
        """A row for `tokens`, holding their longest cached prefix computed under `namespace` (a LoRA adapter's, see
        `ForwardPlanner.roots_for`)."""
        planner = self.planner
        if not planner.prefix_caching:
            return self.pool.new_rows(1, planner.layout.num_groups, track_tokens=False)[0]
        roots = planner.roots_for(namespace)
        return self.pool.cached_prefix_row(roots, planner.layout.windows, tokens, count_reuse=False)

    # ------------------------------------------------------------------ chunks, decode and preemption
    def _chunk_step(self, request: Request, failed: list[Request]) -> Step | None:
        """The next prompt chunk of `request`, its blocks taken; `None` when the pool cannot hold it: `request` is
        then preempted (or, alone, fails)."""
        chunk = self._chunk(request)
        try:
            return Step("prefill", [request], [chunk], batch=self._plan([request], [chunk]))
        except PoolExhaustedError as exhausted:
            if len(self.running) == 1:
                self._fail_alone(request, f"its next prompt chunk needs {exhausted.num_needed} more", failed)
            else:
                self._preempt(request)
            return None

    def _decode_step(self, failed: list[Request]) -> Step | None:
        """One token for every decoding request, its blocks taken; the most recently admitted request is preempted
        while the pool cannot hold them (alone, it fails). `None` when no request decodes."""
        while self.running:
            decoding = self._decoding()
            if not decoding:
                return None
            try:
                return Step("decode", decoding, [1] * len(decoding), batch=self._plan(decoding, [1] * len(decoding)))
            except PoolExhaustedError as exhausted:
                victim = self.running[-1]
                if len(self.running) == 1:
                    self._fail_alone(victim, f"needs {exhausted.num_needed} more", failed)
                    return None
                self._preempt(victim)
        return None

    def _fail_alone(self, request: Request, need: str, failed: list[Request]) -> None:
        """End the only running request, which the whole pool cannot hold (`need`: what it needs more): with
        `"length"` and the tokens it has when it generated some, `"error"` when its prompt does not fit."""
        held = len(request.row.live_block_ids)
        message = f"the request holds {held} blocks and {need}, but the pool has {self.pool.num_blocks} blocks in all"
        self.finish(request, _outgrown_reason(request), message)
        failed.append(request)

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
            self.pool.free_rows([request.row])
            request.row = None


def _outgrown_reason(request: Request) -> str:
    """The finish reason of a request the whole pool cannot hold: `"length"` once it has generated tokens (it
    ends with them, as at the model's context), `"error"` while it has none (its prompt does not fit)."""
    return "length" if request.output_token_ids else "error"
