"""`hf-paged serve` under real clients, on a tiny random model with SmolLM2's tokenizer (every forward takes
milliseconds): the OpenAI options it implements match stock `generate` (`output_logits`, DynamicCache, fp32), the
ones it cannot honour get a 400 naming the field, errors keep OpenAI's format, a client that leaves aborts its
requests at once, request bodies are bounded, and `/health` and `/metrics` never wait for a running step."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from .serve_helpers import API_KEY, TINY, TINY_CONTEXT, ServerProcess, metric, save_tiny_model, wait_for_idle

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 3000, "min_tokens": 3000}  # forced long: end-of-sequence suppressed, minutes of decoding


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(tiny_dir):
    options = ["--served-model-name", TINY, "--num-blocks", "1024", "--max-prefill-tokens", "8192"]
    options += ["--exact"]  # eager steps: answers compared with generate's
    process = ServerProcess(tiny_dir, *options, env={"HF_PAGED_API_KEY": API_KEY})  # the key from the environment
    yield process.base
    process.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_model(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(autouse=True)
def idle_after(request):
    """Every test leaves the server idle with every block free."""
    yield
    if "server" in request.fixturenames:
        wait_for_idle(request.getfixturevalue("server"), timeout=10)


# ---------------------------------------------------------------------------------------------- the reference
class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency/presence penalties and logit bias, written from the API reference for stock generate:
    `logit[j] += bias[j] - count[j] * frequency - (count[j] > 0) * presence` over generated tokens."""

    def __init__(self, prompt_length: int, frequency: float = 0.0, presence: float = 0.0, bias: dict | None = None):
        self.prompt_length, self.frequency, self.presence, self.bias = prompt_length, frequency, presence, bias or {}

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[0, int(token)] += value
        for token in set(input_ids[0, self.prompt_length :].tolist()):
            count = int((input_ids[0, self.prompt_length :] == token).sum())
            scores[0, token] -= count * self.frequency + self.presence
        return scores


def reference(model, prompt_ids: list[int], new_tokens: int, **penalties):
    """Greedy stock `generate` (DynamicCache) of exactly `new_tokens` tokens: `(token ids, raw log-softmax rows)`."""
    processors = LogitsProcessorList([OpenAIPenalties(len(prompt_ids), **penalties)] if penalties else [])
    output = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=processors,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = output.sequences[0, len(prompt_ids) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), dim=-1) for step in output.logits]


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text_ids(tokenizer, text)


def check_logprobs(tokens, logprob_rows, got_tokens, got_logprobs, got_tops):
    """`got_*` (token ids, their log-probabilities, `[(id, logprob), ...]` alternatives) against the reference."""
    assert got_tokens == tokens
    for row, token, logprob, top in zip(logprob_rows, tokens, got_logprobs, got_tops):
        assert logprob == pytest.approx(float(row[token]), abs=1e-4)
        expected = row.topk(len(top))
        assert [t for t, _ in top] == expected.indices.tolist()
        assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=1e-4)


# ---------------------------------------------------------------------------------------------- 6: options
def test_completion_logprobs_match_generate(client, reference_model):
    model, tokenizer = reference_model
    prompt = "The paging of memory"
    tokens, rows = reference(model, text_ids(tokenizer, prompt), 6)
    reply = client.completions.create(model=TINY, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                      extra_body={"min_tokens": 6})  # fmt: skip
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(tokens) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in tokens]
    tops = []
    for row, token, entry in zip(rows, tokens, lp.top_logprobs):  # the top 3, plus the chosen token if not among them
        best = row.topk(3).indices.tolist()
        assert list(entry) == [tokenizer.decode([t]) for t in best + ([token] if token not in best else [])]
        tops.append(list(zip(best, list(entry.values())[:3])))
    check_logprobs(tokens, rows, tokens, lp.token_logprobs, tops)
    assert lp.text_offset == [len(tokenizer.decode(tokens[:i])) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bos-model"), add_bos=True)


def test_a_completion_prompt_gets_the_tokenizers_special_tokens(bos_dir):
    """A tokenizer that adds BOS (as Llama's, Mistral's, Gemma's do): `/v1/completions` serves what
    `tokenizer(prompt)` + stock `generate` answers, BOS included; chat keeps the template's tokens alone."""
    model = AutoModelForCausalLM.from_pretrained(bos_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(bos_dir)
    prompt = "The capital of France is"
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs["input_ids"][0, 0] == tokenizer.bos_token_id  # the tokenizer adds BOS
    expected = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)[
        0, inputs["input_ids"].shape[1] :
    ]
    messages = [{"role": "user", "content": "What is a page table?"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected_chat = model.generate(torch.tensor([chat_ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    server = ServerProcess(bos_dir, "--served-model-name", TINY, "--num-blocks", "64", "--exact")
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(
            model=TINY, prompt=prompt, max_tokens=8, temperature=0, extra_body={"min_tokens": 8}
        )
        assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
        assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        chat = client.chat.completions.create(
            model=TINY, messages=messages, max_tokens=5, temperature=0, extra_body={"min_tokens": 5}
        )
        assert chat.usage.prompt_tokens == len(chat_ids)  # no second BOS before the template's own tokens
        assert chat.choices[0].message.content == tokenizer.decode(
            expected_chat[0, len(chat_ids) :], skip_special_tokens=True
        )
    finally:
        server.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_match_generate(client, reference_model, stream):
    model, tokenizer = reference_model
    content = "What is a page table?"
    tokens, rows = reference(model, chat_prompt_ids(tokenizer, content), 7)
    options = dict(model=TINY, messages=[{"role": "user", "content": content}], max_tokens=7, temperature=0,
                   logprobs=True, top_logprobs=4, extra_body={"min_tokens": 7})  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**options, stream=True))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = client.chat.completions.create(**options).choices[0]
        entries, text = choice.logprobs.content, choice.message.content
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    by_text = {tokenizer.decode([t]): t for row in rows for t in row.topk(4).indices.tolist()}
    by_text |= {tokenizer.decode([t]): t for t in tokens}
    got_tokens = [by_text[e.token] for e in entries]
    tops = [[(by_text[a.token], a.logprob) for a in e.top_logprobs] for e in entries]
    assert all(len(top) == 4 for top in tops) and entries[0].bytes == list(entries[0].token.encode())
    check_logprobs(tokens, rows, got_tokens, [e.logprob for e in entries], tops)


PENALTIES = {
    "frequency": {"frequency_penalty": -2.0},  # negative: repeating is rewarded, so the option visibly matters
    "presence": {"presence_penalty": -2.0},
    "frequency-counts": {"frequency_penalty": 1.0, "presence_penalty": -1.5},  # a 2nd repeat is penalised
    "positive": {"frequency_penalty": 2.0, "presence_penalty": 2.0},
    "logit-bias": {"logit_bias": {"42": 100.0, "43": 5.0}},
}


@pytest.mark.parametrize("options", PENALTIES.values(), ids=PENALTIES.keys())
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_penalties_and_logit_bias_match_generate(client, reference_model, options, endpoint):
    model, tokenizer = reference_model
    content = "Once upon a time"
    prompt_ids = chat_prompt_ids(tokenizer, content) if endpoint == "chat" else text_ids(tokenizer, content)
    plain, _ = reference(model, prompt_ids, 12)
    penalties = {
        "frequency": options.get("frequency_penalty", 0.0),
        "presence": options.get("presence_penalty", 0.0),
        "bias": options.get("logit_bias"),
    }
    expected, rows = reference(model, prompt_ids, 12, **penalties)
    if options != PENALTIES["positive"]:
        assert expected != plain  # ignoring the option would give the plain greedy answer
    common = dict(model=TINY, max_tokens=12, temperature=0, extra_body={"min_tokens": 12}, **options)
    if endpoint == "chat":
        messages = [{"role": "user", "content": content}]
        choice = client.chat.completions.create(messages=messages, logprobs=True, **common)
        got = [e.token for e in choice.choices[0].logprobs.content]
        logprobs = [e.logprob for e in choice.choices[0].logprobs.content]
    else:
        choice = client.completions.create(prompt=content, logprobs=0, **common)
        got, logprobs = choice.choices[0].logprobs.tokens, choice.choices[0].logprobs.token_logprobs
    assert got == [tokenizer.decode([t]) for t in expected]
    assert logprobs == pytest.approx([float(row[t]) for row, t in zip(rows, expected)], abs=1e-4)  # raw logits


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompt_kind", ["text", "token-ids"])
def test_echo_puts_the_prompt_before_the_answer(client, reference_model, stream, prompt_kind):
    model, tokenizer = reference_model
    text = "Echo this prompt"
    prompt = text if prompt_kind == "text" else text_ids(tokenizer, text)
    tokens, _ = reference(model, text_ids(tokenizer, text), 5)
    options = dict(model=TINY, prompt=prompt, max_tokens=5, temperature=0, echo=True, extra_body={"min_tokens": 5})
    if stream:
        answer = "".join(c.choices[0].text for c in client.completions.create(**options, stream=True))
    else:
        answer = client.completions.create(**options).choices[0].text
    assert answer == text + tokenizer.decode(tokens)
    only_prompt = client.completions.create(model=TINY, prompt=prompt, max_tokens=0, echo=True)
    assert only_prompt.choices[0].text == text and only_prompt.usage.completion_tokens == 0


def test_streamed_chunks_with_a_stop_string_keep_pace_with_their_tokens(client):
    """With `stop` set, a chunk holds back only an end of the text that could still begin a stop string, so each
    chunk's text is its tokens' text (it once held back as many characters as the longest stop string, less one)."""
    options = dict(model=TINY, prompt="The paging of memory", max_tokens=12, temperature=0, logprobs=0,
                   stop=["\u2603\u2603\u2603\u2603"], extra_body={"min_tokens": 12}, stream=True)  # fmt: skip
    chunks = [chunk.choices[0] for chunk in client.completions.create(**options) if chunk.choices]
    tokens = [token for choice in chunks if choice.logprobs for token in choice.logprobs.tokens]
    assert len(tokens) == 12 and not any(token.startswith("bytes:") for token in tokens)
    assert [choice.text for choice in chunks if choice.logprobs] == [
        "".join(choice.logprobs.tokens) for choice in chunks if choice.logprobs
    ]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_include_usage_sends_a_final_usage_chunk(client, chat):
    options = dict(model=TINY, max_tokens=6, temperature=0, n=2, extra_body={"min_tokens": 6})
    if chat:
        messages = [{"role": "user", "content": "Count to three."}]
        whole = client.chat.completions.create(messages=messages, **options)
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **options))  # fmt: skip
    else:
        whole = client.completions.create(prompt="Count to three:", **options)
        chunks = list(client.completions.create(prompt="Count to three:", stream=True,
                                                stream_options={"include_usage": True}, **options))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == 12
    assert all(chunk.usage is None for chunk in chunks[:-1])
    plain = list(client.completions.create(model=TINY, prompt="Hi", max_tokens=2, stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in plain)


REFUSED = {  # field -> extra body; each needs a 400 naming that field
    "tool_choice": {"tool_choice": "auto"},
    "functions": {"functions": [{"name": "f", "parameters": {}}]},
    "function_call": {"function_call": "auto"},
    "top_logprobs": {"top_logprobs": 2},  # without logprobs
    "stream_options": {"stream_options": {"include_usage": True}},  # without stream
    "modalities": {"modalities": ["audio"]},
    "messages.0.content": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
}


@pytest.mark.parametrize("param", REFUSED, ids=REFUSED.keys())
def test_options_that_cannot_be_honoured_get_a_400_naming_the_field(client, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **REFUSED[param]}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY, messages=messages, max_tokens=2, extra_body=body)
    assert caught.value.param == param and caught.value.status_code == 400


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of"), ({"echo": True, "logprobs": 2}, "logprobs")],
    ids=["suffix", "best_of", "echo-with-logprobs"],
)
def test_completion_options_that_cannot_be_honoured_get_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY, prompt="hi", max_tokens=2, extra_body=extra)
    assert caught.value.param == param


def test_response_format_text_is_accepted(client):
    reply = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           response_format={"type": "text"})  # fmt: skip
    assert reply.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------- 7: errors
ERRORS = {
    "lone-surrogate": ("chat", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                       "messages.0.content"),
    "surrogate-key": ("completions", '{"model": "tiny", "prompt": "hi", "\\ud800": 1}', "\\ud800"),
    "malformed-json": ("completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 34', None),
    "seed-2**64": ("completions", json.dumps({"model": TINY, "prompt": "hi", "seed": 2**64}), "seed"),
    "1000-stop-strings": ("completions", json.dumps({"model": TINY, "prompt": "hi", "stop": ["x"] * 1000}), "stop"),
    "logit-bias-range": ("completions", json.dumps({"model": TINY, "prompt": "hi", "logit_bias": {"5": 101}}),
                         "logit_bias"),
    "logit-bias-token": ("completions", json.dumps({"model": TINY, "prompt": "hi", "logit_bias": {"99999": 1}}),
                         "logit_bias"),
    "min-tokens": ("completions", json.dumps({"model": TINY, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}),
                   "min_tokens"),
    "not-an-object": ("completions", "[1, 2]", None),
    # each of these was a 500 once
    "logit-bias-superscript-digit": ("chat", json.dumps({"model": TINY, "messages": [{"role": "user", "content": "hi"}],
                                                         "logit_bias": {"\u00b2": 1}}), "logit_bias"),
    "nested-10000-deep": ("completions", '{"model": "tiny", "prompt": "hi", "x": %s}' % ("[" * 10000 + "]" * 10000),
                          None),
    "5000-digit-integer": ("completions", '{"model": "tiny", "prompt": "hi", "max_tokens": %s}' % ("9" * 5000), None),
    "echo-negative-token-id": ("completions", json.dumps({"model": TINY, "prompt": [-1], "echo": True}), "prompt"),
    "echo-token-id-2**63": ("completions", json.dumps({"model": TINY, "prompt": [2**63], "echo": True}), "prompt"),
    "string-for-an-integer": ("completions", json.dumps({"model": TINY, "prompt": "hi", "max_tokens": "3"}),
                              "max_tokens"),
    # NaN is no JSON, but Python's parser reads it: refused as not a number (once: "must be <= 2")
    "nan-temperature": ("completions", '{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    "infinite-top-p": ("chat", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
                       "top_p"),
    # a prompt that leaves no room for an answer is the prompt's fault, not max_tokens' (once named max_tokens)
    "prompt-over-the-context": ("completions", json.dumps({"model": TINY, "prompt": [5] * (TINY_CONTEXT + 8)}),
                                "prompt"),
    "chat-over-the-context": ("chat", json.dumps({"model": TINY, "messages": [{"role": "user",
                                                                                "content": "hi " * TINY_CONTEXT}]}),
                              "messages"),
    # OpenAI refuses max_tokens 0 for chat (completions take it: the echoed prompt alone)
    "chat-max-tokens-0": ("chat", json.dumps({"model": TINY, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 0}), "max_tokens"),
    "chat-max-completion-tokens-0": ("chat", json.dumps({"model": TINY, "messages": [{"role": "user",
                                                                                       "content": "hi"}],
                                                         "max_completion_tokens": 0}), "max_completion_tokens"),
}  # fmt: skip


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_bad_requests_get_a_400_in_openai_format(server, client, case):
    endpoint, content, param = case
    path = "chat/completions" if endpoint == "chat" else "completions"
    response = httpx.post(f"{server}/v1/{path}", content=content, timeout=10,
                          headers={**HEADERS, "Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]
    if param is not None:
        assert param in error["message"]
    assert client.completions.create(model=TINY, prompt="Hi", max_tokens=2, temperature=0).choices  # still serving


def test_a_seed_in_int64_range_is_used_and_reproducible(client):
    options = dict(model=TINY, prompt="Once", max_tokens=5, temperature=1.0, n=2, seed=2**63 - 1)
    first, second = client.completions.create(**options), client.completions.create(**options)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # seeds 2**63 - 1 and 2**63 differ


def test_null_fields_take_their_defaults(server, reference_model):
    model, tokenizer = reference_model
    prompt_ids = text_ids(tokenizer, "Once upon a time")
    tokens, _ = reference(model, prompt_ids, 4)
    reply = httpx.post(f"{server}/v1/completions", headers=HEADERS, timeout=30, json={
        "model": TINY, "prompt": prompt_ids, "max_tokens": 4, "min_tokens": 4, "temperature": 0, "top_p": None,
        "n": None, "stream": None, "echo": None, "frequency_penalty": None, "presence_penalty": None,
    })  # fmt: skip
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len(choices) == 1 and choices[0]["text"] == tokenizer.decode(tokens)


# ---------------------------------------------------------------------------------------------- 8: API key
def test_the_api_key_is_read_from_the_environment(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=TINY, prompt="hi", max_tokens=2)
    assert httpx.get(f"{server}/v1/models").json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models", headers=HEADERS).json()["data"][0]["id"] == TINY
    lowercase = {"Authorization": f"bearer {API_KEY}"}  # the scheme is case-insensitive (RFC 9110)
    assert httpx.get(f"{server}/v1/models", headers=lowercase).json()["data"][0]["id"] == TINY
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": API_KEY}).status_code == 401


# ---------------------------------------------------------------------------------------------- 1: disconnects
def read_tokens_then_leave(server: str, body: dict, count: int) -> None:
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=HEADERS, timeout=30) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data:") and '"text": ""' not in line:
                seen += 1
                if seen >= count:
                    return  # closes the connection mid-generation


def test_ten_streams_closed_after_three_tokens_are_aborted_within_two_seconds(server):
    body = {"model": TINY, "prompt": "Tell me a very long story.", "temperature": 0, "stream": True, **LONG}
    threads = [threading.Thread(target=read_tokens_then_leave, args=(server, body, 3)) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert wait_for_idle(server, timeout=2) < 2  # 3,000 forced tokens each would take far longer


def test_an_n3_stream_closed_early_aborts_all_three(server, client):
    stream = client.completions.create(model=TINY, prompt="Three long stories:", n=3, temperature=0.8, stream=True,
                                       max_tokens=3000, extra_body={"min_tokens": 3000})  # fmt: skip
    indexes = set()
    for chunk in stream:
        indexes.add(chunk.choices[0].index)
        if len(indexes) == 3:
            break
    assert metric(server, "hf_paged_requests_running") == 3
    stream.close()
    assert wait_for_idle(server, timeout=2) < 2


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_non_streaming_client_that_times_out_has_its_requests_aborted(server, n, chat):
    impatient = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=1.0)
    common = dict(model=TINY, n=n, temperature=0, max_tokens=3000, extra_body={"min_tokens": 3000})
    with pytest.raises(openai.APITimeoutError):
        if chat:
            impatient.chat.completions.create(messages=[{"role": "user", "content": "Write an essay."}], **common)
        else:
            impatient.completions.create(prompt="Write an essay about memory.", **common)
    assert wait_for_idle(server, timeout=2) < 2


# ---------------------------------------------------------------------------------------------- 2, 3: bounds, health
def poll_health(server: str, stop: threading.Event, latencies: list[float], starts: list[float] | None = None):
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            for path in ("/health", "/metrics"):
                start = time.perf_counter()
                assert http.get(f"{server}{path}").status_code == 200
                latencies.append(time.perf_counter() - start)
                if starts is not None:
                    starts.append(start)
            time.sleep(0.01)


def test_a_50mb_body_gets_413_at_once_while_health_keeps_answering(server):
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=poll_health, args=(server, stop, latencies))
    poller.start()
    try:
        time.sleep(0.2)
        start = time.perf_counter()
        response = httpx.post(f"{server}/v1/completions", content=b"x" * 50_000_000, timeout=30,
                              headers={**HEADERS, "Content-Type": "application/json"})  # fmt: skip
        elapsed = time.perf_counter() - start

        def chunks():  # no Content-Length: the limit is counted as the bytes arrive
            for _ in range(100):
                yield b"y" * 100_000

        chunked = httpx.post(f"{server}/v1/completions", content=chunks(), headers=HEADERS, timeout=30)
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    assert response.status_code == 413 and elapsed < 1, (response.status_code, elapsed)
    error = response.json()["error"]
    assert error["code"] == "body_too_large" and "limit of 4194304 bytes" in error["message"]
    assert chunked.status_code == 413
    assert len(latencies) > 10 and max(latencies) < 0.1, max(latencies)


def test_a_prompt_evidently_over_the_context_is_refused_before_tokenizing(server):
    start = time.perf_counter()
    response = httpx.post(
        f"{server}/v1/completions", headers=HEADERS, timeout=30, json={"model": TINY, "prompt": "ab " * 1_200_000}
    )  # 3.6 MB, under the body limit
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert time.perf_counter() - start < 1.5  # tokenizing 3.6 MB takes several seconds
    messages = [{"role": "user", "content": "ab " * 1_200_000}]
    response = httpx.post(f"{server}/v1/chat/completions", headers=HEADERS, timeout=30,
                          json={"model": TINY, "messages": messages})  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_health_and_metrics_answer_during_a_long_prefill(server):
    steps_before = metric(server, "hf_paged_engine_steps_total")
    body = {"model": TINY, "prompt": list(range(1000, 9000)), "max_tokens": 1, "temperature": 0}
    result = {}

    def ask():
        result["start"] = time.perf_counter()
        result["status"] = httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS, timeout=120).status_code
        result["end"] = time.perf_counter()

    stop, latencies, starts = threading.Event(), [], []
    asker = threading.Thread(target=ask)
    poller = threading.Thread(target=poll_health, args=(server, stop, latencies, starts))
    asker.start()
    poller.start()
    asker.join()
    stop.set()
    poller.join()
    assert result["status"] == 200
    assert metric(server, "hf_paged_engine_steps_total") == steps_before + 1  # one prefill of 8,000 tokens
    during = [t for t in starts if result["start"] + 0.05 < t < result["end"] - 0.05]
    assert len(during) >= 3, (result, len(during))  # polls answered while the prefill step ran
    assert max(latencies) < 0.1, max(latencies)


# ---------------------------------------------------------------------------------------------- latency histograms
HISTOGRAMS = {
    "hf_paged_time_to_first_token_seconds": "TIME_TO_FIRST_TOKEN_BUCKETS",
    "hf_paged_inter_token_latency_seconds": "INTER_TOKEN_LATENCY_BUCKETS",
    "hf_paged_e2e_request_latency_seconds": "REQUEST_LATENCY_BUCKETS",
    "hf_paged_request_queue_time_seconds": "REQUEST_LATENCY_BUCKETS",
}


def histogram(text: str, name: str) -> tuple[list[tuple[str, int]], float, int]:
    """`([(le, cumulative count), ...], sum, count)` of histogram `name` in Prometheus text."""
    buckets, total, count = [], None, None
    for line in text.splitlines():
        if line.startswith(f'{name}_bucket{{le="'):
            le = line.split('"')[1]
            buckets.append((le, int(line.split()[-1])))
        elif line.startswith(f"{name}_sum "):
            total = float(line.split()[1])
        elif line.startswith(f"{name}_count "):
            count = int(line.split()[1])
    return buckets, total, count


def test_metrics_expose_latency_histograms_with_the_documented_buckets(server, client):
    from hf_paged.engine import stats

    before = {name: histogram(httpx.get(f"{server}/metrics").text, name)[2] for name in HISTOGRAMS}
    for _ in range(3):
        client.completions.create(model=TINY, prompt="Hi", max_tokens=4, temperature=0, extra_body={"min_tokens": 4})
    wait_for_idle(server, timeout=10)
    text = httpx.get(f"{server}/metrics").text
    serving = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    for name, bounds_name in HISTOGRAMS.items():
        assert f"# TYPE {name} histogram" in text and name in serving
        buckets, total, count = histogram(text, name)
        bounds = getattr(stats, bounds_name)
        assert [le for le, _ in buckets] == [f"{b:g}" for b in bounds] + ["+Inf"]
        assert ", ".join(f"{b:g}" for b in bounds) in serving  # the buckets are documented
        cumulative = [value for _, value in buckets]
        assert cumulative == sorted(cumulative) and cumulative[-1] == count and total >= 0
        grown = count - before[name]
        assert grown >= (9 if name == "hf_paged_inter_token_latency_seconds" else 3), (name, grown)
