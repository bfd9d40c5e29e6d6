"""`GrammarLogitsProcessor`: structured outputs for `model.generate`, with any cache (the stock ones and "paged")."""

from __future__ import annotations

from transformers import LogitsProcessor
from transformers.utils import logging

from .formats import ResponseFormat, ResponseFormatError
from .grammar import TokenConstraint, compiler_for, mask_logits

logger = logging.get_logger(__name__)


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks every token that would leave `response_format`, so that each sequence `generate` returns is valid
    (its end-of-sequence token comes once the format is complete; with `max_new_tokens` too small, the output is
    cut short, as any output is).

    Every row keeps its own matcher, keyed by the tokens it generated: beams that swap rows, or two beams grown
    from one parent (the matcher forked), are followed wherever they go, and a row that came to its tokens any
    other way (assisted decoding's several tokens a step) is replayed from the start. One processor serves one
    `generate` call (it learns the prompt's length at its first call).

    Args:
        tokenizer: the model's tokenizer.
        response_format: a `ResponseFormat`, OpenAI's `response_format` object, or a pydantic model class.
        eos_token_id (`int | list[int]`, *optional*): the tokens that end a sequence (default: the tokenizer's
            end-of-sequence token); the only tokens allowed once the format is complete.

    Example:

    ```python
    >>> from hf_paged.structured import GrammarLogitsProcessor
    >>> processor = GrammarLogitsProcessor(tokenizer, {"type": "json_object"})  # doctest: +SKIP
    >>> model.generate(**inputs, logits_processor=[processor], cache_implementation="paged")  # doctest: +SKIP

    ```
    """

    def __init__(self, tokenizer, response_format, eos_token_id: int | list[int] | None = None):
        self.response_format = ResponseFormat.parse(response_format)
        if self.response_format is None:
            raise ResponseFormatError("GrammarLogitsProcessor needs a response format other than text")
        if eos_token_id is None:
            eos_token_id = tokenizer.eos_token_id
        self.stop_token_ids = [] if eos_token_id is None else [int(t) for t in _as_list(eos_token_id)]
        self.tokenizer = tokenizer
        self._prompt_length: int | None = None
        self._states: dict[tuple[int, ...], TokenConstraint] = {}
        self._compiler = None
        self._warned = False

    def __call__(self, input_ids, scores):
        if self._prompt_length is None:
            self._prompt_length = input_ids.shape[1]
            self._compiler = compiler_for(self.tokenizer, scores.shape[-1])
            self._compiler.compile(self.response_format)  # a format that does not compile fails before any step
        keys = [tuple(row) for row in input_ids[:, self._prompt_length :].tolist()]
        self._states = self._advance(keys)
        constraints = [self._states[key] for key in keys]
        masked = mask_logits(scores, constraints)
        dead = (masked.amax(dim=-1) == float("-inf")).nonzero().flatten().tolist()
        if dead and self.stop_token_ids:  # nothing continues the format: end the row rather than pick at random
            if not self._warned:
                logger.warning("GrammarLogitsProcessor: no token continues the response format; ending the sequence")
                self._warned = True
            masked[dead, self.stop_token_ids[0]] = 0.0
        return masked.to(scores.dtype)

    def _advance(self, keys: list[tuple[int, ...]]) -> dict[tuple[int, ...], TokenConstraint | None]:
        """The matcher of every row's tokens: its parent's advanced by its last token (forked, before anything
        advances, where a parent has several children), or a fresh one replaying them; `None` for a row whose
        tokens left the format (the pads `generate` appends after a row ended): it is not masked."""
        states: dict[tuple[int, ...], TokenConstraint | None] = {}
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for key in dict.fromkeys(keys):
            if not key:
                states[key] = self._states.get(key) or self._fresh()
            elif key[:-1] in self._states:
                children.setdefault(key[:-1], []).append(key)
            else:
                states[key] = self._replay(key)
        for parent_key, kids in children.items():
            parent = self._states[parent_key]
            if parent is None:
                states.update(dict.fromkeys(kids))
                continue
            forks = [parent] + [parent.fork() for _ in kids[1:]]
            for key, constraint in zip(kids, forks):
                if not constraint.terminated and not constraint.accept(key[-1]):
                    constraint = None
                states[key] = constraint
        return states

    def _fresh(self) -> TokenConstraint:
        return self._compiler.constraint(self.response_format, self.stop_token_ids)

    def _replay(self, key: tuple[int, ...]) -> TokenConstraint | None:
        constraint = self._fresh()
        for token in key:
            if constraint.terminated:
                break  # pads after the end
            if not constraint.accept(token):
                return None
        return constraint


def _as_list(value) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]
