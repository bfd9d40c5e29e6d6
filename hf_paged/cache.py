"""`PagedCache`: a transformers `Cache` whose rows own block tables in the model's global block pool."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

from .allocator import tokens_per_block
from .batch import ForwardBatch, ForwardInputs
from .batch_cache import BatchCache
from .config import ATTENTION_NAME, PagedCacheConfig
from .errors import RequestTooLargeError
from .planner import ForwardPlanner, duplicate_row_leaders
from .prompt_prefix import common_prompt_length, prompt_tokens
from .rows import Row

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStats:
    """One cache's use of the pool. Shared blocks count once.

    Attributes:
        num_rows (`int`): rows (sequences) in the cache.
        seq_length (`int`): padded length of every row.
        num_blocks (`int`): distinct blocks the rows hold now.
        peak_blocks (`int`): most distinct blocks held at once since the cache was created.
        tokens_stored (`int`): tokens in those blocks (a block shared by 4 rows counts its tokens once; in a hybrid
            model's layer groups a token counts once per group whose blocks hold it).
        cow_copies (`int`): blocks copied because a row wrote into a shared block.
        prefix_tokens_reused (`int`): prompt tokens taken from the prefix cache instead of being computed.
        block_size (`int`): tokens per block.
        attention_kernel (`str`): the paged-attention backend the `"hf_paged"` attention calls (`"cpu"`: the
            blocks are read in place; `"gather"`: K/V are copied out of them first), see `kernels`.
        attention_calls (`dict[str, int]`): attention calls (per layer and forward) by the backend that ran them.
    """

    num_rows: int
    seq_length: int
    num_blocks: int
    peak_blocks: int
    tokens_stored: int
    cow_copies: int
    prefix_tokens_reused: int
    block_size: int
    attention_kernel: str = "gather"
    attention_calls: dict = field(default_factory=dict, repr=False)


class PagedCache(BatchCache):
    """A KV cache whose rows own block tables in the model's global `BlockPool`.

    Blocks are taken one at a time as tokens arrive, pad tokens of left-padded batches are never stored, rows that
    `generate` expands (beams, `num_return_sequences`) and `reorder_cache` share blocks by refcount, and a shared
    block is copied only when a row writes into it. Full blocks are indexed by content (prefix caching): a later
    prompt that starts with cached blocks shares them and skips their prefill. Blocks go back to the pool on
    `reset()`/`release()` or when the cache is garbage collected. Sliding-window layers give back, during
    generation, the blocks their window skipped: all of a row's blocks when every layer slides (Mistral-style),
    those of the sliding layer groups in hybrid models (Gemma2/3, see `KVLayout`), while the full-attention groups
    keep theirs.

    Every forward is planned before the model runs, in the forward pre-hook hf_paged installs on the model: the
    cache's `ForwardPlanner` takes the blocks of the new tokens (all or nothing) and addresses them. `update` (see
    `BatchCache`) only writes and reads; under the `"hf_paged"` attention it returns just the new tokens, and the
    attention reads the rest through the block tables.

    Args:
        model (`PreTrainedModel`): the model this cache serves; its pool is `hf_paged.get_pool(model)`.
        **cache_config: `block_size`, `num_blocks`, `max_memory`, `memory_fraction`, `attn_implementation`,
            `prefix_caching` (see `PagedCacheConfig`).

    Attributes:
        layout (`KVLayout`): the model's layer groups; every row holds one block table per group.
        skip_window (`int | None`): the widest window `W` by which the sliding layer groups skip blocks: before
            each forward a row gives back those groups' blocks holding only tokens older than its last `W - 1`, so a
            long generation holds about `W / block_size + 2` blocks per row in each of them. `None` when no layer
            slides. Setting it overrides the window of every sliding group (`None` keeps every block).

    Example:

    ```python
    >>> import torch, hf_paged
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=100))
    >>> cache = hf_paged.PagedCache(model, block_size=4, num_blocks=32)
    >>> out = model.generate(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, max_new_tokens=3,
    ...                      do_sample=False, pad_token_id=0)
    >>> cache.get_seq_length(), cache.row_tables[0].num_tokens, len(cache.row_tables[0].block_ids)
    (7, 7, 2)
    >>> cache.release()
    >>> hf_paged.get_pool(model).stats().num_used
    0

    ```
    """

    def __init__(self, model: torch.nn.Module, **cache_config):
        self.cache_config = PagedCacheConfig.from_dict(cache_config)
        super().__init__(model, ForwardPlanner.for_model(model, self.cache_config), self.cache_config.kernel)
        pool = self.pool
        self._rows: list[Row] = []  # owned: freed by reset/release, or by the finalizer when the cache is dropped
        self._seq_length = 0
        self._pending: ForwardInputs | None = None  # a forward's inputs, when their shape was unknown to the hook
        self._batch_created_rows = False  # the current batch created the rows (its first forward)
        self._in_forward = False  # a prepared forward has not returned or raised an Exception (yet)
        self._cow_copies = 0
        self._peak_blocks = 0
        self._prefix_reused = 0
        self._released = False
        self._finalizer = weakref.finalize(self, pool.free_rows, self._rows)
        self.decode_table_width: int | None = None  # set while a generate call compiles its decode steps
        self._offers_compile = False

    # ------------------------------------------------------------------ views
    @property
    def rows(self) -> list[Row]:
        """The cache's rows (do not modify)."""
        return self._rows

    @property
    def row_tokens(self) -> list[list[int] | None]:
        """Token ids stored in every row (`None` where unknown or with prefix caching off)."""
        return [None if row.tokens is None else list(row.tokens) for row in self._rows]

    @property
    def prefix_root(self) -> bytes:
        """Root of this cache's prefix-hash chains (the model, dtype, adapters and weights it was built for)."""
        return self.planner.root

    def refresh_prefix_root(self) -> bytes:
        """Recompute `prefix_root` from the model as it is now (its weights may have been trained since the cache
        was built or last used); when it changed, the rows held so far are never indexed again."""
        model = self._model_ref()
        return self.planner.root if model is None else self.planner.refresh_root(model, self._rows)

    @property
    def is_released(self) -> bool:
        return self._released

    def stats(self) -> CacheStats:
        """This cache's use of the pool (see `CacheStats`)."""
        block_size = self.pool.block_size
        held = tokens_per_block([table for row in self._rows for table in row.tables], block_size)
        return CacheStats(
            num_rows=len(self._rows),
            seq_length=self._seq_length,
            num_blocks=len(held),
            peak_blocks=self._peak_blocks,
            tokens_stored=sum(held.values()),
            cow_copies=self._cow_copies,
            prefix_tokens_reused=self._prefix_reused,
            block_size=block_size,
            attention_kernel=self.kernel.backend,
            attention_calls=dict(self.attention_calls),
        )

    def _note_peak_blocks(self) -> None:
        distinct = {block_id for row in self._rows for block_id in row.live_block_ids}
        self._peak_blocks = max(self._peak_blocks, len(distinct))

    def _cached_length(self) -> int:
        return self._seq_length

    @property
    def is_croppable(self) -> bool:
        return True

    def dense_layer(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._check_open()
        return super().dense_layer(layer_idx)

    dense_layer.__doc__ = BatchCache.dense_layer.__doc__

    # ------------------------------------------------------------------ planning each forward
    def run(self, batch: ForwardBatch) -> None:
        raise TypeError("a PagedCache plans its own forwards; run() is for a BatchCache")

    def prepare_forward(self, model: torch.nn.Module, inputs: ForwardInputs) -> None:
        """Plan the coming forward of `model` (called by the forward pre-hook with its inputs): its rows take the
        blocks of its new tokens before the model runs."""
        self._settle()
        self._check_model(model)
        self._check_finished_forward()
        self._follow_inputs(inputs)
        self._batch, self._pending = None, None
        self._in_forward = True
        if inputs.shape is None:
            self._pending = inputs  # planned at the first write, from the shape of the K/V
            return
        self._batch = self._plan(*inputs.shape, inputs, inputs.device)

    def _batch_for(self, layer_idx: int, key_states: torch.Tensor) -> ForwardBatch:
        batch = self._batch
        shape = (key_states.shape[0], key_states.shape[-2])
        if batch is not None and layer_idx not in batch.layers_written:
            if (batch.batch_size, batch.num_new) == shape:
                return batch
            # the model changed the number of positions inside its forward: plan it again from the K/V's shape
            self._drop_batch()
            inputs = ForwardInputs(reads_tables=batch.reads_tables)
        else:  # a forward the pre-hook did not see (the inner model called directly, or a second forward)
            self._settle(inside_forward=True)
            inputs = self._pending or ForwardInputs()
        self._batch, self._pending = self._plan(*shape, inputs, key_states.device), None
        return self._batch

    def _plan(self, batch_size: int, num_new: int, inputs: ForwardInputs, device) -> ForwardBatch:
        """Take the blocks of a forward of `batch_size` rows x `num_new` positions and address them."""
        planner = self.planner
        planner.prepare(self._rows)  # the last forward's full blocks, and blocks the windows skipped
        free_before = self.pool.num_free
        created = self._ensure_rows(batch_size)
        self._batch_created_rows = created
        try:
            stores, pads = self._tokens_to_store(inputs.attention_mask, batch_size, num_new)
            leaders = duplicate_row_leaders(inputs, batch_size, num_new) if created else None
            writers = None if leaders is None else [leader == row for row, leader in enumerate(leaders)]
            writing = [i for i in range(batch_size) if writers is None or writers[i]]
            copies = planner.take(
                [self._rows[i] for i in writing],
                [stores[i] for i in writing],
                what=f"a forward of {batch_size} row(s) x {num_new} token(s)",
            )
        except BaseException:
            if created:
                self.pool.free_rows(self._rows)
            raise
        new_ids = self._new_token_ids(inputs, batch_size, num_new)
        for index, row in enumerate(self._rows):
            row.leading_pads += pads[index]
            if writers is None or writers[index]:
                row.record(None if new_ids is None else new_ids[index][num_new - stores[index] :])
        if leaders is not None:  # identical prompts: one copy of the blocks, shared by refcount
            for index, leader in enumerate(leaders):
                if leader != index:
                    self.pool.free_rows([self._rows[index]])
                    self._rows[index] = self.pool.fork_rows([self._rows[leader]])[0]
        self._seq_length += num_new
        self._cow_copies += copies
        if self.pool.num_free != free_before:
            self._note_peak_blocks()
        past = self._seq_length - num_new
        return planner.address(self._rows, past, num_new, stores, writers, copies, device, inputs.reads_tables)

    def _new_token_ids(self, inputs: ForwardInputs, batch: int, num_new: int) -> list[list[int]] | None:
        ids = inputs.input_ids
        if not self.prefix_caching or ids is None or ids.dim() != 2 or ids.shape[0] != batch or ids.is_meta:
            return None
        return ids[:, -num_new:].tolist() if ids.shape[1] >= num_new else None

    def _ensure_rows(self, batch: int) -> bool:
        """Create the rows (first forward), or repeat each row to meet a batch `generate` expanded (a prompt cache of
        B rows meeting B x num_beams rows, repeated in interleaved order)."""
        if not self._rows:
            self._rows.extend(self.pool.new_rows(batch, self.layout.num_groups, self.prefix_caching))
            return True
        if len(self._rows) == batch:
            return False
        if batch % len(self._rows) == 0:
            self.batch_repeat_interleave(batch // len(self._rows))
            return False
        raise ValueError(f"this PagedCache holds {len(self._rows)} rows but the forward has batch size {batch}")

    def _tokens_to_store(self, attention_mask, batch: int, num_new: int) -> tuple[list[int], list[int]]:
        """New tokens each row stores, and leading pad positions each row adds (pads before its first real token)."""
        stores, pads = [num_new] * batch, [0] * batch
        if all(row.num_tokens for row in self._rows):
            return stores, pads  # every row is past its left padding: all new tokens are stored
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] >= num_new:
            if attention_mask.shape[0] != batch:
                raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows but the batch has {batch}")
            leading = (attention_mask[:, -num_new:].to(torch.int32).cumsum(-1) == 0).sum(-1).tolist()
            for index, row in enumerate(self._rows):
                if row.num_tokens == 0:
                    pads[index], stores[index] = leading[index], num_new - leading[index]
        for index, row in enumerate(self._rows):
            if row.num_tokens + stores[index] == 0:
                raise ValueError(
                    f"row {index} has no real token: its attention_mask is all zeros (an empty prompt?); every row "
                    "needs at least one token"
                )
        return stores, pads

    def _index_full_blocks(self) -> None:
        """Put the rows' full blocks into the prefix index (sharing blocks whose content is cached already)."""
        if self.prefix_caching and self.pool.index_full_blocks(self._rows, self.planner.roots):
            self.planner.forget_previous()

    def refuse_if_too_large(
        self, prompts: list[tuple[int, int, int]], prefill_chunk: int | None = None, continuing: bool = False
    ) -> None:
        """Raise `RequestTooLargeError`, before anything runs, when `generate`'s rows may need more blocks at once
        than the whole pool has (`prompts`: see `ForwardPlanner.peak_blocks`), naming what set the pool's size.
        `continuing`: the call continues this cache, which holds rows (its pool cannot be rebuilt meanwhile)."""
        pool = self.pool
        needed = self.planner.peak_blocks(prompts, prefill_chunk)
        if needed <= pool.num_blocks:
            return
        rows = sum(count for _, _, count in prompts)
        longest = max(total for _, total, _ in prompts)
        sized_by = pool.sized_by or "an earlier call"
        advice = (
            f"Ask for fewer tokens, or release this cache and continue on a new hf_paged.PagedCache(model, "
            f"num_blocks={needed}) (an idle pool is rebuilt to its size); this cache is as it was before the call."
            if continuing
            else f"Give the call a pool that holds it (cache_config={{'num_blocks': {needed}}} or a larger "
            "'max_memory': an idle pool is rebuilt), call hf_paged.release_pool(model) so the next call builds a pool "
            "of the default size, or ask for fewer tokens."
        )
        raise RequestTooLargeError(
            f"this generate call may need {needed} KV blocks of {pool.block_size} tokens at once ({rows} row(s) of up "
            f"to {longest} tokens, beams and returned sequences sharing their prompt's full blocks) but the model's "
            f"whole pool has {pool.num_blocks} blocks, sized by {sized_by}. {advice}",
            needed,
            pool.num_free,
            pool.num_blocks,
            pool.sized_by,
        )

    # ------------------------------------------------------------------ compiled decoding
    @property
    def is_compileable(self) -> bool:
        """True from `compile_decode` until transformers asks for the compiled call (`decode_compile_taken`): the
        moment `generate` decides whether to compile its decode steps. The cache's forwards then see False, so
        `generate` hands them the 2D attention mask (the padding a paged cache never stores), not the 4D masks it
        builds for a static cache."""
        return self._offers_compile

    def compile_decode(self, model: torch.nn.Module, max_length: int | None) -> bool:
        """Let a `generate` call of `model` compile its decode steps, its rows holding up to `max_length` tokens (the
        block tables the compiled step reads are padded to that many tokens' blocks, so every step of the call has
        the same shapes); `None` ends it. Returns False where the steps cannot compile: an attention other than
        `"hf_paged"` (which reads the pages itself), or pages with keys per channel (`"int4-channel"`) off the CPU
        (the write that fills a block decides on the host which blocks to quantize). Quantized pages compile through
        the ops' `*_quantized` and `*_staged` variants."""
        self.decode_table_width, self._offers_compile = None, False
        if max_length is None:
            return False
        if self.pool.storage.stages_keys and model.get_input_embeddings().weight.device.type != "cpu":
            return False
        if model.config._attn_implementation != ATTENTION_NAME:
            return False
        self.decode_table_width = max(1, -(-max_length // self.pool.block_size))
        self._offers_compile = True
        return True

    def decode_compile_taken(self) -> None:
        """transformers has asked for the compiled call: stop offering (see `is_compileable`)."""
        self._offers_compile = False

    def takes_compiled_decode(self, rows: int) -> bool:
        """Whether the coming forward of `rows` rows can run compiled: compiling is on, the cache holds those rows,
        each past its prompt (every new token is stored), and every layer's pages are allocated."""
        if self.decode_table_width is None or len(self._rows) != rows or not all(r.num_tokens for r in self._rows):
            return False
        storage = self.pool.storage
        return all(storage.has_layer(layer) for layer in range(len(self.layers)))

    # ------------------------------------------------------------------ prompts and prefixes
    def start_from_prompt(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None, lookup: bool = True
    ) -> int:
        """Prepare for a `generate` call on `input_ids` (`[batch, length]`, left-padded); returns the positions that
        need no prefill.

        - An empty cache takes the longest cached prefix every row shares a block-aligned start with (all rows need
          the same left padding), so `generate` prefills only the rest; not with `lookup=False` (a call that
          returns attention weights or hidden states of every prompt position must compute them all).
        - A cache that already holds tokens (a conversation continued with `past_key_values`) is cropped back to the
          longest prefix it shares with `input_ids`, so stale positions are never attended to.

        At least one position is always left to compute (`generate` needs the last prompt token's logits).
        """
        self._settle()
        if input_ids is None or input_ids.dim() != 2 or not self.prefix_caching:
            return 0
        prompt = prompt_tokens(input_ids, attention_mask)
        if prompt is None:
            return 0  # not plain left padding
        pads, tokens = prompt
        if self._rows:
            return self._align_to_prompt(pads, tokens, input_ids.shape[1])
        return self._reuse_cached_prefix(pads, tokens) if lookup else 0

    def _reuse_cached_prefix(self, pads: list[int], tokens: list[list[int]]) -> int:
        if len(set(pads)) != 1:
            return 0
        pool, roots, windows = self.pool, self.planner.roots, self.layout.windows
        rows = [pool.cached_prefix_row(roots, windows, row_tokens, count_reuse=False) for row_tokens in tokens]
        num_tokens = min(row.num_tokens for row in rows)
        if any(row.reads_skipped(num_tokens, windows, pool.block_size) for row in rows):
            # a longer hit started its sliding groups past blocks the common prefix reads: look up the common one
            pool.free_rows(rows)
            rows = [pool.cached_prefix_row(roots, windows, t[: num_tokens + 1], count_reuse=False) for t in tokens]
        for _ in rows:
            pool.count_prefix_reuse(num_tokens)
        if num_tokens == 0:
            pool.free_rows(rows)
            return 0
        pool.truncate_rows(rows, num_tokens)
        for row in rows:
            row.leading_pads = pads[0]
        self._rows.extend(rows)
        self._seq_length = pads[0] + num_tokens
        self._prefix_reused += len(tokens) * num_tokens
        self._note_peak_blocks()
        return self._seq_length

    def _align_to_prompt(self, pads: list[int], tokens: list[list[int]], width: int) -> int:
        common = common_prompt_length(self._rows, pads, tokens, width)
        if common is None:
            return 0
        if common < self._seq_length and self._rows_reading_skipped(common):
            logger.info(
                "hf_paged: the prompt leaves the cache at %d positions, before blocks its sliding window skipped; "
                "recomputing the prompt",
                common,
            )
            self.pool.free_rows(self._rows)
            self._seq_length = 0
            self._batch = None
            return self._reuse_cached_prefix(pads, tokens)
        if common < self._seq_length:
            logger.info(
                "hf_paged: cropping the cache from %d to %d positions to match the prompt", self._seq_length, common
            )
            self.crop(common - self._seq_length)
        return self._seq_length

    def _rows_reading_skipped(self, new_length: int) -> list[int]:
        """Rows that keeping only `new_length` padded positions would leave reading blocks their window skipped."""
        size, windows = self.pool.block_size, self.layout.windows
        return [
            index
            for index, row in enumerate(self._rows)
            if row.reads_skipped(new_length - min(row.leading_pads, new_length), windows, size)
        ]

    def fork(self, n: int | None = None) -> PagedCache | list[PagedCache]:
        """Caches that share every block of this one (nothing is copied; a shared partial block is copied when a
        fork writes into it). The paged replacement for `copy.deepcopy(prompt_cache)`.

        Returns one `PagedCache`, or a list of `n` of them when `n` is given.
        """
        self._settle()
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"fork(n): n must be a positive int, got {n!r}")
        model = self._model_ref()
        if model is None:
            raise RuntimeError("the model of this PagedCache is gone")
        self._index_full_blocks()
        forks = []
        for _ in range(n or 1):
            twin = PagedCache(model, **self.cache_config.options())
            if not self.prefix_caching:  # its K/V depend on more than token ids (images...): so do the fork's
                twin.stop_prefix_caching()
            twin._rows.extend(self.pool.fork_rows(self._rows))
            twin._seq_length = self._seq_length
            twin._layers_per_forward = self._layers_per_forward  # so a fork notices its own unfinished forward
            twin._note_peak_blocks()
            forks.append(twin)
        return forks[0] if n is None else forks

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """`copy.deepcopy(prompt_cache)`, transformers' recipe for reusing a prompt's cache, is `fork()`: a cache
        of its own that shares every block until it writes into one."""
        twin = self.fork()
        memo[id(self)] = twin
        return twin

    # ------------------------------------------------------------------ row operations used by generate
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes a copy of row `beam_idx[i]` by sharing its blocks (no K/V is copied)."""
        self._select_rows(beam_idx.tolist(), "reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist(), "batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._rows)) for _ in range(repeats)], "batch_repeat_interleave")

    def _select_rows(self, sources: list[int], caller: str) -> None:
        self._settle()
        if not self._rows:
            return
        if any(isinstance(i, bool) or not isinstance(i, int) for i in sources):
            raise TypeError(f"{caller}: row indices must be integers, got {sources[:5]}")
        bad = [i for i in sources if not 0 <= i < len(self._rows)]
        if bad:
            raise IndexError(f"{caller}: row indices {bad[:5]} are out of range for a cache of {len(self._rows)} rows")
        new_rows = self.pool.fork_rows([self._rows[i] for i in sources])
        self.pool.free_rows(self._rows)
        self._rows.extend(new_rows)
        self._batch = None

    def crop(self, max_length: int) -> None:
        """Remove the last `-max_length` positions (a negative number, as in transformers); blocks that become
        empty go back to the pool."""
        self._settle()
        if max_length > 0:
            raise ValueError(
                f"crop({max_length}): pass a negative number of positions to remove (or 0); positive values are "
                "not supported"
            )
        if -max_length > self._seq_length:
            raise ValueError(f"crop({max_length}) would remove more than the {self._seq_length} cached positions")
        bad = self._rows_reading_skipped(self._seq_length + max_length)
        if bad:
            raise ValueError(
                f"crop({max_length}): rows {bad[:5]} gave back blocks their sliding window ({self.skip_window}) "
                f"skipped, which positions before {self._seq_length + max_length} would attend to again; start "
                "from a new cache (or reset()) instead"
            )
        self._index_full_blocks()
        self._truncate(self._seq_length + max_length)

    def _truncate(self, new_length: int) -> None:
        """Keep the first `new_length` padded positions of every row."""
        self.pool.truncate_rows(self._rows, new_length)
        self._seq_length = new_length
        self._batch = None
        self.planner.forget_previous()

    def activate_past_recording(self) -> None:
        """Nothing to do: every position stays in the pool until `crop` removes it."""

    def reset(self) -> None:
        """Return every block to the pool (full ones stay cached by content) and empty the cache for reuse."""
        self._settle()
        self._index_full_blocks()
        self.pool.free_rows(self._rows)
        self._seq_length = 0
        self._batch = None
        self._pending = None

    def release(self) -> None:
        """Return every block to the pool for good; using the cache afterwards raises, releasing it again does
        nothing. The cache's final `stats()` stay readable as `pool.last_cache_stats`."""
        if self._released:
            return
        self._settle()
        self.pool.last_cache_stats = self.stats()
        self.reset()
        self._released = True
        self._finalizer.detach()

    def forward_failed(self) -> None:
        """The forward planned last raised: unless every layer that writes wrote, take its tokens back (and the rows
        it created), so a failed call leaves the cache as it was."""
        if not self._released:
            self._settle(failed=True)

    def forward_finished(self) -> None:
        super().forward_finished()
        self._in_forward = False

    def _settle(self, failed: bool = False, inside_forward: bool = False) -> None:
        """Refuse a released cache, and drop what an interrupted forward left behind (every public entry point);
        `failed`: the forward is known to have raised. Outside a forward (`inside_forward` False), a forward that
        never returned nor raised an `Exception` was left by a `BaseException` (`KeyboardInterrupt`): failed too."""
        self._check_open()
        if not inside_forward:
            failed = failed or self._in_forward
            self._in_forward = False
        batch = self._batch
        if batch is None:
            return
        written = len(batch.layers_written)
        expected = self._layers_per_forward or (len(self.layers) if failed else 0)
        if written == 0 or written < expected:
            if written:
                logger.warning(
                    "hf_paged: the last forward stopped after %d of %d layers; its tokens are dropped",
                    written,
                    expected,
                )
            self._drop_batch()
            return
        self._layers_per_forward = max(self._layers_per_forward, written)

    def _drop_batch(self) -> None:
        """Take back the tokens of the current batch (its forward did not run through), and the rows it created."""
        if self._batch_created_rows:
            self.pool.free_rows(self._rows)
            self._seq_length = 0
            self._batch = None
            self.planner.forget_previous()
            return
        self._truncate(self._seq_length - self._batch.num_new)

    def _check_open(self) -> None:
        if self._released:
            raise RuntimeError("this PagedCache was released; its blocks are back in the pool. Build a new one.")

    def __repr__(self) -> str:
        blocks = sum(len(row.live_block_ids) for row in self._rows)
        return (
            f"PagedCache(rows={len(self._rows)}, seq_length={self._seq_length}, "
            f"block_size={self.pool.block_size}, blocks={blocks}, kernel={self.kernel.backend!r})"
        )
