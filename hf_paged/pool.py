"""The global block pool of a model: one allocator plus its KV storage, sized once."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field, fields, replace

import torch

from .allocator import AllocatorStats, BlockAllocator, BlockTable
from .channel_keys import StagedLayout
from .config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_FRACTION, DEFAULT_MAX_BLOCKS, PagedCacheConfig
from .groups import KVLayout, layer_kv_shapes
from .kv_format import FORMATS, kv_format
from .rows import Row, prefix_links
from .staged_storage import StagedKVStorage
from .storage import KVStorage, autocast_dtype
from .tensor_parallel import local_kv_shapes, tensor_parallel_placement

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the KV cache of a model, on this process: a rank of a tensor-parallel model stores
    only its share of the KV heads, and every count here is that share.

    Attributes:
        num_layers (`int`): decoder layers.
        num_kv_heads, head_dim (`int`): of every layer (of the first, when `layer_kv` lists them layer by layer);
            `num_kv_heads` counts the heads this rank stores (also readable as `kv_heads_local`).
        dtype (`torch.dtype`): of the K/V.
        layers_per_block (`int`, *optional*): lanes (layers) of one block, fewer than `num_layers` when a hybrid
            model's layers are split into layer groups (see `KVLayout`).
        layer_kv (`tuple[tuple[int, int], ...]`, *optional*): `(num_kv_heads, head_dim)` of every layer, for models
            whose layers differ.
        tp_rank, tp_world_size (`int`): this process's rank in the model's tensor-parallel group and the group's
            size (0 and 1 without tensor parallelism).
        kv_dtype (`str`): how the pool stores K/V (`"auto"`: in `dtype`; `"int8"`, `"int4"`: quantized, a bfloat16
            scale per token and head included in every byte count here; `"int4-channel"`: a block's row of codes,
            scales and per-channel key steps and minimums, over its `block_size` tokens).
        block_size (`int`, *optional*): tokens per block, for formats whose bytes per token depend on it
            (`"int4-channel"`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layers_per_block: int | None = None
    layer_kv: tuple[tuple[int, int], ...] | None = None
    tp_rank: int = 0
    tp_world_size: int = 1
    kv_dtype: str = "auto"
    block_size: int | None = None

    @property
    def kv_heads_local(self) -> int:
        """KV heads this rank stores per layer (of the first layer when layers differ)."""
        return self.num_kv_heads

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x bytes of one head's vector (head dim x dtype bytes; quantized: the
        codes and the scale): one token of the model's KV."""
        if self.layer_kv is not None:
            return sum(self._layer_bytes(heads, dim) for heads, dim in self.layer_kv)
        return self.num_layers * self._layer_bytes(self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_token(self) -> int:
        """What one token slot of a block costs: `bytes_per_token`, or its share of the layers when blocks hold
        `layers_per_block` layers (a hybrid model's layer groups, whose layers all have one KV shape)."""
        if self.layers_per_block is None:
            return self.bytes_per_token
        return self.layers_per_block * self._layer_bytes(self.num_kv_heads, self.head_dim)

    def _layer_bytes(self, num_heads: int, head_dim: int) -> int:
        """K and V of one token of one layer (a per-channel format: its share of the layer's block row)."""
        fmt = kv_format(self.kv_dtype)
        if fmt.keys_per_channel:
            return StagedLayout(self._staged_block_size, num_heads, head_dim).row_bytes // self._staged_block_size
        return 2 * num_heads * fmt.bytes_per_head(head_dim, self.dtype)

    @property
    def _staged_block_size(self) -> int:
        if self.block_size is None:
            raise ValueError(f"kv_dtype={self.kv_dtype!r} counts bytes per block: the KVShape needs its block_size")
        return self.block_size

    @property
    def companions(self) -> int:
        """Blocks an open block also takes to keep its keys in the model's dtype (`"int4-channel"`), else 0."""
        if not kv_format(self.kv_dtype).keys_per_channel:
            return 0
        shapes = self.layer_kv or ((self.num_kv_heads, self.head_dim),)
        return max(StagedLayout(self._staged_block_size, h, d).companions(self.dtype) for h, d in set(shapes))

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        layers_per_block: int | None = None,
        kv_dtype: str = "auto",
        block_size: int | None = None,
    ) -> KVShape:
        """The KV cost of `model` on this process, its K/V stored as `kv_dtype` (in blocks of `block_size` tokens);
        under transformers' tensor parallelism (`tp_plan="auto"`), of the KV heads this rank's key projections
        actually hold.

        Raises:
            ValueError: the model's tensor-parallel degree does not divide a layer's KV heads, or a layer's head dim
                cannot be stored as `kv_dtype` (an odd head dim in 4 bits).

        Example:

        ```python
        >>> from hf_paged.reference_models import tiny_model
        >>> shape = KVShape.from_model(tiny_model("llama"))
        >>> shape.kv_heads_local, shape.tp_rank, shape.tp_world_size, shape.bytes_per_token
        (2, 0, 1, 512)

        ```
        """
        config = model.config.get_text_config(decoder=True)
        placement = tensor_parallel_placement(model)
        shapes = local_kv_shapes(layer_kv_shapes(config), placement)
        dtype = model_kv_dtype(model)
        layer_kv = tuple(shapes) if len(set(shapes)) > 1 else None
        fmt = kv_format(kv_dtype)
        for _, head_dim in sorted(set(shapes)):
            fmt.check_head_dim(head_dim, type(model).__name__)
        return cls(
            len(shapes),
            *shapes[0],
            dtype,
            layers_per_block,
            layer_kv,
            placement.rank,
            placement.world_size,
            kv_dtype,
            block_size,
        )


def model_kv_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of `model`'s K/V as a pool accounts for it: its weights' (the default dtype for integer weights)."""
    dtype = next(model.parameters()).dtype
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


@dataclass(frozen=True)
class PoolStats(AllocatorStats):
    """`AllocatorStats` of a pool, with where the pool lives: `tp_rank` and `tp_world_size` of the model's
    tensor-parallel group (0 and 1 without one) and `kv_heads_local`, the KV heads per layer this rank's blocks hold
    (`None` for a pool built without a model). Block counts are this rank's; every rank's are the same.
    `kv_dtype` says how blocks store K/V and `block_bytes` what one block costs in memory, quantization scales
    included (`None` without a model); `kv_bytes_used` and `kv_bytes_total` follow from them."""

    tp_rank: int = 0
    tp_world_size: int = 1
    kv_heads_local: int | None = None
    kv_dtype: str = field(default="auto", repr=False)
    block_bytes: int | None = field(default=None, repr=False)

    @property
    def kv_bytes_used(self) -> int | None:
        """Memory of the blocks in use (`None` for a pool built without a model)."""
        return None if self.block_bytes is None else self.num_used * self.block_bytes

    @property
    def kv_bytes_total(self) -> int | None:
        """Memory of every block of the pool (`None` for a pool built without a model)."""
        return None if self.block_bytes is None else self.num_blocks * self.block_bytes


class BlockPool:
    """One `BlockAllocator` and the `KVStorage` its block ids index, shared by every `PagedCache` of a model.

    Args:
        num_blocks (`int`): physical blocks.
        block_size (`int`): tokens per block.
        kv_shape (`KVShape`, *optional*): the model's per-token KV cost, for byte accounting.
        layout (`KVLayout`, *optional*): the model's layer groups (default: one group, every block holds every
            layer).

    Example:

    ```python
    >>> pool = BlockPool(num_blocks=8, block_size=4)
    >>> table = pool.allocator.new_table()
    >>> _ = pool.allocator.append(table, 5)
    >>> pool.stats().num_used, pool.stats().waste_fraction
    (2, 0.375)
    >>> pool.allocator.free(table)
    >>> pool.check_invariants()

    ```
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_shape: KVShape | None = None,
        layout: KVLayout | None = None,
        sized_by: str | None = None,
        explicitly_sized: bool = True,
    ):
        split = layout is not None and layout.num_groups > 1
        fmt = FORMATS[kv_shape.kv_dtype] if kv_shape is not None else None
        lanes = layout.lane_of if split else None
        if fmt is not None and fmt.keys_per_channel:
            kv_shape = replace(kv_shape, block_size=block_size)
            companions = kv_shape.companions
            self.storage = StagedKVStorage(num_blocks, block_size, lanes, fmt, companions)
        else:
            companions = 0
            self.storage = KVStorage(num_blocks, block_size, lanes, fmt)
        self.allocator = BlockAllocator(num_blocks, block_size, companions)
        self.allocator.sized_by = sized_by
        self.kv_shape = kv_shape
        self.layout = layout
        self.last_cache_stats = None  # CacheStats of the most recently released PagedCache
        self.explicitly_sized = explicitly_sized  # by num_blocks, max_memory or memory_fraction (not the default)
        self._warned_smaller_than_default = False
        self._compute: tuple | None = None  # (weights' dtype, autocast dtype) the stored K/V were computed in
        self.offload = None  # KVOffload: tiers behind the prefix cache (hf_paged.offload), or None

    def set_offload(self, config) -> None:
        """Keep the prefix cache's blocks in the tiers `config` (an `OffloadConfig`, or `None`: no tiers) names from
        now on (see `hf_paged.offload.KVOffload`); the same config again keeps the tiers as they are."""
        from .offload import KVOffload

        if self.offload is not None and self.offload.config == config:
            return
        offload = None if config is None else KVOffload(config, self.block_size)
        with self.lock:
            previous, self.offload = self.offload, offload
        if previous is not None:
            previous.close()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def sized_by(self) -> str | None:
        """What set the pool's size: the call and option (`"Engine(num_blocks=8)"`,
        `"generate(cache_config={'max_memory': 1048576})"`) or `"the default sizing (...)"`; `None` when unknown."""
        return self.allocator.sized_by

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def lock(self) -> threading.RLock:
        return self.allocator.lock

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def kv_dtype(self) -> str:
        """How the blocks store K/V: `"auto"` (the model's dtype), `"int8"` or `"int4"` (see `hf_paged.kv_format`)."""
        return self.storage.format.name

    @property
    def tp_rank(self) -> int:
        """This process's rank in the model's tensor-parallel group (0 without tensor parallelism)."""
        return self.kv_shape.tp_rank if self.kv_shape is not None else 0

    @property
    def tp_world_size(self) -> int:
        """Processes sharing the model's heads (1 without tensor parallelism)."""
        return self.kv_shape.tp_world_size if self.kv_shape is not None else 1

    @property
    def kv_heads_local(self) -> int | None:
        """KV heads per layer this rank's blocks hold (`None` for a pool built without a model)."""
        return self.kv_shape.kv_heads_local if self.kv_shape is not None else None

    def stats(self) -> PoolStats:
        """The allocator's `AllocatorStats`, as a `PoolStats` that also says which rank's pool this is."""
        snapshot = self.allocator.stats()
        counts = {field.name: getattr(snapshot, field.name) for field in fields(AllocatorStats)}
        block_bytes = None if self.kv_shape is None else self.kv_shape.bytes_per_block_token * self.block_size
        return PoolStats(
            **counts,
            tp_rank=self.tp_rank,
            tp_world_size=self.tp_world_size,
            kv_heads_local=self.kv_heads_local,
            kv_dtype=self.kv_dtype,
            block_bytes=block_bytes,
        )

    def follow_model_dtype(self, model: torch.nn.Module) -> bool:
        """After `model.to(dtype)`, or entering or leaving `torch.autocast`: when no block is in use, drop the stored
        K/V tensors and the prefix cache (their lanes are allocated again, in the dtypes the model now produces, on
        the next write) and return `True`. With blocks in use nothing changes: the next write of another dtype
        raises a `ValueError` naming both."""
        if self.kv_shape is None:
            return False
        compute = (model_kv_dtype(model), autocast_dtype(model))
        if self._compute is None:
            self._compute = compute
        if compute == self._compute:
            return False
        with self.lock:
            if self.allocator.num_used:
                return False
            self.allocator.clear_prefix_cache()
            self.storage.clear()
            self.kv_shape = replace(self.kv_shape, dtype=compute[0])
            self._compute = compute
        logger.info("hf_paged: the model now computes in %s (autocast: %s): the idle pool's K/V were dropped", *compute)
        return True

    # ------------------------------------------------------------------ verbs over rows (each one atomic)
    def new_rows(self, count: int, num_groups: int, track_tokens: bool = True) -> list[Row]:
        """`count` rows holding no token, one block table per layer group."""
        with self.lock:
            return [Row.empty(self.allocator, num_groups, track_tokens) for _ in range(count)]

    def cached_prefix_row(
        self, roots: list[bytes], windows: list[int | None], tokens: list[int], count_reuse: bool = True
    ) -> Row:
        """A new row holding the longest cached prefix of `tokens` (see `Row.from_prefix_cache`), what the pool lacks
        of it loaded first from the tiers of `offload`, if any."""
        with self.lock:
            links = None
            if self.offload is not None and roots is not None:
                links = prefix_links(roots, tokens, self.block_size)  # hashed once for the load and the lookup
                self.offload.load(self, roots, windows, tokens, links)
            row = Row.from_prefix_cache(self.allocator, roots, windows, tokens, count_reuse, links)
            self._follow_staging()
            return row

    def take_blocks(self, appends: list[tuple[BlockTable, int]], what: str | None = None, keep_free: int = 0) -> int:
        """Append `(table, num_new_tokens)` for every entry, all of them or (`PoolExhaustedError`) none, leaving at
        least `keep_free` blocks free; the copy-on-write copies are carried out in the storage before it returns.
        Returns the number of blocks copied (the companions copied with an open block not counted)."""
        with self.lock:
            copies = self.allocator.append_all(appends, what, keep_free)
            self._follow_staging()
            self.storage.copy_blocks(copies)
            if not copies or not self.allocator.staging.enabled:
                return len(copies)
            companions = self.allocator.staging.owned()  # copied with their open blocks: not counted
            return sum(copy.src not in companions for copy in copies)

    def blocks_needed(self, appends: list[tuple[BlockTable, int]]) -> int:
        """Free blocks `take_blocks(appends)` would use now (copy-on-write included; with `"int4-channel"` pages, net
        of the companions the tables give back first, so possibly negative)."""
        return self.allocator.num_blocks_needed_for(appends)

    def count_prefix_reuse(self, num_tokens: int) -> None:
        """Count one prefix lookup whose caller reused `num_tokens` cached tokens (`stats().prefix_tokens_reused`)."""
        self.allocator.record_prefix_reuse(num_tokens)

    def fork_rows(self, rows: list[Row]) -> list[Row]:
        """New rows sharing every block of `rows` (refcounts + 1; nothing is copied)."""
        with self.lock:
            return [row.fork(self.allocator) for row in rows]

    def free_rows(self, rows: list[Row]) -> None:
        """Return every block of `rows` and empty the list (also the finalizer of a dropped cache)."""
        with self.lock:
            for row in rows:
                row.free(self.allocator)
            rows.clear()
            self._follow_staging()

    def free_skipped(self, rows: list[Row], windows: list[int | None]) -> int:
        """Give back every row's blocks its sliding groups' windows skipped; returns how many were given back."""
        if all(window is None for window in windows):
            return 0
        with self.lock:
            freed = sum(row.free_skipped(self.allocator, windows) for row in rows)
            self._follow_staging()
            return freed

    def index_full_blocks(self, rows: list[Row], roots: list[bytes], share: bool = True) -> bool:
        """Put the rows' full blocks into the prefix index (see `Row.cache_full_blocks`); returns whether a table
        changed."""
        with self.lock:
            changed = False
            links = [] if self.offload is not None else None
            for row in rows:
                changed |= row.cache_full_blocks(self.allocator, roots, share, links)
            if links:
                self.offload.record(self.storage, links)
            self._follow_staging()
            return changed

    def truncate_rows(self, rows: list[Row], length: int) -> None:
        """Keep the first `length` padded positions of every row."""
        with self.lock:
            try:
                for row in rows:
                    row.truncate(self.allocator, length)
            finally:
                self._follow_staging()

    def _follow_staging(self) -> None:
        """Let a format that keeps open blocks' keys in companion blocks follow the allocator's companions."""
        if self.allocator.staging.enabled:
            self.storage.apply_staging(self.allocator.staging)

    def check_invariants(self) -> None:
        self.allocator.check_invariants()

    def reset_peak(self) -> None:
        self.allocator.reset_peak()

    def clear_prefix_cache(self) -> None:
        """Forget cached prefixes. Changed weights are noticed without it (see `prefix.weights_key`), except an edit
        through `.data` of a few elements outside the sampled ones: call it after such an edit."""
        self.allocator.clear_prefix_cache()

    def __repr__(self) -> str:
        s = self.stats()
        kv = "" if self.kv_dtype == "auto" else f", kv_dtype={self.kv_dtype!r}"
        return f"BlockPool(num_blocks={s.num_blocks}, block_size={s.block_size}, used={s.num_used}{kv})"


_pools: weakref.WeakKeyDictionary[torch.nn.Module, BlockPool] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def _num_blocks_for_budget(kv_shape: KVShape, block_size: int, budget_bytes: int, source: str) -> int:
    bytes_per_block = kv_shape.bytes_per_block_token * block_size
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"{source} ({budget_bytes} bytes) is smaller than one KV block "
            f"({bytes_per_block} bytes = {block_size} tokens x {kv_shape.bytes_per_block_token} bytes per token)"
        )
    return num_blocks


def _default_budget(device: torch.device, config: PagedCacheConfig) -> tuple[int, str]:
    """The KV budget without `num_blocks` or `max_memory`: on CUDA a fraction of the device's free memory, read when
    the pool is made (so after the weights are on the device); elsewhere a fixed budget."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fraction = config.memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        return int(free * fraction), f"{fraction:.0%} of free CUDA memory"
    return DEFAULT_CPU_KV_BYTES, f"{DEFAULT_CPU_KV_BYTES / 2**30:g} GiB of KV on a CPU"


def _device_memory(device: torch.device) -> int | None:
    """Total memory of `device` in bytes (`None` where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def _check_fits(model: torch.nn.Module, num_blocks: int, block_size: int, kv_shape: KVShape, source: str) -> None:
    """Refuse an explicit pool size larger than the memory of the model's device."""
    device = next(model.parameters()).device
    total = _device_memory(device)
    needed = num_blocks * block_size * kv_shape.bytes_per_block_token
    if total is not None and needed > total:
        raise ValueError(
            f"{source} asks for {num_blocks} blocks x {block_size} tokens x {kv_shape.bytes_per_block_token} bytes = "
            f"{needed / 2**30:.1f} GiB of KV, more than the {total / 2**30:.1f} GiB of memory of {device}"
        )


@dataclass(frozen=True)
class _Sizing:
    num_blocks: int
    block_size: int
    kv_shape: KVShape
    sized_by: str  # what set the size, for messages
    explicit: bool  # num_blocks, max_memory or memory_fraction was given

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_shape.bytes_per_block_token


def gives_size(config: PagedCacheConfig) -> bool:
    """Whether `config` names the pool's size (`num_blocks`, `max_memory` or `memory_fraction`)."""
    return any(value is not None for value in (config.num_blocks, config.max_memory, config.memory_fraction))


def _sized_by(config: PagedCacheConfig, caller: str) -> str:
    """How a size given in `config` reads in messages, as the `caller` was called (`"Engine(num_blocks=8)"`)."""
    name = next(n for n in ("num_blocks", "max_memory", "memory_fraction") if getattr(config, n) is not None)
    value = getattr(config, name)
    if caller == "generate":
        return f"generate(cache_config={{{name!r}: {value!r}}})"
    return f"{caller}({'model, ' if caller == 'get_pool' else ''}{name}={value!r})"


def _size_pool(model: torch.nn.Module, config: PagedCacheConfig, layout: KVLayout, caller: str = "get_pool") -> _Sizing:
    device = next(model.parameters()).device
    block_size = config.block_size_on(device)
    kv_shape = KVShape.from_model(model, layout.lanes_per_block, config.resolved_kv_dtype, block_size)
    if config.num_blocks is not None:
        _check_fits(model, config.num_blocks, block_size, kv_shape, f"num_blocks={config.num_blocks}")
        return _Sizing(config.num_blocks, block_size, kv_shape, _sized_by(config, caller), True)
    if config.max_memory is not None:
        budget, source = config.max_memory, f"max_memory={config.max_memory}"
    else:
        budget, source = _default_budget(device, config)
        num_blocks = min(_num_blocks_for_budget(kv_shape, block_size, budget, source), DEFAULT_MAX_BLOCKS)
        if config.memory_fraction is not None and device.type == "cuda":
            return _Sizing(num_blocks, block_size, kv_shape, _sized_by(config, caller), True)
        sized_by = f"the default sizing ({source}, at most {DEFAULT_MAX_BLOCKS:,} blocks)"
        return _Sizing(num_blocks, block_size, kv_shape, sized_by, False)
    num_blocks = _num_blocks_for_budget(kv_shape, block_size, budget, source)
    _check_fits(model, num_blocks, block_size, kv_shape, source)
    return _Sizing(num_blocks, block_size, kv_shape, _sized_by(config, caller), True)


def _pool_matches(pool: BlockPool, config: PagedCacheConfig, num_blocks: int, block_size: int) -> bool:
    if config.block_size is not None and pool.block_size != block_size:
        return False
    if config.kv_dtype is not None and pool.kv_dtype != config.kv_dtype:
        return False
    explicit_size = config.num_blocks is not None or config.max_memory is not None
    return not explicit_size or pool.num_blocks == num_blocks


def get_pool(model: torch.nn.Module, *, caller: str = "get_pool", **cache_config) -> BlockPool:
    """The model's global `BlockPool`, created on first use.

    Sizing, in order: `num_blocks`; `max_memory` (bytes or `"512MiB"`); else, on CUDA, `memory_fraction` (0.9) of
    the device's free memory after the weights, and on CPU a fixed budget of 1 GiB (the default sizing takes at
    most 65,536 blocks; memory pages are touched only as blocks are first used). Asking again with a different
    `block_size`, `num_blocks` or `max_memory` rebuilds the pool when none of its blocks is in use and raises
    `ValueError` otherwise. A call that names no size keeps the pool as it is; when `caller` (who asks: `"generate"`,
    `"Engine"`, `"PagedCache"`) names no size and finds an idle pool sized explicitly below the default, a warning
    says so once (what set the size, and how to get the default back: `release_pool(model)`). `pool.sized_by`
    says what set the size. `kv_offload` attaches tiers that keep the prefix cache's blocks beyond the pool
    (`pool.offload`, see `hf_paged.offload`); a call that does not name it leaves the pool's tiers as they are.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=100))
    >>> pool = get_pool(model, block_size=8, num_blocks=64)
    >>> pool.num_blocks, pool.block_size, get_pool(model) is pool
    (64, 8, True)

    ```
    """
    config = cache_config.pop("config", None) or PagedCacheConfig.from_dict(cache_config)
    offload, config = config.kv_offload, replace(config, kv_offload=None)
    model = generating_model(model)
    with _pools_lock:
        pool = _get_pool(model, config, caller)
        if offload is not None:
            pool.set_offload(offload)
        return pool


def _get_pool(model: torch.nn.Module, config: PagedCacheConfig, caller: str) -> BlockPool:
    pool = _pools.get(model)
    if pool is not None:
        pool.follow_model_dtype(model)
    if pool is not None and config == PagedCacheConfig():
        return pool
    layout = KVLayout.for_model(model)
    sizing = _size_pool(model, config, layout, caller)
    num_blocks, block_size, kv_shape = sizing.num_blocks, sizing.block_size, sizing.kv_shape
    if pool is not None and _pool_matches(pool, config, num_blocks, block_size):
        if caller != "get_pool" and not gives_size(config):
            _warn_if_smaller_than_default(pool, sizing, caller)
        return pool
    if pool is not None and pool.allocator.num_used:
        raise ValueError(
            f"the model's KV pool has block_size={pool.block_size}, num_blocks={pool.num_blocks}, "
            f"kv_dtype={pool.kv_dtype!r} and {pool.allocator.num_used} blocks in use; it cannot be rebuilt as "
            f"block_size={block_size}, num_blocks={num_blocks}, kv_dtype={kv_shape.kv_dtype!r} until every "
            "PagedCache using it is released"
        )
    previous = pool
    pool = BlockPool(num_blocks, block_size, kv_shape, layout, sizing.sized_by, sizing.explicit)
    pool.follow_model_dtype(model)  # records what its K/V will be computed in
    if previous is not None and previous.offload is not None:  # the tiers outlive a rebuild of the pool
        pool.set_offload(previous.offload.config)
    logger.info(
        "hf_paged: pool of %d blocks x %d tokens (%.1f MiB of %s KV, %d layer group(s), %d KV heads) for %s%s",
        num_blocks,
        block_size,
        num_blocks * block_size * kv_shape.bytes_per_block_token / 2**20,
        kv_shape.kv_dtype,
        layout.num_groups,
        kv_shape.kv_heads_local,
        type(model).__name__,
        f" on tensor-parallel rank {kv_shape.tp_rank} of {kv_shape.tp_world_size}"
        if kv_shape.tp_world_size > 1
        else "",
    )
    _pools[model] = pool
    return pool


def _warn_if_smaller_than_default(pool: BlockPool, default: _Sizing, caller: str) -> None:
    """Once per pool: a call naming no size runs on an idle pool that an earlier call sized below the default."""
    if pool._warned_smaller_than_default or not pool.explicitly_sized or pool.allocator.num_used:
        return
    pool_bytes = pool.stats().kv_bytes_total
    if pool_bytes is None or pool_bytes >= default.kv_bytes:
        return
    pool._warned_smaller_than_default = True
    logger.warning(
        "hf_paged: %s names no pool size and runs on the model's idle KV pool of %d blocks (%.1f MiB), sized by %s; "
        "the default sizing would give %.1f MiB. Requests that cannot fit it are refused before they run. For the "
        "default size call hf_paged.release_pool(model) (the next call builds a pool of the default size), or give "
        "a size: cache_config={'num_blocks': ...} or {'max_memory': ...}",
        caller,
        pool.num_blocks,
        pool_bytes / 2**20,
        pool.sized_by,
        default.kv_bytes / 2**20,
    )


def release_pool(model: torch.nn.Module) -> None:
    """Forget the model's pool (its memory goes when the last cache using it is gone)."""
    with _pools_lock:
        _pools.pop(generating_model(model), None)


def generating_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model that runs `generate` for `model`: a PEFT `PeftModel` hands its calls to its base
    model, whose pool it shares; any other model is its own."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and type(model).__module__.startswith("peft."):
        return get_base_model()
    return model


def live_pools() -> list[BlockPool]:
    """Every pool whose model is still alive (for checks and dashboards)."""
    with _pools_lock:
        return list(_pools.values())
