"""`hf-paged serve --tp 2` on a tiny Llama with 4 KV heads (SmolLM2's tokenizer) on CPU: the command starts both
ranks itself, rank 0 answers the real `openai` client (plain and streaming) with the single-process Engine's greedy
tokens, `/metrics` shows both ranks, SIGTERM stops every rank and frees the port, a killed rank stops the whole
server with an error, and bad `--tp` values are refused before any rank starts."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

import hf_paged
from hf_paged.reference_models import tiny_model
from hf_paged.serve.cli import main
from tests.distributed_helpers import gloo_available
from tests.serve_helpers import ServerProcess, metric, save_tiny_model, wait_for_idle

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with the gloo backend")

OPTIONS = ("--tp", "2", "--block-size", "4", "--num-blocks", "128", "--tp-timeout", "20")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("serve_tp") / "tiny4", num_key_value_heads=4)


@pytest.fixture(scope="module")
def server(folder):
    process = ServerProcess(folder, *OPTIONS)
    yield process
    process.close()


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_openai_client_gets_the_single_process_greedy_tokens(server, folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = [504, 3458, 282, 4649, 314]
    reply = client.completions.create(model="tiny4", prompt=prompt, max_tokens=10, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = hf_paged.Engine(
        AutoModelForCausalLM.from_pretrained(folder), tokenizer, block_size=4, num_blocks=64, exact=True
    )
    expected = engine.generate([prompt], max_new_tokens=10, do_sample=False)[0]
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)

    chat = client.chat.completions.create(
        model="tiny4", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, seed=3, n=2
    )
    assert len(chat.choices) == 2 and all(c.finish_reason in ("length", "stop") for c in chat.choices)

    chunks = list(client.completions.create(model="tiny4", prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert wait_for_idle(server.base) < 10


def test_metrics_show_every_rank(server):
    assert metric(server.base, "hf_paged_tp_world_size") == 2
    for rank in (0, 1):
        assert metric(server.base, f'hf_paged_rank_kv_blocks_used{{rank="{rank}"}}') == 0
        assert metric(server.base, f'hf_paged_rank_kv_bytes_total{{rank="{rank}"}}') > 0
    text = httpx.get(f"{server.base}/metrics", timeout=5).text
    assert text.count("# TYPE hf_paged_rank_kv_usage_ratio gauge") == 1


def test_sigterm_stops_every_rank_and_frees_the_port(server):
    ranks = children(server.process.pid)
    assert len(ranks) == 2 and all(alive(pid) for pid in ranks)
    started = time.monotonic()
    output = server.close()
    assert server.process.returncode == 0, output
    assert time.monotonic() - started < 30
    assert not any(alive(pid) for pid in ranks)
    assert port_is_free(server.port)


def test_a_killed_rank_stops_the_server_with_an_error(folder):
    server = ServerProcess(folder, *OPTIONS)
    try:
        ranks = children(server.process.pid)
        assert len(ranks) == 2
        follower = max(ranks)  # started second: rank 1
        killed = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        server.process.wait(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        output = server.close()
    assert server.process.returncode == 1, output
    assert "rank 1 exited with status -9; stopping the other ranks" in output
    assert not any(alive(pid) for pid in ranks)
    assert port_is_free(server.port)


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        ("0", "argument --tp: must be an integer >= 1 (1: no tensor parallelism), got 0"),
        ("3", "--tp 3 does not divide the model's 4 KV heads (num_key_value_heads); use one of 1, 2, 4"),
        ("8", "--tp 8 is more than the model's 4 KV heads (num_key_value_heads): every rank needs at least one"),
    ],
)
def test_bad_degrees_are_refused_before_any_rank_starts(folder, capsys, tp, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(folder), "--tp", tp])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tensor_parallelism_without_a_distributed_launch_is_refused(monkeypatch):
    from hf_paged.engine.distributed import init_distributed

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="tensor parallelism needs a distributed launch: RANK, WORLD_SIZE"):
        init_distributed()


def test_a_zero_group_timeout_is_refused(folder, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(folder), "--tp", "2", "--tp-timeout", "0"])
    assert "argument --tp-timeout: the timeout must be > 0 seconds, got 0" in capsys.readouterr().err


def test_degrees_are_checked_against_every_layers_kv_heads_in_a_heterogeneous_config(tmp_path, capsys):
    """Gemma 4's full-attention layers have 1 KV head where its sliding layers have 2 (a heterogeneous config:
    transformers' `per_layer_config`, whose head counts cannot be read globally): --tp 2 is refused for the 1."""
    tiny_model("gemma4").config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path), "--tp", "2"])
    assert exit_info.value.code == 2
    assert "--tp 2 is more than the model's 1 KV heads (num_key_value_heads)" in capsys.readouterr().err
