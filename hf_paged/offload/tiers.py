"""`KVOffload`: the tiers behind a pool's prefix cache.

Every block the prefix cache indexes (full, every layer written) is copied to the CPU at once and written by a
background thread to every tier (write-through: a block is in the tiers before the pool can evict it, and a process
that exits or a second server finds it). A prefix lookup that misses in the pool goes on down the tiers, host memory,
then the directory, then the remote store, and loads the blocks it finds there into fresh pool blocks, indexed as
cached content, before the row is built from them: only the rest of the prompt is computed.

Keys are chains over the tokens from a persistent root (`hf_paged.offload.keys`); an entry that fails its checks
(`hf_paged.offload.codec`) is a miss, counted as a reject and deleted. A tier whose medium fails (a full disk, an
unreachable server) switches itself off with one warning; the others go on, and no request fails.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from ..groups import skipped_tokens
from ..prefix import block_hash, group_roots, root_hash
from ..rows import prefix_links
from .codec import CorruptBlockError, decode, encode
from .config import OffloadConfig
from .keys import persistent_root
from .stores import BlockStore, DirectoryStore, MemoryStore, RedisStore

logger = logging.get_logger(__name__)

MAX_PENDING_BYTES = 512 * 1024**2  # copies waiting for the writer; beyond, new blocks are not written (counted)
_MAX_LINKS = 1 << 20  # in-process block hashes remembered with their persistent key


@dataclass
class TierStats:
    """What one tier did since the pool got it.

    Attributes:
        name (`str`): `"host"`, `"disk"` or `"remote"`.
        description (`str`): where it keeps blocks, and its budget.
        enabled (`bool`): False once its medium failed (see `error`).
        hits (`int`): blocks loaded from it into the pool; `tokens_loaded` the tokens they hold.
        bytes_read, bytes_written (`int`): entry bytes read on hits and written.
        writes (`int`): entries written; `entries`, `nbytes`: held now.
        evictions (`int`): entries it dropped to stay within its budget.
        rejects (`int`): entries that failed their checks (corrupt, truncated, another key, another shape): misses,
            deleted.
        load_seconds (`float`): time spent reading and decoding its hits.
        error (`str | None`): why it switched off.
    """

    name: str
    description: str
    enabled: bool = True
    hits: int = 0
    tokens_loaded: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    entries: int = 0
    nbytes: int = 0
    evictions: int = 0
    rejects: int = 0
    load_seconds: float = 0.0
    error: str | None = None


@dataclass
class OffloadStats:
    """Every tier's `TierStats`, and the writes not made."""

    tiers: list[TierStats] = field(default_factory=list)
    dropped_writes: int = 0  # blocks not written: the writer was over `MAX_PENDING_BYTES` behind

    @property
    def tokens_loaded(self) -> int:
        return sum(tier.tokens_loaded for tier in self.tiers)


class Tier:
    """One store and its counters; off for good after its first failure."""

    def __init__(self, store: BlockStore):
        self.store = store
        self.stats = TierStats(store.name, store.describe())
        self._lock = threading.Lock()
        self._counted_at = -1.0

    @property
    def enabled(self) -> bool:
        return self.stats.enabled

    def fail(self, error: BaseException, doing: str) -> None:
        with self._lock:
            if not self.stats.enabled:
                return
            self.stats.enabled = False
            self.stats.error = f"{type(error).__name__}: {error}"
        logger.warning(
            "hf_paged: the %s tier (%s) failed while %s and is off from now on; serving goes on without it: %s",
            self.store.name,
            self.store.describe(),
            doing,
            self.stats.error,
        )

    def snapshot(self) -> TierStats:
        """A copy of the counters; the store's entries and bytes are asked for at most once a second (a remote
        store answers over the network, and `/metrics` reads this after every step)."""
        now = time.monotonic()
        if self.stats.enabled and now - self._counted_at >= 1.0:
            self._counted_at = now
            try:
                self.stats.entries, self.stats.nbytes = self.store.entries(), self.store.nbytes()
            except Exception as error:  # the medium failed: reported, and the tier switches off
                self.fail(error, "counting its entries")
        self.stats.evictions = self.store.evictions
        return TierStats(**vars(self.stats))


def stores_for(config: OffloadConfig) -> list[BlockStore]:
    """The stores `config` names, in lookup order; `ValueError` for a directory that cannot be written or a Redis
    server that cannot be reached (checked here, at start)."""
    stores: list[BlockStore] = []
    if config.host_bytes is not None:
        stores.append(MemoryStore(config.host_bytes))
    if config.dir is not None:
        stores.append(DirectoryStore(config.dir, config.resolved_disk_bytes))
    if config.remote is not None:
        stores.append(RedisStore(config.remote, config.resolved_remote_bytes))
    return stores


class KVOffload:
    """The tiers of one pool (see the module docstring). Attached by `get_pool(model, kv_offload={...})` (and so by
    `generate(..., cache_config={"kv_offload": ...})` and `Engine(model, kv_offload=...)`) as `pool.offload`.

    Args:
        config (`OffloadConfig`): the tiers.
        block_size (`int`): of the pool.

    Example:

    ```python
    >>> import tempfile
    >>> from hf_paged.offload import OffloadConfig
    >>> offload = KVOffload(OffloadConfig(dir=tempfile.mkdtemp()), block_size=16)
    >>> [tier.name for tier in offload.stats().tiers]
    ['disk']
    >>> offload.close()

    ```
    """

    def __init__(self, config: OffloadConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self.tiers = [Tier(store) for store in stores_for(config)]
        self._roots: dict[bytes, bytes] = {}  # in-process chain root -> persistent root
        self._links: OrderedDict[bytes, bytes] = OrderedDict()  # in-process block hash -> persistent key
        self._written: OrderedDict[bytes, None] = OrderedDict()  # persistent keys written by this process
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._dropped = 0
        self._writer: threading.Thread | None = None
        self.device: torch.device | None = None  # where lanes not yet allocated are allocated on a load
        self.single_device = True
        _live.add(self)

    # ------------------------------------------------------------------ keys
    def register_root(self, model: torch.nn.Module, root: bytes, pool) -> None:
        """Map the in-process chain root `root` of `model`'s blocks in `pool` (and its layer groups' roots) to its
        persistent root; a model in training mode gets none (its blocks are neither written nor loaded)."""
        if root in self._roots:
            return
        persistent = persistent_root(model, pool.kv_dtype, pool.block_size, pool.tp_rank)
        if persistent is None:
            return
        devices = {parameter.device for parameter in model.parameters()}
        self.device = next(model.parameters()).device
        self.single_device = len(devices) == 1
        self._map_roots(root, persistent, pool.layout.num_groups if pool.layout is not None else 1)

    def register_namespace(self, base: bytes, namespace: bytes, root: bytes, num_groups: int) -> None:
        """Map `root`, the chain root of blocks computed under `namespace` (a LoRA adapter's name and the digest of
        its weights, valid in any process) on top of the base root `base`, to its persistent root."""
        persistent = self._roots.get(base)
        if persistent is not None and root not in self._roots:
            self._map_roots(root, root_hash(persistent + namespace), num_groups)

    def _map_roots(self, root: bytes, persistent: bytes, num_groups: int) -> None:
        self._roots[root] = persistent
        for count in {1, num_groups}:
            for ours, theirs in zip(group_roots(root, count), group_roots(persistent, count)):
                self._roots[ours] = theirs

    def _persistent_parent(self, parent: bytes) -> bytes | None:
        found = self._roots.get(parent)
        return found if found is not None else self._links.get(parent)

    def _remember(self, ours: bytes, theirs: bytes) -> None:
        self._links[ours] = theirs
        self._links.move_to_end(ours)
        if len(self._links) > _MAX_LINKS:
            self._links.popitem(last=False)

    # ------------------------------------------------------------------ writes
    def record(self, storage, links: list[tuple[bytes, bytes, tuple[int, ...], int | None, bool]]) -> None:
        """Give every newly indexed block its persistent key and queue the new ones for writing: `links` are
        `(parent hash, block hash, tokens, block id or None, newly indexed)`, as `Row.cache_full_blocks` lists them.
        Called under the pool's lock, before the blocks can be evicted: their K/V are copied here."""
        if not any(tier.enabled for tier in self.tiers):
            return
        keys, block_ids = [], []
        for parent, ours, tokens, block_id, new in links:
            persistent_parent = self._persistent_parent(parent)
            if persistent_parent is None:
                continue
            theirs = block_hash(persistent_parent, tokens)
            self._remember(ours, theirs)
            if new and block_id is not None and theirs not in self._written:
                keys.append(theirs)
                block_ids.append(block_id)
        if not keys:
            return
        tensors = storage.blocks_tensors(block_ids)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if not self._enqueue((keys, tensors, None), size, len(keys)):
            return
        for key in keys:
            self._written[key] = None
        while len(self._written) > _MAX_LINKS:
            self._written.popitem(last=False)

    def _enqueue(self, item: tuple, size: int, count: int) -> bool:
        """Queue `item` (`(keys, tensors to encode, None)`, or `(keys, None, (encoded bytes, tiers))`) for the
        writer, unless `MAX_PENDING_BYTES` are already waiting (then its `count` blocks are dropped)."""
        with self._pending_lock:
            if self._pending_bytes + size > MAX_PENDING_BYTES:
                self._dropped += count
                return False
            self._pending_bytes += size
        self._start_writer()
        self._queue.put((*item, size))
        return True

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="hf_paged-kv-offload", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                keys, tensors, promoted, size = item
                for index, key in enumerate(keys):
                    if promoted is None:
                        data, tiers = encode(key.hex(), {name: tensor[index] for name, tensor in tensors.items()}), None
                    else:
                        data, tiers = promoted
                    for tier in self.tiers if tiers is None else tiers:
                        if not tier.enabled:
                            continue
                        try:
                            written = tier.store.put(key.hex(), data)
                        except Exception as error:  # a full disk, a lost server: this tier is off, serving goes on
                            tier.fail(error, "writing a block")
                            continue
                        if written:
                            tier.stats.writes += 1
                            tier.stats.bytes_written += len(data)
                with self._pending_lock:
                    self._pending_bytes -= size
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self.flush()
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None

    # ------------------------------------------------------------------ loads
    def load(self, pool, roots: list[bytes], windows: list[int | None], tokens: list[int], links=None) -> int:
        """Load into `pool` the blocks of `tokens`' longest block-aligned prefix (leaving one token to compute) that
        the pool lacks and the tiers hold, as cached content for the lookup that follows (`Row.from_prefix_cache`).
        `links`: the prompt's `rows.prefix_links`, where the caller has them. Called under the pool's lock. Returns
        the blocks loaded."""
        tiers = [tier for tier in self.tiers if tier.enabled]
        persistent = [self._roots.get(root) for root in roots]
        size = self.block_size
        usable = (len(tokens) - 1) // size * size
        if not tiers or None in persistent or not usable:
            return 0
        allocator = pool.allocator
        if links is None:
            links = prefix_links(roots, tokens, size)
        theirs = prefix_links(persistent, tokens, size)
        for group_links, group_theirs in zip(links, theirs):
            for (ours, _), (key, _) in zip(group_links, group_theirs):
                self._remember(ours, key)
        found = [allocator.lookup_blocks(group_links) for group_links in links]
        wanted = []  # (group, index) in prefix order
        for index in range(usable // size):
            for group, window in enumerate(windows):
                if window is not None and index < skipped_tokens(usable, window) // size:
                    continue
                if found[group][index] is None:
                    wanted.append((group, index))
        if not wanted or (not self.single_device and not pool.storage.keys):
            return 0
        pinned = [block for group_found in found for block in group_found if block is not None]
        allocator.pin_cached(pinned)
        try:
            room = allocator.num_free + len(allocator.evictable_block_ids)
            wanted = wanted[:room]
            keys = [theirs[group][index][0] for group, index in wanted]
            entries = self._fetch(pool, tiers, keys)
            start = time.perf_counter()
            block_ids = []
            try:
                for group, index in wanted[: len(entries)]:
                    block_ids.append(allocator.adopt_cached(links[group][index][0], theirs[group][index][1]))
                blocks = [tensors for _, _, tensors in entries]
                pool.storage.load_blocks(block_ids, blocks, pool.kv_shape.dtype, self.device)
            except BaseException:
                allocator.forget_cached(block_ids)  # nothing half-written stays indexed
                raise
            copy_seconds = (time.perf_counter() - start) / max(len(entries), 1)
            for key, (tier, data, _) in zip(keys, entries):
                upper = [other for other in self.tiers[: self.tiers.index(tier)] if other.enabled]
                if upper:  # promoted: the faster tiers above keep it too (written by the writer, off the lock)
                    self._enqueue(([key], None, (data, upper)), len(data), 1)
                tier.stats.hits += 1
                tier.stats.tokens_loaded += self.block_size
                tier.stats.bytes_read += len(data)
                tier.stats.load_seconds += copy_seconds
                self._written[key] = None
            return len(entries)
        finally:
            allocator.unpin_cached(pinned)

    def _fetch(self, pool, tiers: list[Tier], keys: list[bytes]) -> list[tuple[Tier, bytes, dict]]:
        """The entries of the leading run of `keys` that the tiers hold intact, each as (its tier, its bytes, its
        tensors) from the first tier that has it: every tier is asked, in one call, for the keys the tiers above it
        lacked; the entries are then checked in key order, up to the first key no tier holds intact (a prefix cannot
        skip a block: what lies past it is never decoded). An entry that fails its checks is a miss there (counted
        and deleted), and the tiers below are asked for that key."""
        storage = pool.storage
        num_lanes = pool.layout.lanes_per_block if pool.layout is not None else pool.kv_shape.num_layers
        found: list[tuple[int, bytes] | None] = [None] * len(keys)  # (tier index, bytes) of the first tier with it
        for position, tier in enumerate(tiers):
            missing = [i for i, entry in enumerate(found) if entry is None]
            if not missing:
                break
            start = time.perf_counter()
            try:
                values = tier.store.get_many([keys[i].hex() for i in missing])
            except Exception as error:
                tier.fail(error, "reading blocks")
                continue
            for i, data in zip(missing, values):
                if data is not None:
                    found[i] = (position, data)
            tier.stats.load_seconds += time.perf_counter() - start
        entries = []
        for key, first in zip(keys, found):
            entry = None if first is None else self._intact(tiers, first, key.hex(), storage, num_lanes)
            if entry is None:
                break
            entries.append(entry)
        return entries

    def _intact(
        self, tiers: list[Tier], first: tuple[int, bytes], key: str, storage, num_lanes: int
    ) -> tuple[Tier, bytes, dict] | None:
        """(tier, bytes, tensors) of `key`'s entry in the first tier that holds it intact, starting with `first`
        (its tier's index in `tiers`, its bytes) and asking the tiers below one by one while entries fail their
        checks; `None` where none does."""
        position, data = first
        while True:
            tier = tiers[position]
            start = time.perf_counter()
            tensors = self._checked(tier, key, data, storage, num_lanes)
            tier.stats.load_seconds += time.perf_counter() - start
            if tensors is not None:
                return tier, data, tensors
            data = None
            while data is None:
                position += 1
                if position == len(tiers):
                    return None
                if tiers[position].enabled:
                    try:
                        [data] = tiers[position].store.get_many([key])
                    except Exception as error:
                        tiers[position].fail(error, "reading blocks")

    @staticmethod
    def _checked(tier: Tier, key: str, data: bytes, storage, num_lanes: int) -> dict | None:
        """The tensors of an entry that passes its checks and fits `storage`; else `None`, the entry counted as a
        reject and deleted."""
        try:
            tensors = decode(key, data)
            if not storage.block_fits(tensors, num_lanes):
                raise CorruptBlockError(f"the entry stored under {key} does not fit this pool's blocks")
            return tensors
        except CorruptBlockError as error:
            tier.stats.rejects += 1
            logger.info("hf_paged: %s tier: %s (deleted)", tier.store.name, error)
            try:
                tier.store.delete(key)
            except Exception as delete_error:
                tier.fail(delete_error, "deleting a rejected block")
            return None

    # ------------------------------------------------------------------ report
    def stats(self) -> OffloadStats:
        return OffloadStats([tier.snapshot() for tier in self.tiers], self._dropped)

    def describe(self) -> str:
        """One line naming the tiers, for `render_pool_text` and logs."""
        states = [tier.store.describe() + ("" if tier.enabled else " [off]") for tier in self.tiers]
        return "KV tiers: " + ", ".join(states)


_live: weakref.WeakSet[KVOffload] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Queued blocks are written before the interpreter exits (a restarted process finds them)."""
    for offload in list(_live):
        try:
            offload.flush()
        except Exception:  # noqa: S110 - nothing to report to at exit
            pass
