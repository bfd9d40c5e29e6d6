"""The prefix cache beyond memory on SmolLM2-135M: a restarted process loads a 2,048-token prefix from the disk tier,
and two `hf-paged serve` processes share one Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from hf_paged.reference_models import smollm2_path

from .redis_helpers import redis_server
from .serve_helpers import ServerProcess

pytestmark = pytest.mark.slow

_PROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    from pydoc_data.topics import topics
    from transformers import DynamicCache
    from hf_paged import get_pool
    from hf_paged.reference_models import load_smollm2

    model, tokenizer = load_smollm2()
    text = "\\n\\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text).input_ids[:2048] + tokenizer("\\n\\nWhat is this about? Answer:").input_ids
    prompt = torch.tensor([ids])
    config = {"block_size": 16, "max_memory": "512MiB", "kv_offload": {"dir": sys.argv[1]}}
    paged = model.generate(
        prompt, max_new_tokens=12, do_sample=False, cache_implementation="paged", cache_config=config
    )[0, prompt.shape[1]:].tolist()
    offload = get_pool(model).offload
    offload.flush()
    result = {"paged": paged, "loaded": offload.stats().tokens_loaded, "prompt": prompt.shape[1]}
    if sys.argv[2] == "reference":
        stock = model.generate(prompt, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache())
        result["stock"] = stock[0, prompt.shape[1]:].tolist()
    print(json.dumps(result))
    """
)


def _process(directory, role: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROCESS, str(directory), role], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_restarted_process_loads_a_long_prefix_from_disk(tmp_path):
    first = _process(tmp_path, "reference")
    assert first["loaded"] == 0
    assert first["paged"] == first["stock"]  # the K/V written are those of an exact run
    second = _process(tmp_path, "load")
    assert second["loaded"] >= 0.9 * second["prompt"]
    assert second["loaded"] == (second["prompt"] - 1) // 16 * 16
    assert second["paged"] == first["stock"]


def _tier_metric(base: str, name: str, tier: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'{name}{{tier="{tier}"}} '):
            return float(line.split()[1])
    raise KeyError(name)


def test_two_servers_share_one_redis(tmp_path):
    from pydoc_data.topics import topics

    prompt = "\n\n".join(topics[name] for name in sorted(topics))[:4000] + "\n\nSummary:"
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    with redis_server(tmp_path) as url:
        options = ("--exact", "--served-model-name", "m", "--num-blocks", "256", "--kv-offload-remote", url)
        servers = []
        try:
            for _ in range(2):
                servers.append(ServerProcess(smollm2_path(), *options))
            first, second = servers
            answer_a = httpx.post(f"{first.base}/v1/completions", json=body, timeout=300).json()
            prompt_tokens = answer_a["usage"]["prompt_tokens"]
            assert prompt_tokens > 500
            deadline = 60
            start = time.monotonic()  # server A writes in the background: wait until its blocks are all in Redis
            while _tier_metric(first.base, "hf_paged_kv_tier_entries", "remote") < prompt_tokens // 16:
                assert time.monotonic() - start < deadline
                time.sleep(1.1)
            answer_b = httpx.post(f"{second.base}/v1/completions", json=body, timeout=300).json()
            loaded = _tier_metric(second.base, "hf_paged_kv_tier_tokens_loaded_total", "remote")
            assert loaded >= 0.9 * prompt_tokens
            assert _tier_metric(first.base, "hf_paged_kv_tier_tokens_loaded_total", "remote") == 0
            assert answer_b["choices"][0]["text"] == answer_a["choices"][0]["text"]
        finally:
            for server in servers:
                server.close()
