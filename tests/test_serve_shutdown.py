"""`hf-paged serve` at its limits: an answer that outgrows the KV pool ends with its text and `finish_reason:
"length"`, and SIGINT gives in-flight requests a bounded grace period, then aborts them (each stream gets a final
error event), frees every block and exits 0 without a traceback."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .serve_helpers import API_KEY, TINY, ServerProcess, save_tiny_model, wait_for_idle, wait_for_running

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GRACE_S = 3.0
pytestmark = pytest.mark.slow  # three server starts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def start(tiny_dir, *options: str) -> ServerProcess:
    return ServerProcess(tiny_dir, "--served-model-name", TINY, "--api-key", API_KEY, "--exact", *options)


# ---------------------------------------------------------------------------------------------- 5: pool outgrown
@pytest.fixture(scope="module")
def small_pool(tiny_dir):
    process = start(tiny_dir, "--num-blocks", "8", "--block-size", "16")  # 128 tokens in all
    yield process.base
    process.close()


def greedy(tiny_dir, prompt_ids: list[int], new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False)  # fmt: skip
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_answer_outgrowing_the_pool_ends_with_length_and_keeps_its_text(tiny_dir, small_pool, stream):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompt = "A story that does not fit:"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = greedy(tiny_dir, prompt_ids, 128 - len(prompt_ids) + 1)  # the pool holds 128 positions
    client = openai.OpenAI(base_url=f"{small_pool}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    options = dict(model=TINY, prompt=prompt, max_tokens=500, temperature=0, extra_body={"min_tokens": 500})
    if stream:
        chunks = list(client.completions.create(**options, stream=True))
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        reply = client.completions.create(**options)
        text, reason = reply.choices[0].text, reply.choices[0].finish_reason
        assert reply.usage.completion_tokens == len(expected)
    assert reason == "length" and text == tokenizer.decode(expected)
    wait_for_idle(small_pool, timeout=5)


def test_two_answers_outgrowing_the_pool_together_both_keep_their_text(tiny_dir, small_pool):
    client = openai.OpenAI(base_url=f"{small_pool}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    reply = client.completions.create(model=TINY, prompt="Two stories:", n=2, max_tokens=500, temperature=0,
                                      extra_body={"min_tokens": 500})  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompt_ids = tokenizer("Two stories:", add_special_tokens=False)["input_ids"]
    expected = tokenizer.decode(greedy(tiny_dir, prompt_ids, 128 - len(prompt_ids) + 1))
    for choice in reply.choices:  # one was preempted and recomputed; each ends when the pool cannot hold more
        assert choice.finish_reason == "length" and len(choice.text) > 20 and expected.startswith(choice.text)
    wait_for_idle(small_pool, timeout=5)


# ---------------------------------------------------------------------------------------------- 4: shutdown
def collect_stream(base: str, events: list, index: int) -> None:
    body = {"model": TINY, "prompt": f"Story {index}:", "max_tokens": 3000, "min_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=HEADERS, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[len("data: ") :]))


def run_streams(base: str, count: int):
    events = [[] for _ in range(count)]
    threads = [threading.Thread(target=collect_stream, args=(base, events[i], i)) for i in range(count)]
    for thread in threads:
        thread.start()
    wait_for_running(base, count)
    return threads, events


def test_sigint_with_four_streams_waits_the_grace_period_then_aborts_and_exits_cleanly(tiny_dir):
    process = start(tiny_dir, "--num-blocks", "1024", "--shutdown-grace", str(GRACE_S), "--log-level", "info")
    threads, events = run_streams(process.base, 4)
    answer = {}

    def ask():  # a non-streaming request in flight too
        body = {"model": TINY, "prompt": "Essay:", "max_tokens": 3000, "min_tokens": 3000}
        answer["response"] = httpx.post(f"{process.base}/v1/completions", json=body, headers=HEADERS, timeout=60)

    threads.append(threading.Thread(target=ask))
    threads[-1].start()
    wait_for_running(process.base, 5)
    interrupted = time.monotonic()
    process.interrupt()
    time.sleep(0.5)  # draining: the server still listens, and says it is leaving (it once closed the socket at once)
    health = httpx.get(f"{process.base}/health", timeout=5)
    late = httpx.post(f"{process.base}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2},
                      headers=HEADERS, timeout=5)  # fmt: skip
    code = process.process.wait(timeout=GRACE_S + 5)
    exited = time.monotonic() - interrupted
    for thread in threads:
        thread.join(timeout=5)
    output = process.close()
    assert code == 0 and exited < GRACE_S + 5, (code, exited, output)
    assert "Traceback" not in output and "stopped; 0 KV blocks in use" in output, output
    assert (health.status_code, health.json()) == (503, {"status": "shutting_down"})
    assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutdown"
    assert answer["response"].status_code == 503
    assert answer["response"].json()["error"]["code"] == "server_shutdown"
    for stream in events:
        last_time, last = stream[-1]
        error = json.loads(last)["error"]
        assert error["code"] == "server_shutdown" and error["type"] == "server_error"
        assert any(t > interrupted + GRACE_S - 0.5 for t, e in stream[:-1])  # tokens kept coming during the grace
        assert GRACE_S - 0.5 < last_time - interrupted < GRACE_S + 5


def test_sigint_when_idle_exits_at_once(tiny_dir):
    process = start(tiny_dir, "--num-blocks", "64", "--shutdown-grace", "60", "--log-level", "info")
    interrupted = time.monotonic()
    process.interrupt()
    code = process.process.wait(timeout=10)
    output = process.close()
    assert code == 0 and time.monotonic() - interrupted < 5 and "Traceback" not in output, output


def test_a_second_sigint_aborts_at_once_without_a_traceback(tiny_dir):
    process = start(tiny_dir, "--num-blocks", "1024", "--shutdown-grace", "60", "--log-level", "info")
    threads, events = run_streams(process.base, 2)
    interrupted = time.monotonic()
    process.interrupt()
    time.sleep(0.5)
    process.interrupt()
    code = process.process.wait(timeout=10)
    for thread in threads:
        thread.join(timeout=5)
    output = process.close()
    assert code == 0 and time.monotonic() - interrupted < 10
    assert "Traceback" not in output and "stopped; 0 KV blocks in use" in output, output
    assert all(json.loads(stream[-1][1])["error"]["code"] == "server_shutdown" for stream in events)
