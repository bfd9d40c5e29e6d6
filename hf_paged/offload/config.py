"""`kv_offload` options: which tiers keep prefix-cache blocks beyond the pool, and how many bytes each may hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from urllib.parse import urlparse

from ..sizes import parse_memory

DEFAULT_DISK_BYTES = 10 * 1024**3
DEFAULT_REMOTE_BYTES = 4 * 1024**3
REMOTE_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class OffloadConfig:
    """Where blocks the prefix cache indexes are kept beyond the pool, as `kv_offload={...}` of `cache_config`,
    `Engine(kv_offload=...)` or `hf-paged serve --kv-offload-*`. Tiers are searched in this order: host memory, the
    directory, the remote store. Every tier holds at most its bytes and drops its least recently used entries.

    Args:
        dir (`str`, *optional*): a local directory of safetensors files (created if missing).
        disk_bytes (`int | str`, *optional*): the directory's budget (default 10GiB), e.g. `"20GiB"`.
        remote (`str`, *optional*): a Redis URL, `redis://HOST:PORT/DB` (or `rediss://`, `unix://`).
        remote_bytes (`int | str`, *optional*): what this store may hold in Redis (default 4GiB).
        host_bytes (`int | str`, *optional*): a tier in this process's memory (for pools on an accelerator: on a
            CPU the pool itself is host memory, and more pool blocks serve better).

    Example:

    ```python
    >>> config = OffloadConfig.from_dict({"dir": "/tmp/kv", "disk_bytes": "20GiB"})
    >>> config.disk_bytes, config.tiers
    (21474836480, ('disk',))

    ```
    """

    dir: str | None = None
    disk_bytes: int | None = None
    remote: str | None = None
    remote_bytes: int | None = None
    host_bytes: int | None = None

    @classmethod
    def from_dict(cls, options) -> OffloadConfig | None:
        """The config of `kv_offload` options (a dict or an `OffloadConfig`); `None` or `{}`: no tiers."""
        if options is None or isinstance(options, OffloadConfig):
            return options if options is None or options.tiers else None
        if not isinstance(options, Mapping):
            raise TypeError(f"kv_offload must be a dict such as {{'dir': PATH}}, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kv_offload key(s) {unknown}; hf_paged understands {sorted(known)}")
        values = dict(options)
        for name in ("disk_bytes", "remote_bytes", "host_bytes"):
            if values.get(name) is not None:
                values[name] = parse_memory(values[name], f"kv_offload {name}")
        for name in ("dir", "remote"):
            if values.get(name) is not None and not isinstance(values[name], str):
                raise TypeError(f"kv_offload {name} must be a string, got {values[name]!r}")
        config = cls(**values)
        if config.disk_bytes is not None and config.dir is None:
            raise ValueError(f"kv_offload disk_bytes={config.disk_bytes} needs a directory: give 'dir' too")
        if config.remote_bytes is not None and config.remote is None:
            raise ValueError(f"kv_offload remote_bytes={config.remote_bytes} needs a Redis URL: give 'remote' too")
        if config.remote is not None:
            scheme = urlparse(config.remote).scheme
            if scheme not in REMOTE_SCHEMES:
                raise ValueError(
                    f"kv_offload remote={config.remote!r} is not a Redis URL; use redis://HOST:PORT/DB "
                    f"(schemes: {', '.join(REMOTE_SCHEMES)})"
                )
        return config if config.tiers else None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers configured, in lookup order."""
        named = (("host", self.host_bytes), ("disk", self.dir), ("remote", self.remote))
        return tuple(name for name, value in named if value is not None)

    @property
    def resolved_disk_bytes(self) -> int:
        return self.disk_bytes if self.disk_bytes is not None else DEFAULT_DISK_BYTES

    @property
    def resolved_remote_bytes(self) -> int:
        return self.remote_bytes if self.remote_bytes is not None else DEFAULT_REMOTE_BYTES
