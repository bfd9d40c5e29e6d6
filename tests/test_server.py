"""`hf-paged serve`: the real server in a subprocess on a loopback port, spoken to with the official `openai`
client (and raw HTTP for what the client cannot send)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from hf_paged.reference_models import smollm2_path

from .serve_helpers import API_KEY, ServerProcess, metric, wait_for_idle

MODEL = "smollm2"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    options = ("--served-model-name", MODEL, "--num-blocks", "256", "--block-size", "16", "--api-key", API_KEY)
    process = ServerProcess(smollm2_path(), "--exact", *options)
    yield process.base
    process.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def reference(smollm2, prompt_ids: list[int], max_new_tokens: int) -> str:
    model, tokenizer = smollm2
    output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True)


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server}/metrics").text
    for name in ("kv_blocks_used", "kv_blocks_free", "kv_usage_ratio", "kv_waste_ratio", "prefix_hit_ratio",
                 "preemptions_total", "requests_running", "requests_waiting", "generation_tokens_total"):  # fmt: skip
        assert f"\nhf_paged_{name} " in text
    assert metric(server, "hf_paged_kv_blocks_total") == 256


def test_metrics_count_steps_by_kind_and_pad_positions(server, client):
    prompts = ["Say yes.", "Name a colour, then a fruit, then an animal."]  # different lengths, served together
    callers = [
        threading.Thread(target=client.completions.create, kwargs={"model": MODEL, "prompt": p, "max_tokens": 4})
        for p in prompts
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    wait_for_idle(server)
    kinds = {kind: metric(server, f'hf_paged_engine_steps_by_kind_total{{kind="{kind}"}}') for kind in STEP_KINDS}
    assert sum(kinds.values()) == metric(server, "hf_paged_engine_steps_total") and kinds["prefill"] >= 1
    assert metric(server, "hf_paged_positions_computed_total") > 0
    assert metric(server, "hf_paged_pad_positions_total") == 0  # packed steps: prompts of different lengths, no pad


STEP_KINDS = ("prefill", "decode", "mixed")


def test_completion_is_greedy_generate(smollm2, client):
    prompt = "The three primary colours are"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    prompt_ids = smollm2[1](prompt, add_special_tokens=False)["input_ids"]
    assert reply.choices[0].text == reference(smollm2, prompt_ids, 12)
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_and_streaming_chat_are_greedy_generate(smollm2, client):
    content = "What is a page table? Answer in one sentence."
    messages = [{"role": "user", "content": content}]
    expected = reference(smollm2, chat_ids(smollm2[1], content), 20)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and len(chunks) > 3


EMOJI_PROMPT = "I love pizza 🍕🍕🍕 and sushi 🍣🍣"  # SmolLM2 answers with pizzas: 3 byte-level tokens each


def test_logprobs_of_tokens_holding_part_of_a_character(smollm2, client):
    """OpenAI's contract: a token's `bytes` are its own UTF-8 bytes (concatenated, the text's bytes), a token that
    is no whole character shows as `bytes:\\xNN...`, and completions' `text_offset`s index the returned text."""
    tokenizer = smollm2[1]
    prompt_ids = tokenizer(EMOJI_PROMPT)["input_ids"]
    expected = reference(smollm2, prompt_ids, 12)
    assert "\U0001f355" in expected  # the case under test: pizzas split over several tokens each
    reply = client.completions.create(model=MODEL, prompt=EMOJI_PROMPT, max_tokens=12, temperature=0, logprobs=1)
    choice = reply.choices[0]
    text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    assert text == expected and len(tokens) == len(offsets) == 12
    assert any(token.startswith("bytes:\\x") for token in tokens)
    assert offsets == sorted(offsets) and all(0 <= offset <= len(text) for offset in offsets)
    for token, offset in zip(tokens, offsets):  # a whole-character token's text is where its offset points
        if not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token
    rebuilt = bytes(int(part, 16) for token in tokens if token.startswith("bytes:") for part in token[8:].split("\\x"))
    assert "\U0001f355".encode() in rebuilt
    messages = [{"role": "user", "content": "Reply with three pizza emoji: 🍕🍕🍕"}]
    options = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**options).choices[0]
    chunks = list(client.chat.completions.create(**options, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for content, entries in [(whole.message.content, whole.logprobs.content), (None, streamed)]:
        content = (
            content if content is not None else "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        )
        assert any(e.token.startswith("bytes:") for e in entries), [e.token for e in entries]
        text_bytes = b"".join(bytes(e.bytes) for e in entries if e.token != tokenizer.eos_token)
        assert text_bytes.decode("utf-8") == content
        for entry in entries:
            assert all(bytes(a.bytes).decode("utf-8", "replace") == a.token or a.token.startswith("bytes:")
                       for a in entry.top_logprobs)  # fmt: skip


def test_n_choices_with_a_seed_are_reproducible(client):
    options = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9, "n": 2, "seed": 7}
    first = client.completions.create(**options)
    second = client.completions.create(**options)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_stop_strings_cut_the_text(smollm2, client):
    prompt = "Count: one, two, three,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stop = full[4:6]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert reply.choices[0].text == full[: full.index(stop)] and reply.choices[0].finish_reason == "stop"


def test_a_stop_string_holding_a_special_token_is_a_bad_request(client):
    """It could never match the text (special tokens are skipped); the 400 names the id to end on instead."""
    with pytest.raises(openai.BadRequestError, match=r"special token '<\|im_end\|>' \(id 2\).*eos_token_id=2"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stop=["<|im_end|>"])
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text is not None


def test_32_concurrent_streaming_clients_share_the_batch(server, client):
    results, errors = {}, []

    def ask(index: int):
        try:
            stream = client.completions.create(
                model=MODEL, prompt=f"Fact number {index}:", max_tokens=8, temperature=0, stream=True
            )
            results[index] = "".join(chunk.choices[0].text for chunk in stream)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    peak = 0.0
    while any(t.is_alive() for t in threads):
        peak = max(peak, metric(server, "hf_paged_requests_running"))
        time.sleep(0.05)
    assert not errors and len(results) == 32
    assert peak > 1  # requests were decoded together
    wait_for_idle(server)


NAME = {"type": "string", "maxLength": 40}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": NAME},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
JOBS = ["teacher", "pilot", "baker", "nurse", "farmer", "painter", "chef", "doctor", "singer", "writer", "plumber",
        "dancer", "lawyer", "sailor", "poet", "driver", "tailor", "miner", "judge", "actor"]  # fmt: skip


def test_20_of_20_json_schema_replies_validate(server, client):
    """SmolLM2 asked for a person as JSON, 20 clients at once with OpenAI's `response_format` json_schema: every
    reply parses and validates (without the schema 6 of these 20 do: benchmarks/structured_outputs.py)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(job: str) -> str:
        content = f"Invent a {job} and give their name, age and city as a JSON object."
        messages = [{"role": "user", "content": content}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                               response_format=response_format)  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=len(JOBS)) as pool:
        replies = list(pool.map(ask, JOBS))
    for reply in replies:
        jsonschema.validate(json.loads(reply), PERSON)
    wait_for_idle(server)


def test_a_required_tool_call_names_the_tool_and_its_argument(client):
    """SmolLM2 asked for the weather with two tools and `tool_choice: "required"`: one call of the right tool with the
    city of the question (greedy), parsed into `tool_calls`."""
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
    zone = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                               "parameters": zone}}]  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                           temperature=0, max_tokens=80)  # fmt: skip
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_client_disconnect_aborts_its_request(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 2000,
        "min_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }  # fmt: skip  (forced long: end-of-sequence suppressed)
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"text": ""' not in line:
                break  # leave after the first token
    wait_for_idle(server, timeout=2)  # 2,000 tokens of SmolLM2 take minutes here


def test_a_non_streaming_client_that_gives_up_has_its_request_aborted(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Write a long essay about memory.", "max_tokens": 2000, "min_tokens": 2000,
            "temperature": 0}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=1.5)
    wait_for_idle(server, timeout=2)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("{not json", 400, "not valid JSON"),
        ('{"model": "smollm2", "prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 3}, 400, "temperature"),
        ({"model": MODEL, "prompt": list(range(10, 8300))}, 400, "context window of 8192 tokens"),
        ({"model": MODEL, "prompt": list(range(10, 5000)), "max_tokens": 1}, 400, "pool has 256"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "the prompt is empty"),
    ],
    ids=[
        "malformed-json",
        "lone-surrogate",
        "unknown-model",
        "negative-max-tokens",
        "bad-temperature",
        "over-context",
        "over-pool",
        "missing-prompt",
        "empty-prompt",
    ],  # fmt: skip
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, message):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, str) else None
    response = httpx.post(
        f"{server}/v1/completions", content=content, json=None if content else body, headers=headers, timeout=60
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).choices
    wait_for_idle(server)


def test_a_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(f"{server}/v1/models").status_code == 401


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["default", "no-prefix-caching"])
def test_no_prefix_caching_serves_every_prompt_in_full(tmp_path, prefix_caching):
    """`--no-prefix-caching`: the second identical prompt reuses no block (its answer cannot depend on the first);
    by default it does."""
    from .serve_helpers import save_tiny_model

    options = ("--block-size", "4", "--num-blocks", "256") + (() if prefix_caching else ("--no-prefix-caching",))
    process = ServerProcess(save_tiny_model(tmp_path / "tiny"), "--exact", *options)
    try:
        body = {"model": "tiny", "prompt": " ".join(["pages"] * 24), "max_tokens": 2, "temperature": 0}
        texts = [httpx.post(f"{process.base}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
        assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
        wait_for_idle(process.base)
        assert (metric(process.base, "hf_paged_prefix_hit_ratio") > 0) == prefix_caching
        assert (metric(process.base, "hf_paged_kv_blocks_cached") > 0) == prefix_caching
    finally:
        process.close()
