"""Shared pieces of the server tests: a tiny random model saved with SmolLM2's tokenizer (so chat templates and
text work, and every forward is fast), the real `hf-paged serve` in a subprocess on a free loopback port, and
readers for `/metrics`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hf_paged.reference_models import smollm2_path, tiny_model

from .distributed_helpers import PORT_ATTEMPTS, free_port, lost_its_port

API_KEY = "test-key"
TINY = "tiny"
TINY_CONTEXT = 8192


def save_tiny_model(folder: Path, add_bos: bool = False, **overrides) -> Path:
    """A 2-layer Llama of width 64 with SmolLM2's 49,152-token vocabulary and tokenizer (end of sequence: id 2,
    `<|im_end|>`), context 8,192, saved in `folder`; `overrides` are config options (`num_key_value_heads=4`).
    With `add_bos`, the tokenizer puts its BOS token (`<|im_start|>`, id 1) before every text it tokenizes with
    special tokens, as Llama's, Mistral's and Gemma's tokenizers do (a template post-processor)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    if add_bos:
        bos = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)]
        )
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=TINY_CONTEXT, **overrides)
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class ServerProcess:
    """`python -m hf_paged.serve serve MODEL ...` on a free loopback port; `base` is its URL.

    A port is picked free and bound later by the server, so another process (a tensor-parallel rank's connection, a
    parallel test) can take it in between: a server that exits because its address is in use is started again on
    another port, up to `PORT_ATTEMPTS` times."""

    def __init__(self, model_path: Path, *options: str, env: dict | None = None, timeout_s: float = 180):
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.port = free_port()
            self.base = f"http://127.0.0.1:{self.port}"
            command = [sys.executable, "-m", "hf_paged.serve", "serve", str(model_path), "--port", str(self.port)]
            command += ["--log-level", "warning", *options]
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
            )
            output = self._wait_until_up(timeout_s)
            if output is None:
                return
            if not lost_its_port(output) or attempt == PORT_ATTEMPTS:
                pytest.fail(f"the server exited: {output}")

    def _wait_until_up(self, timeout_s: float) -> str | None:
        """None once `/health` answers; the server's output if it exited first."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                return self.process.stdout.read()
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return None
            except httpx.HTTPError:
                time.sleep(0.3)
        self.process.kill()
        pytest.fail(f"the server did not come up within {timeout_s} s")

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    def close(self) -> str:
        """Stop the server (SIGTERM, then SIGKILL after 30 s); returns its output."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.stdout.read()


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_for_idle(base: str, timeout: float = 30) -> float:
    """Seconds until no request runs or waits and every block is free; fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (
            metric(base, "hf_paged_kv_blocks_used") == 0
            and metric(base, "hf_paged_requests_running") == 0
            and metric(base, "hf_paged_requests_waiting") == 0
        ):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(
        f"not idle after {timeout} s: {metric(base, 'hf_paged_requests_running')} running, "
        f"{metric(base, 'hf_paged_kv_blocks_used')} blocks used"
    )


def wait_for_running(base: str, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(base, "hf_paged_requests_running") >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests were not running within {timeout} s")
