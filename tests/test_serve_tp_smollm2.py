"""`hf-paged serve --tp 3` on SmolLM2-135M (3 KV heads, 9 attention heads: 1 KV head per rank) on CPU: the `openai`
client gets the single-process Engine's greedy answer, plain and streamed, and SIGTERM stops every rank. Three ranks
of a 135M model take about 45 s on a 2-core machine, hence `slow`."""

from __future__ import annotations

import openai
import pytest

from hf_paged.engine import Engine
from hf_paged.reference_models import smollm2_path
from tests.distributed_helpers import gloo_available
from tests.serve_helpers import ServerProcess, metric
from tests.test_serve_tp import alive, children

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with the gloo backend"),
]

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_three_ranks_answer_like_one_process(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    engine = Engine(model, tokenizer, block_size=16, num_blocks=64, progress=False, exact=True)
    expected = engine.generate([prompt], max_new_tokens=12, do_sample=False)[0]
    server = ServerProcess(smollm2_path(), "--tp", "3", "--block-size", "16", "--num-blocks", "64",
                           "--served-model-name", "smol")  # fmt: skip
    try:
        ranks = children(server.process.pid)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == expected.text
        assert "Paris" in expected.text
        stream = client.chat.completions.create(
            model="smol", messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
        assert metric(server.base, "hf_paged_tp_world_size") == 3
        assert metric(server.base, 'hf_paged_rank_kv_bytes_total{rank="2"}') > 0
    finally:
        output = server.close()
    assert server.process.returncode == 0, output
    assert len(ranks) == 3 and not any(alive(pid) for pid in ranks)
