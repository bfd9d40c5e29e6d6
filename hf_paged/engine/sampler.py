"""Next-token choice for a batch of requests, each with its own options and random generator.

The work is done by transformers' own `LogitsProcessor`s (repetition penalty, minimum length, temperature, top-k,
top-p), applied row by row so that a request's result never depends on the other rows of the batch.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .params import SamplingParams
from .request import Request


def logits_processors(params: SamplingParams, prompt_length: int) -> LogitsProcessorList:
    """The processors `generate` would apply for `params`, in its order (processors, then sampling warpers)."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.min_new_tokens > 0 and params.eos_token_id:
        processors.append(
            MinNewTokensLengthLogitsProcessor(prompt_length, params.min_new_tokens, list(params.eos_token_id))
        )
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
    return processors


def next_tokens(requests: list[Request], logits: torch.Tensor) -> list[int]:
    """One token per request from `logits` (`[batch, vocab]`, the last position of each row)."""
    logits = logits.float()
    chosen = logits.argmax(dim=-1).tolist()
    for index, request in enumerate(requests):
        params = request.params
        if not params.uses_processors:
            continue
        row = logits[index : index + 1]
        if request.processors is None:  # built once per request
            request.processors = logits_processors(params, len(request.prompt_token_ids))
        processors = request.processors
        if processors:
            ids = torch.tensor([request.token_ids], dtype=torch.long, device=logits.device)
            row = processors(ids, row)
        if params.do_sample:
            probs = torch.softmax(row, dim=-1)
            chosen[index] = int(torch.multinomial(probs, 1, generator=request.generator))
        else:
            chosen[index] = int(row.argmax(dim=-1))
    return chosen
