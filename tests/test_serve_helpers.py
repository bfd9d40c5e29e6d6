"""The server tests' own harness: a server whose port was taken between picking and binding is started again."""

from __future__ import annotations

import socket

import httpx

from . import serve_helpers
from .serve_helpers import ServerProcess, save_tiny_model


def test_a_server_whose_port_is_taken_starts_again_on_another(tmp_path, monkeypatch):
    folder = save_tiny_model(tmp_path / "tiny")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real_free_port = serve_helpers.free_port
        monkeypatch.setattr(serve_helpers, "free_port", lambda: next(ports, None) or real_free_port())
        server = ServerProcess(folder, "--num-blocks", "16", "--exact")
        try:
            assert server.port != busy
            assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
        finally:
            server.close()
