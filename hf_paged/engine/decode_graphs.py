"""`DecodeGraphs`: the Engine's decode steps replayed from graphs captured once per batch size.

A decode step (every row one new token) of `rows` rows runs as the graph captured for the smallest captured size
`size >= rows`, over static buffers that the step's inputs are copied into: token ids, positions, and per layer group
the write slots, block tables (a fixed width of `width` blocks, enough for the model's longest sequence) and lengths.
The `size - rows` pad rows are real rows of the captured shape that nothing reads back: each stores its K/V in a
scratch block that the graphs hold in the pool (one block, taken from the allocator when the graphs are made and
returned by `close`), attends over that one token, and its logits are dropped. Planning stays on the host; the
replay launches the whole forward at once, which is what a host-bound CUDA decode step lacks.

`capture="cuda"` records CUDA graphs (`torch.cuda.graph`, one memory pool shared by every size, warmed up on a side
stream first). `capture="eager"` records nothing and runs the same function over the same static buffers at each
replay: the buffer logic (padding, scratch slots, table widths, which outputs are kept) proven on any device, which
is how the tests check it without a GPU.

Example:

```python
>>> import hf_paged
>>> from hf_paged.reference_models import tiny_model
>>> engine = hf_paged.Engine(tiny_model("llama"), block_size=4, num_blocks=64, compile=False)
>>> engine.runner.capture_decode_graphs(sizes=(1, 2, 4), capture="eager")
>>> _ = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
>>> dict(engine.runner.decode_graphs.replays_by_size)  # decode steps of 2 rows (the first step runs eagerly)
{2: 2}
>>> engine.close()  # returns the graphs' scratch block
>>> engine.pool.stats().num_used
0

```
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from ..step_attention import StepTensors, pages_of

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # batch sizes captured (pad a step up to the next one)
CAPTURES = ("cuda", "eager")

__all__ = ["CAPTURES", "DEFAULT_SIZES", "DecodeGraphs"]


class _EagerGraph:
    """What a captured graph does at replay, run eagerly: `fn` over the static buffers it closes over."""

    def __init__(self, fn):
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output = self.fn()


class _CudaGraph:
    """`fn` recorded as a CUDA graph; `replay` relaunches it, refreshing `output` in place."""

    def __init__(self, fn, pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled, workspaces allocated, outside the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


class _Buffers:
    """The static inputs of the graph of `size` rows: its own tensors, not views (a compiled forward guards on a
    view's base). Rows start as pad rows: the pad token at position 0, stored in and reading the scratch slot."""

    def __init__(self, size: int, width: int, groups: int, scratch_block: int, scratch_slot: int, pad_token_id, device):
        self.input_ids = torch.full((1, size), pad_token_id, dtype=torch.long, device=device)
        self.position_ids = torch.zeros((1, size), dtype=torch.long, device=device)
        self.last = torch.arange(size, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.slots = [torch.full((size,), scratch_slot, dtype=torch.long, device=device) for _ in range(groups)]
        self.tables = [
            torch.full((size, width), scratch_block, dtype=torch.int32, device=device) for _ in range(groups)
        ]
        self.lengths = [torch.ones(size, dtype=torch.int32, device=device) for _ in range(groups)]
        self.pad_token_id, self.scratch_block, self.scratch_slot = pad_token_id, scratch_block, scratch_slot

    def fill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tensors: StepTensors) -> None:
        """Rows `0 .. rows - 1` from a decode step, the rest pad rows."""
        rows = input_ids.shape[1]
        self.input_ids[0, :rows].copy_(input_ids[0])
        self.input_ids[0, rows:] = self.pad_token_id
        self.position_ids[0, :rows].copy_(position_ids[0])
        self.position_ids[0, rows:] = 0
        for group, (slots, table, lengths) in enumerate(zip(tensors.slots, tensors.block_tables, tensors.seq_lens)):
            columns = table.shape[1]
            self.slots[group][:rows].copy_(slots)
            self.slots[group][rows:] = self.scratch_slot
            self.tables[group][:rows, :columns].copy_(table)
            self.tables[group][:rows, columns:] = self.scratch_block  # past every row's end: never read
            self.tables[group][rows:] = self.scratch_block
            self.lengths[group][:rows].copy_(lengths)
            self.lengths[group][rows:] = 1

    def step_tensors(self, cache) -> StepTensors:
        """The `StepTensors` of these buffers over `cache`'s pages."""
        layout, storage = cache.layout, cache.pool.storage
        return StepTensors(
            kv=pages_of(storage, len(layout.layer_windows)),
            slots=tuple(self.slots),
            block_tables=tuple(self.tables),
            seq_lens=tuple(self.lengths),
            query_start=self.query_start,
            group_of=layout.group_of,
            windows=layout.layer_windows,
            kernel=cache.kernel.requested,
            kv_dtype=storage.format.name,
        )


class DecodeGraphs:
    """Decode steps of up to `max(sizes)` rows replayed from graphs captured per size (see the module docstring).

    Args:
        run (`Callable`): `run(input_ids, position_ids, last, tensors) -> logits` (`[rows, vocab]`): the step's
            forward under the `"hf_paged_step"` attention (compiled or eager), called inside that attention's
            context.
        cache (`BatchCache`): the engine's cache, every layer's pages allocated (its pool gives the scratch block).
        width (`int`): block-table columns of every captured step (the most blocks one row can hold).
        sizes (`tuple[int, ...]`): batch sizes to capture.
        capture (`str`): `"cuda"` (CUDA graphs) or `"eager"` (the same buffers, replayed eagerly).
        pad_token_id (`int`): the token id pad rows carry.

    Attributes:
        sizes (`tuple[int, ...]`): the captured sizes, ascending.
        scratch_block (`int`): the pool block pad rows store in and read.
        capture_s (`float`): seconds spent capturing.
        replays_by_size (`Counter`): replays per captured size.
    """

    def __init__(self, run, cache, width: int, sizes=DEFAULT_SIZES, capture: str = "cuda", pad_token_id: int = 0):
        sizes = tuple(sorted(set(sizes)))
        if not sizes or any(not isinstance(size, int) or isinstance(size, bool) or size < 1 for size in sizes):
            raise ValueError(f"decode graph sizes must be positive ints, got {sizes!r}")
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"the decode graphs' table width must be a positive int, got {width!r}")
        self.sizes, self.width, self.capture, self.cache = sizes, width, capture, cache
        self.replays_by_size: Counter = Counter()
        pool = cache.pool
        self._scratch_row = pool.new_rows(1, 1, track_tokens=False)[0]
        pool.take_blocks(self._scratch_row.appends(1), what="the decode graphs' scratch block")
        self.scratch_block = self._scratch_row.tables[0].block_ids[0]
        device, groups = cache_device(cache), len(cache.layout.groups)
        start = time.perf_counter()
        memory_pool = torch.cuda.graph_pool_handle() if capture == "cuda" else None
        self._buffers, self._graphs = {}, {}
        try:
            for size in reversed(sizes):  # the largest first: the smaller ones reuse its memory
                with torch.inference_mode(False):  # made as a step's inputs are: a compiled forward guards on it
                    buffers = _Buffers(
                        size,
                        width,
                        groups,
                        self.scratch_block,
                        self.scratch_block * pool.block_size,
                        pad_token_id,
                        device,
                    )
                fn = _bound(run, buffers, buffers.step_tensors(cache))
                self._graphs[size] = _CudaGraph(fn, memory_pool) if capture == "cuda" else _EagerGraph(fn)
                self._buffers[size] = buffers
        except BaseException:
            self.close()
            raise
        self.capture_s = time.perf_counter() - start
        logger.info(
            "hf_paged: captured decode graphs (%s) for batch sizes %s in %.1f s", capture, list(sizes), self.capture_s
        )

    def size_for(self, rows: int) -> int | None:
        """The captured size a step of `rows` rows replays (the smallest that holds it), or `None`."""
        return next((size for size in self.sizes if size >= rows), None)

    def accepts(self, tensors: StepTensors) -> bool:
        """Whether a packed step's `StepTensors` can replay: a decode step (one token a row), at most the largest
        captured size of rows, every block table at most `width` columns."""
        rows = tensors.query_start.numel() - 1
        if self._scratch_row is None or rows < 1 or rows > self.sizes[-1] or tensors.slots[0].numel() != rows:
            return False
        return all(table.shape[1] <= self.width for table in tensors.block_tables)

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tensors: StepTensors) -> torch.Tensor:
        """The logits (`[rows, vocab]`) of a decode step (`accepts(tensors)`): its inputs copied into the static
        buffers of the smallest captured size that holds it, the rest pad rows, that size's graph replayed."""
        rows = input_ids.shape[1]
        size = self.size_for(rows)
        self._buffers[size].fill(input_ids, position_ids, tensors)
        graph = self._graphs[size]
        graph.replay()
        self.replays_by_size[size] += 1
        logits = graph.output[:rows]
        return logits.clone() if self.capture == "cuda" else logits  # the next replay overwrites a graph's output

    def close(self) -> None:
        """Return the scratch block to the pool; the graphs are not replayed after this."""
        if self._scratch_row is not None:
            self.cache.pool.free_rows([self._scratch_row])
            self._scratch_row = None
            self._graphs.clear()
            self._buffers.clear()


def _bound(run, buffers: _Buffers, tensors: StepTensors):
    """`run` over fixed buffers, as a function of nothing (what a graph records)."""

    def fn():
        return run(buffers.input_ids, buffers.position_ids, buffers.last, tensors)

    return fn


def cache_device(cache) -> torch.device:
    """The device of `cache`'s pages."""
    return cache.pool.storage.layer_tensors(0)[0].device
