"""`Reply`: the OpenAI response bodies of one call — a whole completion, stream chunks, log-probabilities in the
completions and chat formats, usage."""

from __future__ import annotations

import json
import secrets
import time

from ..engine import RequestOutput
from ..engine.request import TokenLogprob


class TokenTexts:
    """Decodes single tokens for log-probability entries (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = str(token_id) if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


class Reply:
    """Builds the bodies of one completion or chat completion reply.

    Args:
        model_name (`str`): the served model id.
        chat (`bool`): chat completion (else text completion).
        token_text (`TokenTexts`): decodes tokens for log-probability entries.
        logprobs (`int`, *optional*): alternatives per token to report (`None`: no log-probabilities; chat's
            `top_logprobs`, completions' `logprobs`).
        echo (`str`): text put before each choice's text (completions' `echo`).
        include_usage (`bool`): stream a final chunk with the usage (`stream_options.include_usage`).
    """

    def __init__(
        self,
        model_name: str,
        chat: bool,
        token_text: TokenTexts,
        logprobs: int | None = None,
        echo: str = "",
        include_usage: bool = False,
    ):
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_name = model_name
        self.chat = chat
        self.token_text = token_text
        self.logprobs = logprobs
        self.echo = echo
        self.include_usage = include_usage
        self._offsets: dict[int, int] = {}  # completions' text_offset so far, per choice

    # ------------------------------------------------------------------ whole replies
    def complete(self, finals: list[RequestOutput], prompt_tokens: int) -> dict:
        """The non-streaming body for the final outputs of every choice."""
        choices = []
        for index, output in enumerate(finals):
            logprobs = self._logprobs(index, output.logprobs) if self.logprobs is not None else None
            if self.chat:
                message = {"role": "assistant", "content": output.text or ""}
                choice = {"index": index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": self.echo + (output.text or ""), "logprobs": logprobs}
            choice["finish_reason"] = output.finish_reason
            choices.append(choice)
        completion_tokens = sum(len(o.token_ids) for o in finals)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    # ------------------------------------------------------------------ stream chunks
    def opening_chunks(self, n: int) -> list[str]:
        """Events sent before any token: chat's assistant role, or completions' echoed prompt."""
        if self.chat:
            role = {"role": "assistant", "content": ""}
            return [self._event(self._chat_choice(i, role, None, None)) for i in range(n)]
        if self.echo:
            return [self._event(self._text_choice(i, self.echo, None, None)) for i in range(n)]
        return []

    def chunk(self, index: int, output: RequestOutput) -> str | None:
        """The event for an incremental output (`None` when it brings nothing to send)."""
        logprobs = None
        if self.logprobs is not None and output.new_logprobs:
            logprobs = self._logprobs(index, output.new_logprobs)
        reason = output.finish_reason if output.finished else None
        if not output.new_text and logprobs is None and reason is None:
            return None
        if self.chat:
            delta = {"content": output.new_text} if output.new_text else {}
            return self._event(self._chat_choice(index, delta, logprobs, reason))
        return self._event(self._text_choice(index, output.new_text or "", logprobs, reason))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The final chunk of `stream_options.include_usage`: no choices, the usage of the whole call."""
        return self._event([], usage(prompt_tokens, completion_tokens))

    def _chat_choice(self, index, delta, logprobs, reason) -> list[dict]:
        return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]

    def _text_choice(self, index, text, logprobs, reason) -> list[dict]:
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]

    def _event(self, choices: list[dict], usage_value: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage_value
        return sse(body)

    # ------------------------------------------------------------------ log-probabilities
    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict:
        entries = entries or []
        return self._chat_logprobs(entries) if self.chat else self._completion_logprobs(index, entries)

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        content = []
        for entry in entries:
            item = _chat_token(self.token_text(entry.token_id), entry.logprob)
            item["top_logprobs"] = [_chat_token(self.token_text(t), lp) for t, lp in entry.top[: self.logprobs]]
            content.append(item)
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, index: int, entries: list[TokenLogprob]) -> dict:
        """The legacy format: `tokens`, `token_logprobs`, `top_logprobs` (the top `logprobs` tokens plus the chosen
        one, so up to `logprobs + 1` entries) and `text_offset` (into the choice's text)."""
        tokens, top, offsets = [], [], []
        offset = self._offsets.get(index, len(self.echo))
        for entry in entries:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            alternatives = {self.token_text(t): lp for t, lp in entry.top[: self.logprobs]}
            alternatives.setdefault(text, entry.logprob)
            top.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        token_logprobs = [entry.logprob for entry in entries]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(body: dict) -> str:
    """One server-sent event carrying `body` as JSON."""
    return f"data: {json.dumps(body)}\n\n"
