"""`Request` (the engine's state for one prompt) and `RequestOutput` (what callers see)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import LogitsProcessorList

from ..adapters import LoraAdapter
from ..rows import Row
from ..structured.grammar import TokenConstraint
from .params import SamplingParams
from .text import TextTracker


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks and decodes every step
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's distribution (log-softmax of the raw logits, before
    penalties, bias and temperature) and the most likely tokens at its position.

    Attributes:
        token_id (`int`): the generated token.
        logprob (`float`): its log-probability.
        top (`tuple[tuple[int, float], ...]`): `(token id, log-probability)` of the most likely tokens, most likely
            first (`SamplingParams.logprobs` of them).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One request's output so far (`engine.step()` / `engine.stream()`) or in full (`engine.generate()`).

    Attributes:
        request_id (`str`): the id given to or chosen by `add_request`.
        prompt_token_ids (`list[int]`): the prompt.
        token_ids (`list[int]`): every token generated so far (an end-of-sequence token included).
        text (`str | None`): their text (stop strings cut off), when the engine has a tokenizer.
        new_token_ids (`list[int]`): tokens generated since the request's previous output.
        new_text (`str | None`): text added since the previous output.
        finished (`bool`): whether the request is done.
        finish_reason (`str | None`): `"stop"` (end-of-sequence token or stop string), `"length"`
            (`max_new_tokens`, the model's context, or a pool too small for the request to grow further),
            `"abort"` or `"error"`.
        error (`str | None`): why the request failed (`finish_reason == "error"`), or why it ended before
            `max_new_tokens` when the pool could not hold its next token (`finish_reason == "length"`).
        time_to_first_token (`float | None`): seconds from `add_request` to the first token.
        num_preemptions (`int`): times the request lost its blocks and was recomputed.
        prefix_tokens_reused (`int`): prompt tokens taken from the prefix cache instead of being computed.
        adapter (`str | None`): the LoRA adapter the request ran on (`None`: the base model).
        logprobs (`list[TokenLogprob] | None`): one per generated token, when `SamplingParams.logprobs` is set.
        new_logprobs (`list[TokenLogprob] | None`): those of `new_token_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    new_token_ids: list[int]
    new_text: str | None
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    time_to_first_token: float | None = None
    num_preemptions: int = 0
    prefix_tokens_reused: int = 0
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    adapter: str | None = None


@dataclass(eq=False)
class Request:
    """The engine's state for one prompt. `row` holds the prompt and every generated token but the last."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text: TextTracker | None = None
    generator: torch.Generator | None = None
    adapter: LoraAdapter | None = None  # the LoRA adapter it runs on (None: the base model)
    processors: LogitsProcessorList | None = None  # next-token processors, built on first use (`sampler`)
    constraint: TokenConstraint | None = None  # where its output is in its response format's grammar
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per output token, when `params.logprobs` is set
    status: RequestStatus = RequestStatus.WAITING
    row: Row | None = None
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    admission_time: float | None = None  # when the scheduler first admitted it
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    prefix_tokens_reused: int = 0
    _reported_tokens: int = 0
    _reported_text: int = 0

    @property
    def token_ids(self) -> list[int]:
        """Prompt and generated tokens: what a recompute after preemption prefills."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    @property
    def prefix_namespace(self) -> bytes | None:
        """What besides the model decides its K/V: its adapter's name and weights digest (`None`: the base)."""
        if self.adapter is None:
            return None
        return f"lora\x1f{self.adapter.name}\x1f{self.adapter.digest}".encode()

    @property
    def num_tokens(self) -> int:
        """`len(token_ids)`, without building the list."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.last_token_time = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time
        self.output_token_ids.append(token_id)
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        if self.text is not None:
            self.text.update(self.output_token_ids)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_time = time.perf_counter()
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        if self.text is not None:
            self.text.finish(self.output_token_ids)

    def output(self) -> RequestOutput:
        """The request's output, with what changed since the previous call as `new_*`."""
        text = None if self.text is None else self.text.visible
        new_ids = self.output_token_ids[self._reported_tokens :]
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = list(self.logprobs or ())
        new_logprobs = None if logprobs is None else logprobs[self._reported_tokens :]
        new_text = None if text is None else text[self._reported_text :]
        self._reported_tokens = len(self.output_token_ids)
        self._reported_text = 0 if text is None else len(text)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            text=text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            time_to_first_token=ttft,
            num_preemptions=self.num_preemptions,
            prefix_tokens_reused=self.prefix_tokens_reused,
            logprobs=logprobs,
            new_logprobs=new_logprobs,
            adapter=self.adapter_name,
        )
