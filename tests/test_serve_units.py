"""Server pieces without a server: request parsing and its OpenAI errors, refused fields, the evident-length check,
the GGUF conversion cache, the API key from the environment."""

from __future__ import annotations

import json
import stat

import pytest

from hf_paged.serve.body import parse_body
from hf_paged.serve.cli import API_KEY_ENV, api_key, build_parser
from hf_paged.serve.errors import APIError
from hf_paged.serve.gguf_cache import COMPLETE_MARKER, cache_root, converted_gguf, file_digest
from hf_paged.serve.prompts import PromptEncoder
from hf_paged.serve.protocol import ChatCompletionRequest, CompletionRequest, unsupported_fields


def parse_error(raw: bytes, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_body(raw, model)
    return caught.value


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        (b'{"model": "m", "prompt": "hi", "max_tokens": 34', None, "not valid JSON"),
        (b'{"model": "m", "prompt": "a\\udfffb"}', "prompt", "lone UTF-16 surrogate"),
        (b'{"model": "m", "prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop.1", "lone UTF-16 surrogate"),
        (b'{"model": "m", "prompt": "hi", "\\ud800": 1}', "\\ud800", "lone UTF-16 surrogate"),
        (b'{"model": "m", "prompt": "hi", "seed": 18446744073709551616}', "seed", "less than or equal to"),
        (b'{"model": "m", "prompt": "hi", "seed": -9223372036854775809}', "seed", "greater than or equal to"),
        (b'{"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', "stop", "at most 4 stop strings"),
        (b'{"model": "m", "prompt": "hi", "stop": [""]}', "stop", "must not be empty"),
        (b'{"model": "m", "prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias", "token ids"),
        (b'{"model": "m", "prompt": "hi", "logprobs": 6}', "logprobs", "less than or equal to 5"),
        (b'{"model": "m", "prompt": "hi", "frequency_penalty": 2.5}', "frequency_penalty", "less than or equal to 2"),
        # NaN and Infinity are no JSON, but Python's parser reads them: not a finite number (NaN was "must be <= 2")
        (b'{"model": "m", "prompt": "hi", "temperature": NaN}', "temperature", "should be a finite number"),
        (b'{"model": "m", "prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty", "finite number"),
        (b'{"model": "m", "prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias.5", "finite number"),
        (b"\xff\xfe", None, "not valid JSON"),
        (b"[]", None, "must be a JSON object"),
        # characters str.isdigit() accepts but int() does not, or reads as another digit
        ('{"model": "m", "prompt": "hi", "logit_bias": {"\u00b2": 1}}'.encode(), "logit_bias", "digits 0-9"),
        ('{"model": "m", "prompt": "hi", "logit_bias": {"\u0663": 1}}'.encode(), "logit_bias", "digits 0-9"),
        (b'{"model": "m", "prompt": "hi", "logit_bias": {"%s": 1}}' % (b"1" * 5000), "logit_bias", "5000-digit"),
        (b'{"model": "m", "prompt": "hi", "max_tokens": %s}' % (b"1" * 5000), None, "an integer of over"),
        (b'{"model": "m", "prompt": "hi", "x": %s}' % (b"[" * 2000 + b"]" * 2000), None, "nests more than 32"),
        (b'{"model": "m", "prompt": "hi", "x": %s}' % (b"[" * 40 + b"]" * 40), None, "nests more than 32"),
        # strict types, as OpenAI's: no string or boolean read as a number, no float as an integer
        (b'{"model": "m", "prompt": "hi", "max_tokens": "3"}', "max_tokens", "valid integer, got a string"),
        (b'{"model": "m", "prompt": "hi", "n": true}', "n", "valid integer, got a boolean"),
        (b'{"model": "m", "prompt": "hi", "n": 2.0}', "n", "valid integer, got a number"),
        (b'{"model": "m", "prompt": "hi", "temperature": "0.5"}', "temperature", "valid number, got a string"),
        (b'{"model": "m", "prompt": "hi", "stream": "yes"}', "stream", "valid boolean, got a string"),
        (b'{"model": "m", "prompt": "hi", "logit_bias": {"5": "10"}}', "logit_bias.5", "valid number"),
        (b'{"model": "m", "prompt": [true, false]}', "prompt", "integers only, got a boolean at index 0"),
        # fields of several types name the field and what was wrong, not a type branch
        (b'{"model": "m", "prompt": ["hello", "world"]}', "prompt", "a list of prompts is not supported"),
        (b'{"model": "m", "prompt": [[1, 2], [3]]}', "prompt", "a list of prompts is not supported"),
        (b'{"model": "m", "prompt": null}', "prompt", "got null"),
        (b'{"model": "m", "prompt": "hi", "stop": ["a", 5]}', "stop", "got an integer at index 1"),
        (b'{"model": null, "prompt": "hi"}', "model", "valid string, got null"),
    ],
)
def test_bad_bodies_name_the_field(raw, param, message):
    error = parse_error(raw)
    assert error.status == 400 and error.param == param and message in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "message"),
    [(["hi"], "content parts are objects, got a string at index 0"), (5, "got an integer")],
)
def test_chat_content_of_a_wrong_type_is_named(content, message):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    error = parse_error(raw, ChatCompletionRequest)
    assert error.param == "messages.0.content" and message in error.message


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "system", "content": None}])
def test_a_user_or_system_message_needs_content(message):
    raw = json.dumps({"model": "m", "messages": [message]}).encode()
    error = parse_error(raw, ChatCompletionRequest)
    assert error.param == "messages.0.content" and f"a {message['role']} message needs content" in error.message
    assistant = {"model": "m", "messages": [{"role": "assistant"}, {"role": "user", "content": ""}]}
    assert parse_body(json.dumps(assistant).encode(), ChatCompletionRequest).messages[0].content is None


def test_null_stands_for_the_default_as_in_openai():
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "echo", "frequency_penalty", "presence_penalty"])
    body = parse_body(json.dumps({"model": "m", "prompt": "hi", **nulls}).encode(), CompletionRequest)
    assert body == CompletionRequest(model="m", prompt="hi")
    chat = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": null}',
                      ChatCompletionRequest)  # fmt: skip
    assert chat.logprobs is False and chat.temperature == 1.0


def test_a_surrogate_deep_in_chat_messages_is_located():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'
    assert parse_error(raw, ChatCompletionRequest).param == "messages.0.content.0.text"
    fine = parse_body(b'{"model": "m", "prompt": "\\ud83d\\ude00"}', CompletionRequest)  # a pair is fine
    assert fine.prompt == "\U0001f600"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages.0.name"),
        (
            {"messages": [{"role": "user", "content": "a", "tool_calls": [{"id": "1"}]}]},
            "messages.0.tool_calls",
        ),
    ],
)
def test_fields_that_cannot_be_honoured_are_named(fields, param):
    body = ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    assert unsupported_fields(body)[0] == param


def test_off_values_and_user_are_accepted():
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[], parallel_tool_calls=False, user="u1",
        response_format={"type": "text"}, stream=True, stream_options={"include_usage": True}, tool_choice="none",
    )  # fmt: skip
    assert unsupported_fields(body) is None and body.include_usage
    assert unsupported_fields(CompletionRequest(model="m", prompt="hi", best_of=1)) is None  # the default
    assert unsupported_fields(CompletionRequest(model="m", prompt="hi", best_of=True))[0] == "best_of"


def test_token_id_prompts_are_checked_against_the_vocabulary():
    encoder = PromptEncoder(None, None, vocab_size=10)
    assert encoder.encode([0, 9]) == [0, 9]
    with pytest.raises(APIError) as caught:
        encoder.encode([3, -1, 10])
    assert caught.value.param == "prompt" and "[0, 10), got [-1, 10]" in caught.value.message


def test_prompt_length_is_evident_from_the_longest_vocabulary_entry():
    class Vocab:
        def get_vocab(self):
            return {"a": 0, "abcd": 1}

    encoder = PromptEncoder(Vocab(), max_context=10)
    encoder.check_evident_length(40, "prompt")  # 10 tokens of 4 characters: could fit
    with pytest.raises(APIError) as caught:
        encoder.check_evident_length(41, "messages")
    assert caught.value.param == "messages" and "context window of 10 tokens" in caught.value.message
    PromptEncoder(None, None).check_evident_length(10**9, "prompt")  # nothing to bound it with: no refusal


# ---------------------------------------------------------------------------------------------- GGUF cache
def fake_gguf(folder, content: bytes):
    folder.mkdir(exist_ok=True)
    (folder / "model.gguf").write_bytes(content)
    return folder


def test_a_gguf_is_converted_once_and_keyed_by_its_content(tmp_path):
    calls = []

    def convert(model_path, gguf_file, target):
        calls.append(gguf_file)
        (target / "config.json").write_text("{}")

    source = fake_gguf(tmp_path / "a", b"weights v1")
    first = converted_gguf(str(source), "model.gguf", tmp_path / "cache", convert)
    second = converted_gguf(str(source), "model.gguf", tmp_path / "cache", convert)
    assert first == second == tmp_path / "cache" / "gguf" / file_digest(source / "model.gguf") and len(calls) == 1
    assert (first / COMPLETE_MARKER).exists() and (first / "config.json").exists()
    assert stat.S_IMODE(first.stat().st_mode) & 0o055 == 0o055  # not mkdtemp's private 0o700
    copy = fake_gguf(tmp_path / "b", b"weights v1")  # same content elsewhere: the same conversion
    assert converted_gguf(str(copy), "model.gguf", tmp_path / "cache", convert) == first and len(calls) == 1
    (source / "model.gguf").write_bytes(b"weights v2")  # new content: converted again
    assert converted_gguf(str(source), "model.gguf", tmp_path / "cache", convert) != first and len(calls) == 2


def test_an_interrupted_conversion_is_never_used(tmp_path):
    source = fake_gguf(tmp_path / "a", b"weights")

    def broken(model_path, gguf_file, target):
        (target / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        converted_gguf(str(source), "model.gguf", tmp_path / "cache", broken)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # the staging folder is gone
    with pytest.raises(FileNotFoundError):
        converted_gguf(str(source), "missing.gguf", tmp_path / "cache", broken)


def test_the_cache_root_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_PAGED_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "hf_paged"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "hf_paged"
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"


# ---------------------------------------------------------------------------------------------- CLI
def test_the_api_key_comes_from_the_option_or_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(build_parser().parse_args(["serve", "m"])) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(build_parser().parse_args(["serve", "m"])) == "from-env"
    assert api_key(build_parser().parse_args(["serve", "m", "--api-key", "given"])) == "given"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key(build_parser().parse_args(["serve", "m"])) is None
