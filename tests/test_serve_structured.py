"""Structured outputs through `hf-paged serve`, spoken to by real clients (`openai`, `langchain-openai`) on a tiny
random model with SmolLM2's tokenizer: whatever the weights, every reply is valid under its format; formats the
server cannot honour get a 400 naming the field (never a 500), and the server keeps serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from hf_paged.reference_models import smollm2_path

from .serve_helpers import API_KEY, TINY, ServerProcess, save_tiny_model, wait_for_idle

VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no", "maybe"]}, "score": {"type": "integer", "minimum": 0,
                   "maximum": 9}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]


class Verdict(BaseModel):
    """A verdict and how sure it is."""

    verdict: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    process = ServerProcess(folder, "--served-model-name", TINY, "--num-blocks", "256", "--exact", "--api-key", API_KEY)
    yield process.base
    process.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    wait_for_idle(server, timeout=10)


def test_chat_json_schema_replies_validate(client):
    reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=64, temperature=0,
                                           response_format=SCHEMA_FORMAT)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), VERDICT)


def test_negative_control_without_the_format_the_reply_is_not_json(client):
    reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.choices[0].message.content)


def test_streamed_replies_are_the_same_valid_json(client):
    whole = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=40, temperature=0,
                                           response_format=SCHEMA_FORMAT)  # fmt: skip
    chunks = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=40, temperature=0,
                                            response_format=SCHEMA_FORMAT, stream=True)  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), VERDICT)


def test_n_sampled_choices_each_follow_the_format(client):
    reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=40, n=4, seed=3, temperature=1.0,
                                           response_format={"type": "json_object"})  # fmt: skip
    assert len(reply.choices) == 4
    for choice in reply.choices:
        if choice.finish_reason == "stop":  # a random model's object may run past max_tokens
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda text: text in ("red", "green", "blue")),
        ({"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}}, lambda text: re.fullmatch("[0-9]{4}-[0-9]{2}", text)),
        ({"structured_outputs": {"grammar": 'root ::= "<" [a-c] [a-c]? ">"'}},
         lambda text: re.fullmatch("<[a-c]{1,2}>", text)),
        ({"response_format": SCHEMA_FORMAT}, lambda text: jsonschema.validate(json.loads(text), VERDICT) is None),
    ],
    ids=["choice", "regex", "grammar", "json_schema"],
)  # fmt: skip
def test_completions_take_response_format_and_structured_outputs(client, extra, check):
    reply = client.completions.create(model=TINY, prompt="Colour:", max_tokens=30, extra_body=extra)
    assert reply.choices[0].finish_reason == "stop" and check(reply.choices[0].text)


def test_the_openai_clients_parse_helper_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(model=TINY, messages=MESSAGES, max_tokens=64, temperature=0,
                                               response_format=Verdict)  # fmt: skip
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and 0 <= parsed.score <= 9


def test_langchain_with_structured_output_returns_the_pydantic_object(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=TINY, base_url=f"{server}/v1", api_key=API_KEY, max_tokens=64, temperature=0,
                      max_retries=0)  # fmt: skip
    answer = chat.with_structured_output(Verdict).invoke("Is the sky blue?")
    assert isinstance(answer, Verdict)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format", "invalid JSON schema at schema.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"oneOf": [{}, {}]}}}},
         "response_format", "keyword 'oneOf'"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be one of"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "cannot be compiled"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
         "not both"),
        ({"response_format": "json"}, "response_format", "should be a valid dictionary"),
    ],
    ids=["invalid-schema", "unenforced-keyword", "unknown-type", "bad-regex", "two-kinds", "both-fields", "not-object"],
)  # fmt: skip
def test_formats_that_cannot_be_honoured_get_a_400_naming_the_field(server, client, body, param, message):
    response = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": TINY, "messages": MESSAGES, "max_tokens": 4, **body})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2).choices  # still serving


# ---------------------------------------------------------------------------------------------- tool calling
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                       "additionalProperties": False},
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
        "additionalProperties": False}}}  # fmt: skip


def check_calls(message, names=("get_weather", "get_time")):
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome")
        else:
            assert arguments == {}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_calls_are_parsed_into_tool_calls(client, stream):
    # one call at most: a random model's array of calls would only end at max_tokens
    options = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    options.update(model=TINY, messages=MESSAGES, max_tokens=64, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**options)
        assert reply.choices[0].finish_reason == "tool_calls"
        check_calls(reply.choices[0].message)
        return
    chunks = [c for c in client.chat.completions.create(**options, stream=True) if c.choices]
    whole = client.chat.completions.create(**options)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_named_function_is_the_one_called_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=64, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice=named)  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"  # OpenAI's reason when tool_choice names the function
    check_calls(reply.choices[0].message, names=("get_time",))
    assert len(reply.choices[0].message.tool_calls) == 1


def test_auto_gives_calls_or_text_and_none_gives_text(client):
    for seed in range(4):
        reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=64, seed=seed,
                                               tools=[WEATHER, TIME])  # fmt: skip
        message, reason = reply.choices[0].message, reply.choices[0].finish_reason
        if message.tool_calls:
            assert reason == "tool_calls"
            check_calls(message)
        else:
            assert not message.content.startswith(("[", "{"))
    plain = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=8, temperature=0,
                                           tools=[WEATHER], tool_choice="none")  # fmt: skip
    reference = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == reference.choices[0].message.content  # tools not shown


def test_tool_results_go_back_to_the_model_in_the_next_turn(client):
    options = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    first = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=64, temperature=0, **options)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "blue"}'}]  # fmt: skip
    second = client.chat.completions.create(model=TINY, messages=messages, max_tokens=8, tools=[WEATHER])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain_bind_tools_returns_tool_calls(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    chat = ChatOpenAI(model=TINY, base_url=f"{server}/v1", api_key=API_KEY, max_tokens=64, temperature=0,
                      max_retries=0)  # fmt: skip
    message = chat.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools.0"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools.0"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
    ids=["not-function", "bad-name", "twice", "bad-parameters", "unknown-choice", "choice-without-tools",
         "bad-choice", "with-response-format", "legacy-functions"],
)  # fmt: skip
def test_tool_fields_that_cannot_be_honoured_get_a_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": TINY, "messages": MESSAGES, "max_tokens": 4, **body})  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_streamed_text_with_a_bracket_later_is_not_held_as_a_call():
    """With tools, only a reply that begins with `[` is held as a call; `[` later in words streams as it comes."""
    from hf_paged.engine import RequestOutput
    from hf_paged.serve.replies import Reply
    from hf_paged.serve.tools import ToolCalling

    tools = ToolCalling.from_body([WEATHER], "auto", None)
    reply = Reply(TINY, True, None, tools=tools)

    def output(new: str, finished: bool = False):
        return RequestOutput("r", [1], [2], new, [2], new, finished, "stop" if finished else None)

    def delta(event):
        return json.loads(event.removeprefix("data: "))["choices"][0]["delta"]

    assert delta(reply.chunk(0, output("It is"))) == {"content": "It is"}
    assert delta(reply.chunk(0, output(" [sunny]"))) == {"content": " [sunny]"}
    assert reply.chunk(1, output('[{"name": "get_weather", ')) is None  # held
    final = delta(reply.chunk(1, output('"arguments": {"city": "Rome"}}]', finished=True)))
    assert final["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert delta(reply.chunk(2, output("[cut short", finished=True))) == {"content": "[cut short"}


# ---------------------------------------------------------------------------------------------- Hermes templates
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # Qwen 2.5's tool layout, shortened


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-hermes"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_a_hermes_template_renders_the_tools_and_earlier_calls_itself(hermes_dir):
    from transformers import AutoTokenizer

    from hf_paged.serve.prompts import PromptEncoder
    from hf_paged.serve.protocol import ChatMessage
    from hf_paged.serve.server import _chat_ids, _template_message
    from hf_paged.serve.tools import INSTRUCTIONS, ToolCalling, call_syntax

    tokenizer = AutoTokenizer.from_pretrained(hermes_dir)
    assert call_syntax(tokenizer) == "hermes"
    assert call_syntax(AutoTokenizer.from_pretrained(smollm2_path())) == "json"  # its template ignores tools
    tools = ToolCalling.from_body([WEATHER], "auto", None, "hermes")
    history = [ChatMessage(**m) for m in [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]]  # fmt: skip
    messages = tools.messages([_template_message(m, "hermes") for m in history])
    encoder = PromptEncoder(tokenizer, None)
    text = tokenizer.decode(_chat_ids(encoder, messages, tools.template_tools()))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert INSTRUCTIONS.split(" (")[0] not in text  # the template's words, not hf_paged's


def test_hermes_calls_are_constrained_and_parsed_from_their_tags(hermes_dir):
    process = ServerProcess(hermes_dir, "--served-model-name", TINY, "--num-blocks", "128", "--exact")
    try:
        client = openai.OpenAI(base_url=f"{process.base}/v1", api_key="x", max_retries=0, timeout=60)
        options = dict(model=TINY, messages=MESSAGES, max_tokens=64, temperature=0, tools=[WEATHER, TIME])
        required = {"tool_choice": "required", "parallel_tool_calls": False}
        reply = client.chat.completions.create(**options, **required)
        assert reply.choices[0].finish_reason == "tool_calls"
        check_calls(reply.choices[0].message)
        chunks = [c for c in client.chat.completions.create(**options, **required, stream=True) if c.choices]
        streamed = [tc.function.arguments for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert streamed == [c.function.arguments for c in reply.choices[0].message.tool_calls]
        for seed in range(3):
            auto = client.chat.completions.create(**{**options, "temperature": 1.0}, seed=seed)
            message = auto.choices[0].message
            assert message.tool_calls or not message.content.startswith("<")
        wait_for_idle(process.base, timeout=10)
    finally:
        process.close()
