"""Tool calling for chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, the tools shown to
the model, its calls constrained to valid JSON and parsed into `message.tool_calls`.

Two call syntaxes (`call_syntax` picks one per tokenizer):
- `"hermes"`: the chat template renders the tools itself and writes calls as `<tool_call>\n{"name": ...,
  "arguments": {...}}\n</tool_call>` (Hermes, Qwen 2/2.5/3, SmolLM3 and their fine-tunes): the tools, earlier calls
  and tool results go to the template, and the reply's calls are read from those tags.
- `"json"`: any other template (one that ignores `tools`): a system message tells the tools and asks for calls as a
  JSON array, `[{"name": ..., "arguments": {...}}]`; earlier calls go back in that JSON.
Either way structured outputs hold a reply to the tools' names and parameter schemas: with `tool_choice`
`"required"` or a named function it must be calls; with `"auto"` calls or words that cannot begin a call; with
`"none"` the tools are not shown.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from ..structured import ResponseFormat, ResponseFormatError
from ..structured.formats import check_schema
from ..structured.grammar import CALL_TAGS
from .errors import APIError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
INSTRUCTIONS = (
    "You can call these functions (JSON schemas of their arguments):\n{tools}\n\n"
    'To call functions, answer with only a JSON array of calls, [{{"name": "<function name>", "arguments": '
    "{{<arguments>}}}}]{how}"
)


@dataclass(frozen=True)
class ToolCalling:
    """The tools of one chat call and how the reply may use them.

    Attributes:
        tools (`list[dict]`): `{"name", "description", "parameters"}` per function.
        choice (`str`): `"auto"`, `"required"`, or the name of the function the reply must call.
        parallel (`bool`): whether a reply may hold several calls (`parallel_tool_calls`).
        syntax (`str`): `"json"` or `"hermes"` (`call_syntax`).

    Example:

    ```python
    >>> calling = ToolCalling.from_body([{"type": "function", "function": {"name": "get_time"}}], "required", None)
    >>> calling.parse('[{"name": "get_time", "arguments": {}}]')[0]["function"]
    {'name': 'get_time', 'arguments': '{}'}
    >>> calling.parse("It is noon.") is None, calling.finish_reason()
    (True, 'tool_calls')

    ```
    """

    tools: tuple
    choice: str
    parallel: bool = True
    syntax: str = "json"

    @classmethod
    def from_body(cls, tools, tool_choice, parallel_tool_calls, syntax: str = "json") -> ToolCalling | None:
        """From a chat body's fields (`None`: no tool calling: no tools, or `tool_choice: "none"`); an `APIError` 400
        naming the field at fault."""
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise APIError(400, "parallel_tool_calls: must be a boolean", "parallel_tool_calls")
        functions = _functions(tools)
        choice = _choice(tool_choice, [f["name"] for f in functions])
        if choice == "none":
            return None
        return cls(tuple(functions), choice, parallel_tool_calls is not False, syntax)

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "required")

    def response_format(self) -> ResponseFormat:
        """What the reply must be: calls (one unless `parallel`; the named function's alone), or with `"auto"` those
        or words."""
        calls = [_call_schema(f) for f in self.tools if not self.forced or f["name"] == self.choice]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        parallel = self.parallel and not self.forced
        return ResponseFormat.tool_calls(schema, self.syntax, parallel, or_text=self.choice == "auto")

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template's `tools=` (Hermes templates render them), else `None`."""
        if self.syntax != "hermes":
            return None
        return [{"type": "function", "function": dict(f)} for f in self.tools]

    def messages(self, messages: list[dict]) -> list[dict]:
        """`messages` as the template gets them: with the JSON syntax, the tools told in a system message (added to
        the first one, or put first); with a Hermes template, as they are (it renders the tools)."""
        if self.syntax == "hermes":
            return messages
        shown = [{"name": f["name"], "description": f.get("description", ""), "parameters": f["parameters"]}
                 for f in self.tools]  # fmt: skip
        if self.choice == "auto":
            how = ". Otherwise answer in words."
        elif self.choice == "required":
            how = "."
        else:
            how = f', calling "{self.choice}".'
        text = INSTRUCTIONS.format(tools=json.dumps(shown, ensure_ascii=False, indent=1), how=how)
        if messages and messages[0]["role"] in ("system", "developer"):
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def begins_call(self, text: str) -> bool:
        """Whether a reply beginning with `text` (not empty) is calls: words cannot begin as a call does."""
        return text.startswith("[" if self.syntax == "json" else "<")

    def parse(self, text: str) -> list[dict] | None:
        """The OpenAI `tool_calls` of a reply's text, or `None` when it holds none (words, or calls cut short)."""
        if not text or not self.begins_call(text):
            return None
        try:
            if self.syntax == "json":
                calls = json.loads(text)
            else:
                opening, closing = (tag.strip() for tag in CALL_TAGS)
                calls = [json.loads(part) for part in re.findall(f"{opening}(.*?){closing}", text, flags=re.S)]
        except json.JSONDecodeError:
            return None  # cut by max_tokens
        names = {f["name"] for f in self.tools}
        if (
            not isinstance(calls, list)
            or not calls
            or not all(
                isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict) for c in calls
            )
        ):
            return None
        return [
            {"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls
        ]  # fmt: skip

    def finish_reason(self) -> str:
        """OpenAI's: `"stop"` when `tool_choice` named the function, else `"tool_calls"`."""
        return "stop" if self.forced else "tool_calls"


def call_syntax(tokenizer) -> str:
    """`"hermes"` when the tokenizer's chat template renders `tools` itself and writes calls in `<tool_call>` tags,
    else `"json"` (checked once per server, by rendering a probe tool)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<tool_call>" not in template:
        return "json"
    probe = {"type": "function", "function": {"name": "hf_paged_probe_tool", "parameters": EMPTY_PARAMETERS}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[probe], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot take tools: they are told in a system message
        return "json"
    return "hermes" if "hf_paged_probe_tool" in text else "json"


def earlier_calls(tool_calls: list) -> list[dict]:
    """An assistant message's `tool_calls` as `{"name", "arguments"}` with the arguments parsed; an `APIError` when
    they are malformed."""
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, "messages: tool_calls entries need function.name", "messages")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            raise APIError(400, "messages: tool_calls function.arguments must be a JSON string", "messages") from None
        calls.append({"name": function["name"], "arguments": arguments})
    return calls


def _functions(tools) -> list[dict]:
    if tools is None or tools == []:
        return []
    if not isinstance(tools, list):
        raise APIError(400, "tools: must be an array of tools", "tools")
    functions, names = [], set()
    for index, tool in enumerate(tools):
        where = f"tools.{index}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f'{where}: only {{"type": "function", "function": {{...}}}} tools are supported', where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise APIError(400, f"{where}.function.name: 1 to 64 letters, digits, _ or -, got {name!r}", where)
        if name in names:
            raise APIError(400, f"{where}.function.name: {name!r} is defined twice", where)
        names.add(name)
        parameters = function.get("parameters")
        parameters = EMPTY_PARAMETERS if parameters is None else parameters
        try:
            if not isinstance(parameters, dict):
                raise ResponseFormatError(f"must be a JSON schema object, got {type(parameters).__name__}")
            check_schema(parameters)
        except ResponseFormatError as error:
            raise APIError(400, f"{where}.function.parameters: {error}", where) from None
        functions.append({"name": name, "description": function.get("description") or "", "parameters": parameters})
    return functions


def _choice(tool_choice, names: list[str]) -> str:
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f'tool_choice: "none", "auto", "required" or a function, got {tool_choice!r}',
                           "tool_choice")  # fmt: skip
        if tool_choice != "none" and not names:
            raise APIError(400, f"tool_choice: {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise APIError(400, 'tool_choice: {"type": "function", "function": {"name": ...}} names a function',
                       "tool_choice")  # fmt: skip
    if name not in names:
        raise APIError(400, f"tool_choice: no tool named {name!r}; the tools are {names}", "tool_choice")
    return name


def _call_schema(function: dict) -> dict:
    """One call of `function`. Its arguments hold only the parameters it declares unless its schema says otherwise
    (`additionalProperties` is false where the top-level schema leaves it unset)."""
    arguments = function["parameters"]
    if isinstance(arguments, dict) and "additionalProperties" not in arguments:
        arguments = {**arguments, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
