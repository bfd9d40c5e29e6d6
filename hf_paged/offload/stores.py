"""Byte stores behind the prefix cache: one small interface (`get` / `put` / `contains` / `delete`, values as bytes,
keys as hex strings), each store bounded in bytes and dropping its least recently used entries.

- `MemoryStore`: this process's memory.
- `DirectoryStore`: one file per block in a local directory, written to a temporary name and renamed, so a reader
  never sees half a file; several processes may share the directory.
- `RedisStore`: a Redis server, shared by every process (and machine) that names it; budget and recency kept in
  Redis itself by two small server-side scripts, so concurrent writers agree.

A store raises `OSError` (or the Redis client's `ConnectionError`) where its medium fails; the tier that owns it
switches itself off (`hf_paged.offload.tiers`).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict

from ..sizes import format_bytes

SUFFIX = ".safetensors"
_TEMP_PREFIX = ".tmp-"


class BlockStore:
    """The interface: bytes under hex keys, at most `max_bytes` of them."""

    name = "store"

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.evictions = 0

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """`get` of every key, in order (a remote store asks in one round trip)."""
        return [self.get(key) for key in keys]

    def put(self, key: str, value: bytes) -> bool:
        """Store `value` under `key`; returns whether bytes were written (False: held already, or over budget)."""
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def entries(self) -> int:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class MemoryStore(BlockStore):
    """Bytes in this process's memory, least recently used dropped first.

    Example:

    ```python
    >>> store = MemoryStore(max_bytes=10)
    >>> store.put("a", b"12345"), store.put("b", b"12345"), store.get("a") is not None
    (True, True, True)
    >>> store.put("c", b"12345")  # over budget: "b" (least recently used) goes
    True
    >>> store.contains("b"), store.entries(), store.evictions
    (False, 2, 1)

    ```
    """

    name = "host"

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes)
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            return False
        with self._lock:
            old = self._values.pop(key, None)
            self._bytes += len(value) - (len(old) if old is not None else 0)
            self._values[key] = value
            while self._bytes > self.max_bytes:
                _, dropped = self._values.popitem(last=False)
                self._bytes -= len(dropped)
                self.evictions += 1
        return True

    def contains(self, key: str) -> bool:
        return key in self._values

    def delete(self, key: str) -> None:
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._bytes -= len(value)

    def entries(self) -> int:
        return len(self._values)

    def nbytes(self) -> int:
        return self._bytes

    def describe(self) -> str:
        return f"host memory ({format_bytes(self.max_bytes)})"


class DirectoryStore(BlockStore):
    """One file a key, `DIR/ab/abcd....safetensors`, written as `.tmp-*` and renamed into place (a reader never
    sees half a file; a process killed while writing leaves only a temporary name, never read and removed at the next
    start). Recency is the file's modification time, touched on every hit. The budget is held by this process over the
    files it finds at start and those it writes; when over, it lists the directory again (other processes write
    there too) and removes the oldest files down to 90% of the budget.

    Args:
        path (`str`): the directory (created if missing; refused with `ValueError` where it cannot be written).
        max_bytes (`int`): the budget.

    Example:

    ```python
    >>> import tempfile
    >>> store = DirectoryStore(tempfile.mkdtemp(), max_bytes=2**20)
    >>> store.put("ab01", b"K/V bytes")
    True
    >>> store.get("ab01"), store.entries()
    (b'K/V bytes', 1)

    ```
    """

    name = "disk"

    def __init__(self, path: str, max_bytes: int):
        super().__init__(max_bytes)
        self.path = os.path.abspath(os.path.expanduser(path))
        check_writable_directory(self.path)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._rescan(remove_temporary=True)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key[:2], key + SUFFIX)

    def _rescan(self, remove_temporary: bool = False) -> None:
        """Read the directory's files, oldest first (another process may have added or removed some)."""
        found = []
        for sub in os.scandir(self.path):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.startswith(_TEMP_PREFIX):
                    if remove_temporary and _older_than(entry, 3600):  # a writer killed over an hour ago
                        _remove(entry.path)
                    continue
                if entry.name.endswith(SUFFIX):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    found.append((stat.st_mtime, entry.name[: -len(SUFFIX)], stat.st_size))
        found.sort()
        self._sizes = OrderedDict((key, size) for _, key, size in found)
        self._bytes = sum(self._sizes.values())

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            with open(path, "rb") as handle:
                value = handle.read()
            os.utime(path)
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
            else:  # written by another process since the last listing
                self._sizes[key] = len(value)
                self._bytes += len(value)
        return value

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            return False
        path = self._file(key)
        if os.path.exists(path):  # keys are content addresses: the same bytes (a bad copy is rejected on read)
            os.utime(path)
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = os.path.join(os.path.dirname(path), f"{_TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        try:
            with open(temporary, "wb") as handle:
                handle.write(value)
            os.replace(temporary, path)
        except BaseException:
            _remove(temporary)
            raise
        with self._lock:
            self._forget(key)
            self._sizes[key] = len(value)
            self._bytes += len(value)
            if self._bytes > self.max_bytes:
                self._rescan()
                self._shrink(int(self.max_bytes * 0.9))
        return True

    def _shrink(self, target: int) -> None:
        while self._bytes > target and self._sizes:
            key, size = self._sizes.popitem(last=False)
            self._bytes -= size
            _remove(self._file(key))
            self.evictions += 1

    def _forget(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._bytes -= size

    def contains(self, key: str) -> bool:
        return os.path.exists(self._file(key))

    def delete(self, key: str) -> None:
        _remove(self._file(key))
        with self._lock:
            self._forget(key)

    def entries(self) -> int:
        return len(self._sizes)

    def nbytes(self) -> int:
        return self._bytes

    def describe(self) -> str:
        return f"directory {self.path} ({format_bytes(self.max_bytes)})"


# KEYS: the entry, the recency sorted set, the byte counter. ARGV: value, now, budget. Stores a new value (an existing
# one is only touched), then drops the least recently used entries while the store holds more than its budget.
_PUT = """
local written = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('INCRBY', KEYS[3], string.len(ARGV[1]))
  written = 1
end
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local evicted = 0
while total > tonumber(ARGV[3]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  local size = redis.call('STRLEN', oldest[1])
  redis.call('DEL', oldest[1])
  redis.call('ZREM', KEYS[2], oldest[1])
  total = redis.call('DECRBY', KEYS[3], size)
  evicted = evicted + 1
end
return {evicted, written}
"""

# KEYS: the entry, the recency set, the byte counter. Removes the entry and its bytes, if present.
_DELETE = """
local size = redis.call('STRLEN', KEYS[1])
if redis.call('DEL', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[3], size) end
redis.call('ZREM', KEYS[2], KEYS[1])
return size
"""


class RedisStore(BlockStore):
    """Entries in a Redis database, `hf_paged:kv:<key>`, with their recency in a sorted set and their total bytes in
    a counter, both updated by server-side scripts with each write (atomic: replicas writing at once agree on the
    budget). Refused with `ValueError` at construction when the server cannot be reached.

    Args:
        url (`str`): `redis://HOST:PORT/DB` (see `redis.Redis.from_url`).
        max_bytes (`int`): the budget of the entries this store writes.
    """

    name = "remote"
    PREFIX = "hf_paged:kv:"

    def __init__(self, url: str, max_bytes: int, timeout: float = 5.0):
        super().__init__(max_bytes)
        try:
            import redis
        except ImportError as error:
            raise ImportError("kv_offload remote needs the redis client: pip install 'hf-paged[offload]'") from error
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            self.client.ping()
        except redis.RedisError as error:
            raise ValueError(f"kv_offload remote={url!r} cannot be reached: {error}") from error
        self._recency = self.PREFIX + "lru"
        self._bytes_key = self.PREFIX + "bytes"
        self._put = self.client.register_script(_PUT)
        self._delete = self.client.register_script(_DELETE)

    def _keys(self, key: str) -> list[str]:
        return [self.PREFIX + key, self._recency, self._bytes_key]

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self.PREFIX + key for key in keys]
        pipe = self.client.pipeline(transaction=False)
        pipe.mget(names)
        now = time.time()
        pipe.zadd(self._recency, dict.fromkeys(names, now), xx=True)  # only entries that exist are touched
        values, _ = pipe.execute()
        return values

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            return False
        evicted, written = self._put(keys=self._keys(key), args=[value, time.time(), self.max_bytes])
        self.evictions += int(evicted)
        return bool(written)

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self.PREFIX + key))

    def delete(self, key: str) -> None:
        self._delete(keys=self._keys(key))

    def entries(self) -> int:
        return int(self.client.zcard(self._recency))

    def nbytes(self) -> int:
        return int(self.client.get(self._bytes_key) or 0)

    def describe(self) -> str:
        return f"Redis {self.url} ({format_bytes(self.max_bytes)})"


def check_writable_directory(path: str) -> None:
    """Create `path` if missing and write a probe file there; `ValueError` naming the path and the reason if not."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f"{_TEMP_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex}")
        with open(probe, "wb") as handle:
            handle.write(b"hf_paged")
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"kv_offload dir={path!r} cannot be written: {error.strerror or error}") from error


def _older_than(entry: os.DirEntry, seconds: float) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > seconds
    except FileNotFoundError:
        return False


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
