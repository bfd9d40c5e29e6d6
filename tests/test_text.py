"""`TextTracker`: a request's streamed text, decoded incrementally, equals the tokenizer's decode of the whole output,
never shows half a character or the start of a stop string early, and cuts at the first stop string, including one
that begins in the prompt. Run with SmolLM2's byte-level tokenizer on random token ids (many are partial UTF-8
characters)."""

from __future__ import annotations

import random

import pytest

from hf_paged.engine.text import TextTracker

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def multibyte_heavy_ids(tokenizer, length: int, seed: int) -> list[int]:
    """Random token ids, half of them tokens that decode to part of a multi-byte character (CJK, emoji...)."""
    rng = random.Random(seed)
    partial = [i for i in range(1000, 20000) if REPLACEMENT in tokenizer.decode([i])][:300]
    return [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(100, 20000) for _ in range(length)]


class CountingTokenizer:
    """Counts the token ids each `decode` is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tracker: TextTracker, token_ids: list[int]) -> list[str]:
    """Every visible text as the tokens arrive one by one, then the final one."""
    shown = []
    for count in range(1, len(token_ids) + 1):
        tracker.update(token_ids[:count])
        shown.append(tracker.visible)
        if tracker.stopped:
            return shown
    tracker.finish(token_ids)
    return [*shown, tracker.visible]


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_the_whole_decode_and_never_shows_half_a_character(tokenizer, seed):
    token_ids = multibyte_heavy_ids(tokenizer, 120, seed)
    shown = stream(TextTracker(tokenizer), token_ids)
    final = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert shown[-1] == final
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before)
        assert REPLACEMENT not in after[len(before) :] or REPLACEMENT in final[len(before) : len(after)]


@pytest.mark.parametrize("seed", range(6))
def test_the_text_stops_before_the_first_stop_string_and_never_shows_its_start(tokenizer, seed):
    token_ids = multibyte_heavy_ids(tokenizer, 80, seed)
    final = tokenizer.decode(token_ids, skip_special_tokens=True)
    rng = random.Random(seed)
    start = rng.randrange(10, len(final) - 6)
    stop = final[start : start + rng.randrange(2, 6)]
    tracker = TextTracker(tokenizer, (stop,))
    shown = stream(tracker, token_ids)
    assert tracker.stopped and shown[-1] == final[: final.index(stop)]
    assert all(stop not in text for text in shown)


def test_a_stop_string_may_begin_in_the_prompt(tokenizer):
    prompt = tokenizer("The capital of France is")["input_ids"]
    output = tokenizer(" Paris.")["input_ids"]
    across = TextTracker(tokenizer, (" is Paris",), prompt)
    assert stream(across, output)[-1] == "" and across.stopped
    short = TextTracker(tokenizer, ("s ",), prompt)  # two characters, ended by a six-character first token
    assert stream(short, output)[-1] == "" and short.stopped
    inside = TextTracker(tokenizer, ("France",), prompt)  # in the prompt alone: no stop
    assert stream(inside, output)[-1] == " Paris." and not inside.stopped
    assert len(output) == 2  # " Paris", "."
    later = TextTracker(tokenizer, ("is Paris.",), prompt)  # " Paris" continues it: held back until it stops
    assert stream(later, output) == ["", ""] and later.stopped


def test_only_an_end_that_begins_a_stop_string_is_held_back(tokenizer):
    """Streamed text keeps pace with its tokens: what is held back is the longest end of the text that begins a
    stop string, nothing more (a fixed tail as long as the longest stop string would lag behind the tokens)."""
    prompt = tokenizer("Count:")["input_ids"]
    output = tokenizer(" one, two, three, four, five")["input_ids"]
    stops = ("three!", ", fi")
    tracker = TextTracker(tokenizer, stops, prompt)
    for count in range(1, len(output)):  # the last token, " five", ends ", fi"
        tracker.update(output[:count])
        text = tokenizer.decode(output[:count])
        held = max((n for n in range(1, 6) if any(s.startswith(text[-n:]) for s in stops)), default=0)
        assert tracker.visible == text[: len(text) - held], (count, text)
    tracker.update(output)
    assert tracker.stopped and tracker.visible == " one, two, three, four"


def test_each_step_decodes_a_few_tokens_not_the_whole_output(tokenizer):
    """The tracker decodes the new tokens with a token of context (the old one decoded the whole output at every
    step: 2,000 tokens cost ~0.9 ms a step, see docs/benchmarks.md)."""
    counting = CountingTokenizer(tokenizer)
    token_ids = multibyte_heavy_ids(tokenizer, 400, seed=9)
    shown = stream(TextTracker(counting, ("zzzz",)), token_ids)
    assert shown[-1] == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert max(counting.decoded) <= 16  # a partial character waits for a few tokens at most
