"""A real `redis-server` on a free loopback port, started and stopped by the test that needs it."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def redis_server(directory):
    """Yields the URL of a fresh `redis-server` (no persistence, its files in `directory`); skips the test where
    `redis-server` or the `redis` client is missing (`.ci/run` installs both)."""
    pytest.importorskip("redis")
    import redis

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    command = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen([*command, "--dir", str(directory)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)
