"""Engine: OpenAI's sampling options — log-probabilities of the raw logits, frequency/presence penalties and logit
bias — equal stock `generate` (DynamicCache) with the same adjustments, alone and in a mixed batch."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged import Engine
from hf_paged.engine import SamplingParams

PROMPTS = [[5, 9, 17, 33, 12], [40, 41, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


class Reference(LogitsProcessor):
    """OpenAI's definition, written independently: `logit[j] += bias[j] - count[j] * frequency - (count[j] > 0) *
    presence`, counting generated tokens only."""

    def __init__(self, prompt_length: int, frequency: float = 0.0, presence: float = 0.0, bias: dict | None = None):
        self.prompt_length, self.frequency, self.presence, self.bias = prompt_length, frequency, presence, bias or {}

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        generated = input_ids[0, self.prompt_length :].tolist()
        for token, value in self.bias.items():
            scores[0, token] += value
        for token in set(generated):
            scores[0, token] -= generated.count(token) * self.frequency + self.presence
        return scores


def reference(model, prompt, new_tokens, **penalties):
    output = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([Reference(len(prompt), **penalties)]),
        output_logits=True,
        return_dict_in_generate=True,
    )
    rows = [torch.log_softmax(step[0].float(), dim=-1) for step in output.logits]
    return output.sequences[0, len(prompt) :].tolist(), rows


CASES = {
    "plain": {},
    "frequency": {"frequency_penalty": 0.8},
    "presence": {"presence_penalty": -1.5},
    "both": {"frequency_penalty": 1.0, "presence_penalty": -1.5},
    "bias": {"logit_bias": {3: 2.0, 50: -100.0, 60: 0.5}},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_options_and_logprobs_match_generate(llama, options):
    penalties = {
        "frequency": options.get("frequency_penalty", 0.0),
        "presence": options.get("presence_penalty", 0.0),
        "bias": options.get("logit_bias"),
    }
    expected = [reference(llama, p, 10, **penalties) for p in PROMPTS]
    plain = [reference(llama, p, 10)[0] for p in PROMPTS]
    if options:
        assert [tokens for tokens, _ in expected] != plain  # the option changes the answer
    engine = Engine(llama, block_size=4, num_blocks=64, exact=True)
    outputs = engine.generate(PROMPTS, max_new_tokens=10, min_new_tokens=10, logprobs=5, **options)
    for output, (tokens, rows) in zip(outputs, expected):
        assert output.token_ids == tokens
        assert [entry.token_id for entry in output.logprobs] == tokens
        for entry, row in zip(output.logprobs, rows):
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-5)
            best = row.topk(5)
            assert [t for t, _ in entry.top] == best.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert engine.pool.stats().num_used == 0


def test_sampled_logprobs_are_those_of_the_raw_distribution(llama):
    engine = Engine(llama, block_size=4, num_blocks=64, exact=True)
    [output] = engine.generate([PROMPTS[0]], max_new_tokens=8, do_sample=True, temperature=0.7, seed=3, logprobs=0)
    sequence = torch.tensor([PROMPTS[0] + output.token_ids])
    with torch.no_grad():
        logits = llama(sequence).logits[0, len(PROMPTS[0]) - 1 : -1]  # teacher forcing: one forward
    expected = torch.log_softmax(logits.float(), dim=-1)
    for position, entry in enumerate(output.logprobs):
        assert entry.top == () and entry.logprob == pytest.approx(float(expected[position, entry.token_id]), abs=1e-4)


def test_streamed_logprobs_come_with_their_tokens_and_only_when_asked(llama):
    engine = Engine(llama, block_size=4, num_blocks=64, exact=True)
    pieces = {}
    for output in engine.stream(PROMPTS[:2], max_new_tokens=6, min_new_tokens=6, logprobs=2):
        assert [e.token_id for e in output.new_logprobs] == output.new_token_ids
        pieces.setdefault(output.request_id, []).extend(output.new_logprobs)
        if output.finished:
            assert pieces[output.request_id] == output.logprobs
    [plain] = engine.generate([PROMPTS[0]], max_new_tokens=3)
    assert plain.logprobs is None and plain.new_logprobs is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seed": 2**64}, "seed must be in [0, 2**64), got 18446744073709551616"),
        ({"seed": -1}, "seed must be in [0, 2**64), got -1"),
        ({"logprobs": -1}, "logprobs must be None or an int >= 0, got -1"),
        ({"logit_bias": {128: 1.0}}, "logit_bias token ids must be in [0, 128), got [128]"),
        (
            {"logit_bias": {3: float("nan")}},
            "logit_bias values must be numbers in [-100.0, 100.0], got nan for token 3",
        ),
        # finite in Python, infinite in the float32 logits (they failed every request of the step)
        ({"logit_bias": {3: 1e39}}, "logit_bias values must be numbers in [-100.0, 100.0], got 1e+39 for token 3"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a number in [-2.0, 2.0], got inf"),
        ({"presence_penalty": 1e39}, "presence_penalty must be a number in [-2.0, 2.0], got 1e+39"),
    ],
)
def test_bad_options_are_refused_clearly(llama, options, message):
    engine = Engine(llama, block_size=4, num_blocks=16, exact=True)
    with pytest.raises(ValueError) as caught:
        engine.add_request([5, 6], **options)
    assert message in str(caught.value)


def test_logit_bias_accepts_a_mapping_or_pairs():
    assert SamplingParams(logit_bias={7: 1, 2: -3}).logit_bias == ((2, -3.0), (7, 1.0))
    assert SamplingParams(logit_bias=[(7, 1.0)]).uses_processors
