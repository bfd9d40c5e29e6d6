"""`ResponseFormat`: the shape a request's output must take, checked before anything runs.

OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {...}}`) and three
more kinds: a regular expression, a choice among strings and an EBNF grammar. A JSON schema is checked against its
metaschema and for keywords the grammar engine would not enforce (a constrained output would then not always
validate): those are refused with `ResponseFormatError` naming the keyword and where it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_calls")
CALL_SYNTAXES = ("json", "hermes")  # tool calls as a JSON array, or in <tool_call> tags (Hermes, Qwen)

# JSON-schema keywords that xgrammar accepts but does not enforce (measured: an output breaking them is accepted), so
# a constrained output could fail validation; refused rather than silently ignored
UNENFORCED_KEYWORDS = {
    "not": "negated schemas",
    "if": "conditional schemas",
    "then": "conditional schemas",
    "else": "conditional schemas",
    "oneOf": "exactly-one-of (use anyOf)",
    "dependentRequired": "dependent requirements",
    "dependentSchemas": "dependent schemas",
    "dependencies": "dependent requirements",
    "contains": "array containment",
    "minContains": "array containment",
    "maxContains": "array containment",
    "unevaluatedProperties": "unevaluated properties",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "dynamic references",
}
# keywords whose value is one schema, a list of schemas, or a map of names to schemas (where the walk goes on)
_ONE = ("items", "additionalProperties", "unevaluatedItems", "propertyNames", "contains", "not", "if", "then", "else",
        "additionalItems")  # fmt: skip
_MANY = ("prefixItems", "anyOf", "allOf", "oneOf")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class ResponseFormatError(ValueError):
    """A response format that cannot be honoured: malformed, an invalid JSON schema, or one using a feature that
    structured outputs do not enforce. The message names the value and what is supported."""


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must be: JSON (any object, or one valid under a schema), a match of a regular
    expression, one of a list of strings, or a sentence of an EBNF grammar (xgrammar's dialect of GBNF).

    Attributes:
        kind (`str`): `"json_object"`, `"json_schema"`, `"regex"`, `"choice"`, `"grammar"`, or `"tool_calls"`
            (the server's: calls valid under a schema, in a call syntax, or with `or_text` words instead).
        spec (`str`): the schema as canonical JSON, the regex, the choices as a JSON array, or the grammar
            (empty for `json_object`).
        name (`str | None`): the schema's name (OpenAI's `json_schema.name`).

    Example:

    ```python
    >>> from hf_paged.structured import ResponseFormat
    >>> ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    ResponseFormat(kind='json_schema', spec='{"type":"integer"}', name='n')
    >>> ResponseFormat.parse({"type": "text"}) is None
    True
    >>> try:
    ...     ResponseFormat.parse({"type": "json_schema", "json_schema": {"schema": {"not": {"type": "null"}}}})
    ... except ValueError as error:
    ...     print(error)
    JSON schema keyword 'not' (negated schemas) at schema.not is not supported: structured outputs cannot enforce it

    ```
    """

    kind: str
    spec: str = ""
    name: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ResponseFormatError(f"response format kind must be one of {list(KINDS)}, got {self.kind!r}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json_object(cls) -> ResponseFormat:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema, name: str | None = None) -> ResponseFormat:
        """From a schema (a `dict`, its JSON text, or a pydantic model class)."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            name = name or schema.__name__
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ResponseFormatError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, Mapping | bool):
            raise ResponseFormatError(f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
        check_schema(schema)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), name)  # key order kept: the output's

    @classmethod
    def tool_calls(cls, call_schema: dict, syntax: str = "json", parallel: bool = True, or_text: bool = False):
        """Tool calls, each valid under `call_schema` (`{"name": ..., "arguments": ...}`): with syntax `"json"` a JSON
        array of them, with `"hermes"` each in `<tool_call>` tags on lines of its own (at most
        `MAX_TAGGED_CALLS`); one call unless `parallel`; with `or_text`, text that does not begin like a call
        instead (`[` or `{` for JSON, `<` for tags)."""
        if syntax not in CALL_SYNTAXES:
            raise ResponseFormatError(f"tool call syntax must be one of {list(CALL_SYNTAXES)}, got {syntax!r}")
        check_schema(call_schema)
        spec = {"schema": call_schema, "syntax": syntax, "parallel": parallel, "or_text": or_text}
        return cls("tool_calls", json.dumps(spec, separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> ResponseFormat:
        if not isinstance(pattern, str) or not pattern:
            raise ResponseFormatError(f"a regex response format needs a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> ResponseFormat:
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise ResponseFormatError(f"a choice response format needs a non-empty list of strings, got {options!r}")
        for index, option in enumerate(options):
            if not isinstance(option, str) or not option:
                raise ResponseFormatError(f"choices must be non-empty strings, got {option!r} at index {index}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, ebnf: str) -> ResponseFormat:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise ResponseFormatError(f"a grammar response format needs EBNF text, got {ebnf!r}")
        return cls("grammar", ebnf)

    @classmethod
    def parse(cls, value) -> ResponseFormat | None:
        """A `ResponseFormat` from OpenAI's `response_format` object (`{"type": "text"}` and `None`: no constraint),
        the extension types `{"type": "regex", "regex": ...}`, `{"type": "choice", "choice": [...]}` and
        `{"type": "grammar", "grammar": ...}`, a pydantic model class, or a `ResponseFormat`."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if isinstance(value, type) and hasattr(value, "model_json_schema"):
            return cls.json_schema(value)
        if not isinstance(value, Mapping):
            raise ResponseFormatError(f"response_format must be an object, got {type(value).__name__}")
        kind = value.get("type")
        allowed = ["text", *KINDS[:-1]]
        if kind not in allowed:
            raise ResponseFormatError(f"response_format.type must be one of {allowed}, got {kind!r}")
        extra = sorted(set(value) - {"type", kind})
        if extra:
            raise ResponseFormatError(f"response_format of type {kind!r} takes no field {extra[0]!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            return _openai_json_schema(value.get("json_schema"))
        if kind not in value:
            raise ResponseFormatError(f"response_format of type {kind!r} needs the field {kind!r}")
        return getattr(cls, kind)(value[kind])

    @classmethod
    def from_structured_outputs(cls, value) -> ResponseFormat:
        """From the server's `structured_outputs` object (vLLM's shape): exactly one of `json` (a schema, or its
        JSON text), `json_object` (`true`), `regex`, `choice` (a list of strings) or `grammar` (EBNF)."""
        keys = {"json": cls.json_schema, "json_object": None, "regex": cls.regex, "choice": cls.choice,
                "grammar": cls.grammar}  # fmt: skip
        if not isinstance(value, Mapping):
            raise ResponseFormatError(f"structured_outputs must be an object, got {type(value).__name__}")
        given = [key for key, item in value.items() if item is not None and item is not False]
        unknown = sorted(set(given) - set(keys))
        if unknown:
            raise ResponseFormatError(f"structured_outputs takes one of {list(keys)}, got {unknown[0]!r}")
        if len(given) != 1:
            raise ResponseFormatError(f"structured_outputs takes exactly one of {list(keys)}, got {given or 'none'}")
        key = given[0]
        if key == "json_object":
            if value[key] is not True:
                raise ResponseFormatError(f"structured_outputs.json_object must be true, got {value[key]!r}")
            return cls.json_object()
        return keys[key](value[key])

    @property
    def schema(self):
        """The JSON schema (`json_schema` formats), else `None`."""
        return json.loads(self.spec) if self.kind == "json_schema" else None

    @property
    def choices(self) -> list[str] | None:
        return json.loads(self.spec) if self.kind == "choice" else None


def _openai_json_schema(body) -> ResponseFormat:
    if not isinstance(body, Mapping):
        raise ResponseFormatError("response_format of type 'json_schema' needs a json_schema object")
    extra = sorted(set(body) - {"name", "schema", "strict", "description"})
    if extra:
        raise ResponseFormatError(f"response_format.json_schema takes no field {extra[0]!r}")
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise ResponseFormatError(f"response_format.json_schema.name must be a string, got {name!r}")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ResponseFormatError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
    if "schema" not in body:  # OpenAI's schema is optional: then any JSON object
        return ResponseFormat.json_object()
    return ResponseFormat.json_schema(body["schema"], name)


def check_schema(schema) -> None:
    """Raise `ResponseFormatError` when `schema` is not a valid JSON schema (its `$schema`'s metaschema, Draft
    2020-12 by default) or uses a keyword structured outputs cannot enforce (`UNENFORCED_KEYWORDS`, remote `$ref`s,
    `allOf` with more than one schema, `uniqueItems: true`)."""
    import jsonschema  # a dependency of the "structured" extra

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = ".".join(["schema", *(str(part) for part in error.absolute_path)])
        raise ResponseFormatError(f"invalid JSON schema at {where}: {error.message}") from None
    stack = [(schema, "schema")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):  # draft 7's `items` as a list of schemas
            stack.extend((item, f"{where}.{index}") for index, item in enumerate(node))
            continue
        if not isinstance(node, Mapping):
            continue
        for keyword, value in node.items():
            at = f"{where}.{keyword}"
            if keyword in UNENFORCED_KEYWORDS:
                _refuse(keyword, UNENFORCED_KEYWORDS[keyword], at)
            if keyword == "uniqueItems" and value is True:
                _refuse(keyword, "unique array items", at)
            if keyword == "allOf" and len(value) > 1:
                _refuse(keyword, "all-of with more than one schema", at)
            if keyword == "$ref" and not str(value).startswith("#"):
                _refuse(keyword, f"a reference outside the schema, {value!r}", at)
            if keyword in _ONE:
                stack.append((value, at))
            elif keyword in _MANY:
                stack.extend((item, f"{at}.{index}") for index, item in enumerate(value))
            elif keyword in _NAMED and isinstance(value, Mapping):
                stack.extend((item, f"{at}.{name}") for name, item in value.items())


def _refuse(keyword: str, what: str, where: str) -> None:
    raise ResponseFormatError(
        f"JSON schema keyword {keyword!r} ({what}) at {where} is not supported: structured outputs cannot enforce it"
    )
