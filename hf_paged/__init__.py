"""hf_paged: PagedAttention for Hugging Face transformers.

`import hf_paged` registers the `"hf_paged"` attention and makes `model.generate(..., cache_implementation="paged")`
run on a `PagedCache` backed by the model's global block pool.

The names below are what users call: the cache, the pool and its allocator, the cache options, the Engine, the
errors, and pictures of the pool. Plumbing stays importable from its module (`hf_paged.attention`,
`hf_paged.forward`, `hf_paged.storage`, `hf_paged.groups`, `hf_paged.accounting`, ...).
"""

from .allocator import AllocatorStats, BlockAllocator, BlockTable
from .cache import CacheStats, PagedCache
from .config import PagedCacheConfig
from .engine import Engine, EngineStats, RequestOutput, SamplingParams
from .errors import InvariantError, PoolExhaustedError, RequestTooLargeError
from .generation import compiled_decode_of, disable, enable, is_enabled
from .pool import BlockPool, get_pool, live_pools, release_pool
from .visual import plot_pool, render_pool_text

__version__ = "0.1.0"

enable()

__all__ = [
    "AllocatorStats",
    "BlockAllocator",
    "BlockPool",
    "BlockTable",
    "CacheStats",
    "Engine",
    "EngineStats",
    "InvariantError",
    "PagedCache",
    "PagedCacheConfig",
    "PoolExhaustedError",
    "RequestOutput",
    "RequestTooLargeError",
    "SamplingParams",
    "compiled_decode_of",
    "disable",
    "enable",
    "get_pool",
    "is_enabled",
    "live_pools",
    "plot_pool",
    "release_pool",
    "render_pool_text",
]
