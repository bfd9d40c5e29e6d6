"""hf_paged: PagedAttention for Hugging Face transformers.

`import hf_paged` registers the `"hf_paged"` attention and makes `model.generate(..., cache_implementation="paged")`
run on a `PagedCache` backed by the model's global block pool.
"""

from .accounting import Footprint, naive_footprint, paged_footprint
from .allocator import AllocatorStats, BlockAllocator, BlockCopy, BlockTable
from .attention import ATTENTION_NAME, paged_attention_forward
from .cache import CacheStats, PagedCache
from .config import PagedCacheConfig, parse_memory
from .engine import Engine, EngineStats, RequestOutput, SamplingParams
from .errors import InvariantError, PoolExhaustedError
from .generation import attention_implementation, disable, enable, is_enabled
from .groups import KVLayout, LayerGroup
from .layer import PagedLayer
from .pool import BlockPool, KVShape, get_pool, live_pools, release_pool
from .storage import KVStorage

__version__ = "0.1.0"

enable()

__all__ = [
    "ATTENTION_NAME",
    "AllocatorStats",
    "BlockAllocator",
    "BlockCopy",
    "BlockPool",
    "BlockTable",
    "CacheStats",
    "Engine",
    "EngineStats",
    "Footprint",
    "InvariantError",
    "LayerGroup",
    "KVLayout",
    "KVShape",
    "KVStorage",
    "PagedCache",
    "PagedCacheConfig",
    "PagedLayer",
    "PoolExhaustedError",
    "RequestOutput",
    "SamplingParams",
    "attention_implementation",
    "disable",
    "enable",
    "get_pool",
    "is_enabled",
    "live_pools",
    "naive_footprint",
    "paged_attention_forward",
    "paged_footprint",
    "parse_memory",
    "release_pool",
]
