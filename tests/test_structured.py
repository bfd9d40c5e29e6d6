"""Structured outputs: response formats checked up front, xgrammar's masks on real logits, the Engine's constrained
requests beside free ones, and `GrammarLogitsProcessor` in `generate` with the stock and the paged cache."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from transformers import AutoTokenizer, DynamicCache

import hf_paged
from hf_paged import Engine
from hf_paged.reference_models import random_lora, smollm2_path, tiny_model
from hf_paged.structured import GrammarLogitsProcessor, ResponseFormat, ResponseFormatError, compiler_for, mask_logits

VOCAB = 49152  # SmolLM2's, so that the tiny models speak its tokenizer
EOS = 2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["verdict", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB)


def schema_format(schema) -> ResponseFormat:
    return ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})


def valid(text: str, response_format: ResponseFormat) -> bool:
    """Whether `text` is a complete output of `response_format` (checked without xgrammar)."""
    if response_format.kind == "choice":
        return text in response_format.choices
    if response_format.kind == "regex":
        return re.fullmatch(response_format.spec, text) is not None
    if response_format.kind == "grammar":
        return re.fullmatch(GRAMMAR_AS_REGEX[response_format.spec], text) is not None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if response_format.kind == "json_object":
        return isinstance(value, dict)
    return jsonschema.Draft202012Validator(response_format.schema).is_valid(value)


GRAMMAR = 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [1-9]'
GRAMMAR_AS_REGEX = {GRAMMAR: r"\([1-9](\+[1-9]){0,2}\)"}


# ---------------------------------------------------------------------------------------------- formats
def test_openai_shapes_and_the_extension_kinds_parse():
    assert ResponseFormat.parse(None) is None and ResponseFormat.parse({"type": "text"}) is None
    assert ResponseFormat.parse({"type": "json_object"}) == ResponseFormat("json_object")
    parsed = schema_format(PERSON)
    assert parsed.kind == "json_schema" and parsed.name == "x" and parsed.schema == PERSON
    assert list(parsed.schema["properties"]) == ["name", "age", "tags"]  # the schema's order is the output's
    assert ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "n"}}).kind == "json_object"
    assert ResponseFormat.parse({"type": "regex", "regex": "[0-9]+"}).spec == "[0-9]+"
    assert ResponseFormat.parse({"type": "choice", "choice": ["a", 'b"c']}).choices == ["a", 'b"c']
    assert ResponseFormat.from_structured_outputs({"json": json.dumps(VERDICT)}).schema == VERDICT
    assert ResponseFormat.from_structured_outputs({"json_object": True}).kind == "json_object"

    class Answer(BaseModel):
        verdict: str
        score: int = Field(ge=0, le=9)

    from_model = ResponseFormat.parse(Answer)
    assert from_model.name == "Answer" and from_model.schema == Answer.model_json_schema()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "json_schema"}, "needs a json_schema object"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "invalid JSON schema at schema.type"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"minimum": "x"}}}}},
         "invalid JSON schema at schema.properties.a.minimum"),
        ({"type": "json_schema", "json_schema": {"schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
         "keyword 'oneOf'"),
        ({"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"not": {}}}}}},
         "keyword 'not' (negated schemas) at schema.properties.a.not"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}, "'uniqueItems'"),
        ({"type": "json_schema", "json_schema": {"schema": {"allOf": [{"type": "object"}, {"required": ["a"]}]}}},
         "'allOf'"),
        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "https://example.com/s.json"}}}, "'$ref'"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a boolean"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "takes no field 'extra'"),
        ({"type": "regex"}, "needs the field 'regex'"),
        ({"type": "choice", "choice": []}, "non-empty list of strings"),
        ({"type": "choice", "choice": ["a", 3]}, "got 3 at index 1"),
        ({"type": "json_object", "schema": {}}, "takes no field 'schema'"),
        ("json", "must be an object"),
    ],
)  # fmt: skip
def test_formats_that_cannot_be_honoured_are_refused_with_the_reason(value, message):
    with pytest.raises(ResponseFormatError) as caught:
        ResponseFormat.parse(value)
    assert message in str(caught.value)


def test_keywords_are_looked_for_where_schemas_are_not_in_names_or_values():
    """A property named "not" and an enum value "oneOf" are data, not keywords (negative control of the walk)."""
    schema = {"type": "object", "properties": {"not": {"enum": ["oneOf"]}, "if": {"const": {"not": 1}}}}
    assert schema_format(schema).schema == schema
    with pytest.raises(ResponseFormatError, match="schema.properties.not.items.not"):
        schema_format({"type": "object", "properties": {"not": {"type": "array", "items": {"not": {}}}}})


@pytest.mark.parametrize(
    ("value", "message"),
    [({"regex": "[0-9"}, "regex response format cannot be compiled"), ({"grammar": "root ::= x"}, "Rule \"x\""),
     ({"json": '{"type": "array", "minItems": 3, "maxItems": 1}'}, "JSON schema response format cannot be compiled"),
     ({"regex": "a", "choice": ["b"]}, "exactly one of"), ({"jsonn": {}}, "got 'jsonn'")],
)  # fmt: skip
def test_what_does_not_compile_is_refused_before_anything_runs(tokenizer, value, message):
    with pytest.raises(ResponseFormatError, match=re.escape(message)):
        compiler_for(tokenizer, VOCAB).compile(ResponseFormat.from_structured_outputs(value))


# ---------------------------------------------------------------------------------------------- masks
FORMATS = [
    schema_format(PERSON),
    schema_format(VERDICT),
    ResponseFormat.json_object(),
    ResponseFormat.regex(r"[0-9]{3}-[a-z]{2}"),
    ResponseFormat.choice(["yes", "no", 'it "depends"', "naïve\\path"]),
    ResponseFormat.grammar(GRAMMAR),
]
BOUNDED = [f for f in FORMATS if f.kind != "json_object"]  # outputs that end within 64 tokens whatever the model


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), which=st.integers(0, len(FORMATS) - 1))
@example(seed=189, which=0)  # a control character in a length-bounded string, which xgrammar alone lets in
def test_any_logits_under_the_mask_give_a_valid_output(tokenizer, seed, which):
    """Greedy over random logits (biased towards the end-of-sequence token, so that outputs end) under the mask:
    every output that ends is valid."""
    response_format = FORMATS[which]
    constraint = compiler_for(tokenizer, VOCAB).constraint(response_format, [EOS])
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(200):
        logits = torch.randn(1, VOCAB, generator=generator)
        logits[0, EOS] += 3.0
        token = int(mask_logits(logits, [constraint]).argmax())
        assert constraint.accept(token)
        if constraint.terminated:
            break
        tokens.append(token)
    if constraint.terminated:
        assert token == EOS and valid(tokenizer.decode(tokens), response_format)


def test_negative_control_the_same_logits_without_the_mask_are_not_valid(tokenizer):
    generator = torch.Generator().manual_seed(0)
    tokens = [int(torch.randn(VOCAB, generator=generator).argmax()) for _ in range(20)]
    assert not any(valid(tokenizer.decode(tokens), f) for f in FORMATS)


def test_a_vocabulary_wider_than_the_tokenizer_never_allows_the_extra_ids(tokenizer):
    constraint = compiler_for(tokenizer, VOCAB + 64).constraint(ResponseFormat.json_object(), [EOS])
    logits = torch.zeros(1, VOCAB + 64)
    logits[0, VOCAB:] = 100.0
    masked = mask_logits(logits, [constraint])
    assert torch.isneginf(masked[0, VOCAB:]).all() and tokenizer.decode([int(masked.argmax())]).startswith("{")


# ---------------------------------------------------------------------------------------------- the Engine
def mixed_workload(count: int):
    """`count` requests: prompts of 3-20 token ids, every third free, the others constrained by the bounded formats
    in turn, with greedy, seeded sampling, penalties, stop strings and log-probabilities among them."""
    generator = torch.Generator().manual_seed(0)
    requests = []
    for index in range(count):
        prompt = torch.randint(3, VOCAB, (3 + index % 18,), generator=generator).tolist()
        options = {"max_new_tokens": 64}
        if index % 4 == 1:
            options.update(do_sample=True, seed=index, temperature=0.8, top_p=0.95)
        if index % 5 == 2:
            options.update(repetition_penalty=1.3, frequency_penalty=0.5)
        if index % 7 == 3:
            options.update(logprobs=2)
        if index % 6 == 4:
            options.update(stop=["\n\n"])  # watched alongside the format (compact JSON never holds it)
        if index % 3 != 0:
            options["response_format"] = BOUNDED[index % len(BOUNDED)]
        requests.append((prompt, options))
    return requests


def run(engine: Engine, requests) -> list:
    ids = [engine.add_request(prompt, **options) for prompt, options in requests]
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    return [outputs[i] for i in ids]


def check_constrained(tokenizer, requests, outputs):
    for (_, options), output in zip(requests, outputs):
        response_format = options.get("response_format")
        if response_format is None:
            continue
        assert output.finish_reason == "stop", (response_format, output)
        text = tokenizer.decode(output.token_ids[:-1] if output.token_ids[-1] == EOS else output.token_ids)
        assert valid(text, response_format), (response_format.kind, text)


def test_64_mixed_requests_constrained_ones_valid_free_ones_unchanged(model, tokenizer):
    """64 requests in one run, constrained by six formats and free; each constrained output is valid and the free
    ones are token for token what they are in a run with no constrained request."""
    requests = mixed_workload(64)
    engine = Engine(model, tokenizer, block_size=8, num_blocks=512, max_batch_size=24, exact=True, progress=False)
    outputs = run(engine, requests)
    check_constrained(tokenizer, requests, outputs)
    free = [(prompt, options) for prompt, options in requests if "response_format" not in options]
    alone = run(engine, free)
    together = [output for output, (_, options) in zip(outputs, requests) if "response_format" not in options]
    assert [o.token_ids for o in alone] == [o.token_ids for o in together]
    assert [o.logprobs for o in alone] == [o.logprobs for o in together]


def test_log_probabilities_stay_those_of_the_raw_logits(model, tokenizer):
    """A constrained request reports the model's log-probabilities (before the mask), as unconstrained ones do."""
    prompt = [5, 6, 7, 8]
    engine = Engine(model, tokenizer, block_size=8, num_blocks=64, exact=True, progress=False)
    [output] = run(engine, [(prompt, {"max_new_tokens": 1, "logprobs": 3, "response_format": FORMATS[1]})])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, dim=-1)
    first = output.logprobs[0]
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-5)
    assert [t for t, _ in first.top] == expected.topk(3).indices.tolist()  # the unmasked favourites
    assert tokenizer.decode([first.token_id]).startswith("{")


def test_preempted_constrained_requests_resume_valid_and_unchanged(model, tokenizer):
    requests = mixed_workload(12)
    roomy = Engine(model, tokenizer, block_size=4, num_blocks=512, exact=True, progress=False)
    expected = run(roomy, requests)
    tight = Engine(model, tokenizer, block_size=4, num_blocks=40, max_batch_size=12, exact=True, progress=False)
    outputs = run(tight, requests)
    assert sum(o.num_preemptions for o in outputs) > 0
    check_constrained(tokenizer, requests, outputs)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_prefix_reuse_and_lora_adapters_keep_outputs_valid(model, tokenizer):
    engine = Engine(model, tokenizer, block_size=4, num_blocks=256, adapters={"qv": random_lora(model, seed=1, rank=4)},
                    exact=True, progress=False)  # fmt: skip
    prompt = list(range(10, 30))
    requests = [(prompt, {"max_new_tokens": 64, "response_format": f}) for f in BOUNDED[:3]]
    outputs = []
    for adapter in (None, "qv"):
        for request in requests:  # one after another: the later ones find the prompt's blocks cached
            outputs += engine.generate([request[0]], adapter=adapter, **request[1])
    check_constrained(tokenizer, requests * 2, outputs)
    assert all(o.prefix_tokens_reused > 0 for i, o in enumerate(outputs) if i % 3)
    assert [o.adapter for o in outputs] == [None] * 3 + ["qv"] * 3


def test_a_dead_end_finishes_the_request_with_the_reason_and_frees_its_blocks(model, tokenizer):
    """`min_new_tokens` holds back the end-of-sequence token that is all a complete choice allows: no token is
    left, and the request ends with an error saying so (never a hang, never a token outside the format)."""
    engine = Engine(model, tokenizer, block_size=4, num_blocks=64, exact=True, progress=False)
    choice = ResponseFormat.choice(["yes"])
    dead, fine = run(engine, [([5, 6, 7], {"max_new_tokens": 20, "min_new_tokens": 10, "response_format": choice}),
                              ([5, 6, 7], {"max_new_tokens": 20, "response_format": choice})])  # fmt: skip
    assert dead.finish_reason == "error" and "dead end" in dead.error
    assert tokenizer.decode(dead.token_ids) == "yes" and fine.text == "yes" and fine.finish_reason == "stop"
    engine.pool.check_invariants()
    assert engine.pool.stats().num_used == 0


def test_without_eos_tokens_the_request_ends_when_the_format_is_complete(model, tokenizer):
    engine = Engine(model, tokenizer, block_size=4, num_blocks=64, exact=True, progress=False)
    [output] = run(engine, [([5, 6], {"max_new_tokens": 30, "eos_token_id": [], "response_format": FORMATS[3]})])
    assert output.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", output.text)


def test_response_format_errors_queue_nothing(model, tokenizer):
    engine = Engine(model, tokenizer, block_size=4, num_blocks=64, exact=True, progress=False)
    with pytest.raises(ResponseFormatError, match="cannot be compiled"):
        engine.add_request([5, 6], response_format={"type": "regex", "regex": "("})
    with pytest.raises(ValueError, match="keyword 'not'"):
        engine.add_request([5, 6], response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}})
    assert not engine.has_unfinished_requests()
    no_tokenizer = Engine(model, block_size=4, num_blocks=64, exact=True, progress=False)
    with pytest.raises(ResponseFormatError, match="needs the engine's tokenizer"):
        no_tokenizer.add_request([5, 6], response_format={"type": "json_object"})


# ---------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_the_processor_is_valid_and_the_same_on_every_cache(model, tokenizer, num_beams):
    """`GrammarLogitsProcessor` in stock `generate` (greedy and beam search, a left-padded batch): valid outputs,
    token-identical between `DynamicCache` and the paged cache."""
    prompts = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = (prompts != 0).long()
    response_format = schema_format(VERDICT)
    outputs = {}
    for cache in ("dynamic", "paged"):
        options = {"past_key_values": DynamicCache()} if cache == "dynamic" else {"cache_implementation": "paged"}
        processor = GrammarLogitsProcessor(tokenizer, response_format)
        options.update(max_new_tokens=30, num_beams=num_beams, do_sample=False, pad_token_id=0)
        outputs[cache] = model.generate(prompts, attention_mask=mask, logits_processor=[processor], **options)
    assert torch.equal(outputs["dynamic"], outputs["paged"])
    for row in outputs["paged"][:, prompts.shape[1] :].tolist():
        assert EOS in row
        assert valid(tokenizer.decode(row[: row.index(EOS)]), response_format)
    free = model.generate(prompts, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert not any(valid(tokenizer.decode(row), response_format) for row in free[:, prompts.shape[1] :].tolist())


def test_the_processor_follows_beams_that_swap_rows_and_share_a_parent(tokenizer):
    """Rows given in any order, two rows grown from one parent, a row arriving with several new tokens: each row's
    mask is that of its own tokens."""
    processor = GrammarLogitsProcessor(tokenizer, ResponseFormat.regex("(ab|ac)d"))
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in "abcd"}
    scores = torch.zeros(2, VOCAB)
    allowed = lambda out: sorted(tokenizer.decode([t]) for t in (out > float("-inf")).nonzero().flatten().tolist())  # noqa: E731
    out = processor(torch.tensor([[7], [7]]), scores.clone())
    assert allowed(out[0]) == allowed(out[1]) == ["a", "ab", "ac"]  # the vocabulary has "ab" and "ac" too
    out = processor(torch.tensor([[7, ids["a"]], [7, ids["a"]]]), scores.clone())
    assert {"b", "c"} <= set(allowed(out[0])) and all(text[0] in "bc" for text in allowed(out[0]))
    out = processor(torch.tensor([[7, ids["a"], ids["c"]], [7, ids["a"], ids["b"]]]), scores.clone())  # one parent
    assert allowed(out[0]) == allowed(out[1]) == ["d"]
    out = processor(torch.tensor([[7, ids["a"], ids["b"], ids["d"]], [7, ids["a"], ids["c"], ids["d"]]]), scores)
    assert allowed(out[0]) == allowed(out[1]) == ["<|im_end|>"]
    fresh = GrammarLogitsProcessor(tokenizer, ResponseFormat.regex("(ab|ac)d"))
    fresh(torch.tensor([[7]]), torch.zeros(1, VOCAB))
    out = fresh(torch.tensor([[7, ids["a"], ids["c"]]]), torch.zeros(1, VOCAB))  # two tokens at once: replayed
    assert allowed(out[0]) == ["d"]


def test_the_processor_is_exported_and_refuses_text(tokenizer):
    assert hf_paged.structured.GrammarLogitsProcessor is GrammarLogitsProcessor
    with pytest.raises(ResponseFormatError, match="other than text"):
        GrammarLogitsProcessor(tokenizer, {"type": "text"})


@pytest.mark.parametrize("vocab_size", [VOCAB, 1000, 77])
def test_the_bitmask_bias_masks_exactly_as_xgrammars_own_apply(vocab_size):
    import xgrammar

    from hf_paged.structured.grammar import bitmask_bias

    generator = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab_size + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(5, vocab_size, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size)
    assert torch.equal(logits + bitmask_bias(bitmask, vocab_size), expected)
    assert torch.isneginf(expected).any() and torch.isfinite(expected).any()
