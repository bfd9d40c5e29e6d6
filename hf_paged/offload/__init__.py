"""The prefix cache beyond memory: blocks kept in host memory, a local directory and a shared Redis, keyed to be
valid across processes and machines, and loaded back into the pool on a prefix hit (see docs/design.md, "Beyond
memory")."""

from .codec import CorruptBlockError
from .config import OffloadConfig
from .keys import persistent_root, weights_digest
from .stores import BlockStore, DirectoryStore, MemoryStore, RedisStore
from .tiers import KVOffload, OffloadStats, TierStats

__all__ = [
    "BlockStore",
    "CorruptBlockError",
    "DirectoryStore",
    "KVOffload",
    "MemoryStore",
    "OffloadConfig",
    "OffloadStats",
    "RedisStore",
    "TierStats",
    "persistent_root",
    "weights_digest",
]
