"""Request bodies of the OpenAI-compatible API: the fields this server honours, and a 400 naming any other.

Fields OpenAI defines that the server cannot honour exactly (`tools`, ...) are refused rather than ignored:
`unsupported_fields` names them. `response_format` (chat and completions) and the `structured_outputs` extension
(vLLM's shape) constrain the output; `hf_paged.structured.ResponseFormat` reads and checks them. `user` is accepted
and ignored (it only labels the request); `min_tokens` is an extension (vLLM's name) that suppresses end-of-sequence
tokens until that many tokens were generated. Types are strict, as OpenAI's: `"3"` or `true` is not an integer,
`"yes"` not a boolean; `null` stands for a field's default, as it does in OpenAI's API (its Python client sends
`null` for `None`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..engine.params import MAX_LOGIT_BIAS, MAX_PENALTY  # one statement of OpenAI's ranges, shared with the Engine

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`
MAX_LOGIT_BIAS_ENTRIES = 300  # entries in `logit_bias`
MAX_TOKEN_ID_DIGITS = 18  # a longer `logit_bias` key is no token id of any vocabulary
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat's (completions have none)
_LEGACY_FUNCTION_FIELDS = ("functions", "function_call")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Numbers are finite: JSON has no NaN or Infinity, which
    Python's parser reads anyway (`"temperature": NaN` is refused as not a finite number)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """Drop `null` values of fields that have a default other than `null` (`temperature`, `n`, `stream`, ...)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            name: value
            for name, value in data.items()
            if value is not None or name not in fields or fields[name].is_required() or fields[name].default is None
        }

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is not None and not isinstance(value, str | list):
            raise ValueError(f"must be a string or an array of strings, got {json_type(value)}")
        strings = [value] if isinstance(value, str) else (value or [])
        for index, text in enumerate(strings):
            if not isinstance(text, str):
                raise ValueError(f"stop strings must be strings, got {json_type(text)} at index {index}")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
        if any(not text for text in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries are allowed, got {len(value)}")
        for token, bias in value.items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (strings of digits 0-9), got {_shorten(token)!r}")
            if len(token) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"logit_bias keys must be token ids, got a {len(token)}-digit number")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for token "
                    f"{token}"
                )
        return value

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def bias(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and value and all(isinstance(item, str | list) for item in value):
            raise ValueError("a list of prompts is not supported by this server: send one prompt per request")
        if isinstance(value, list):
            for index, item in enumerate(value):
                if type(item) is not int:
                    raise ValueError(f"a token id prompt holds integers only, got {json_type(item)} at index {index}")
        elif not isinstance(value, str):
            raise ValueError(f"must be a string or an array of token ids, got {json_type(value)}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = Field(default=None, validate_default=True)
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to one of them

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if isinstance(value, list):
            for index, part in enumerate(value):
                if not isinstance(part, dict):
                    raise ValueError(f"content parts are objects, got {json_type(part)} at index {index}")
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"must be a string or an array of content parts, got {json_type(value)}")
        return value

    @field_validator("content")
    @classmethod
    def _content_required(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if value is None and role in ("system", "user", "developer"):
            raise ValueError(f"a {role} message needs content")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


def unsupported_fields(body: SamplingFields) -> tuple[str, str] | None:
    """`(param, message)` for the first field of `body` the server cannot honour, or `None`.

    Example:

    ```python
    >>> body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], functions=[{"x": 1}])
    >>> unsupported_fields(body)
    ('functions', 'functions: the deprecated functions API is not supported; use tools and tool_choice')

    ```
    """
    for name, value in (body.model_extra or {}).items():
        if _is_off(value) or _DEFAULTS.get(name) == (type(value), value):
            continue
        if name in _TOOL_FIELDS:
            return name, f"{name}: tool calling is a chat completions feature (/v1/chat/completions)"
        if name in _LEGACY_FUNCTION_FIELDS:
            return name, f"{name}: the deprecated functions API is not supported; use tools and tool_choice"
        return name, f"{name}: this field is not supported by this server"
    if body.stream_options is not None and not body.stream:
        return "stream_options", "stream_options: only allowed when stream is true"
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            return "top_logprobs", "top_logprobs: needs logprobs set to true"
        for index, message in enumerate(body.messages):
            for name, value in (message.model_extra or {}).items():  # name, tool_calls, tool_call_id, audio, ...
                if not _is_off(value):
                    where = f"messages.{index}.{name}"
                    return where, f"{where}: this message field is not supported by this server"
            if message.tool_calls and message.role != "assistant":
                where = f"messages.{index}.tool_calls"
                return where, f"{where}: only assistant messages hold tool calls"
            if isinstance(message.content, list):
                for part in message.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        where = f"messages.{index}.content"
                        return where, f"{where}: only text content parts are supported, got {part.get('type')!r}"
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        return "logprobs", "logprobs: not supported together with echo (prompt log-probabilities are not computed)"
    return None


_DEFAULTS = {"best_of": (int, 1), "tool_choice": (str, "none")}  # what asks for the default behaviour: accepted


def _is_off(value) -> bool:
    """Whether a field's value asks for nothing (`null`, `false`, `[]`, `{}`, `""`)."""
    return value is None or value is False or value == [] or value == {} or value == ""


def json_type(value) -> str:
    """How JSON names the type of a parsed value (`"a string"`, `"an integer"`, `"null"`, ...)."""
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
             dict: "an object", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def message_text(message: ChatMessage) -> str:
    """The text of a chat message (its text content parts, joined)."""
    if isinstance(message.content, list):
        return "".join(part["text"] for part in message.content)
    return message.content or ""


class LoadLoraRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's names): serve the PEFT LoRA adapter saved in `lora_path` as model
    `lora_name`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """`POST /v1/unload_lora_adapter`: stop serving adapter `lora_name` (requests running on it finish)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)
