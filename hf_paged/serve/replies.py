"""`Reply`: the OpenAI response bodies of one call — a whole completion, stream chunks, log-probabilities in the
completions and chat formats, usage."""

from __future__ import annotations

import codecs
import json
import secrets
import time

from ..engine import RequestOutput
from ..engine.request import TokenLogprob

TOKEN_CACHE_SIZE = 4096  # tokens whose bytes and text `TokenTexts` keeps


class TokenTexts:
    """The bytes and the display text of single tokens, for log-probability entries (the last `TOKEN_CACHE_SIZE`
    cached).

    A token's bytes are its own UTF-8 bytes in the text (byte-level BPE tokens through the byte-to-character table,
    SentencePiece byte-fallback tokens `<0xNN>` as that byte, other tokens as their text), so the bytes of a
    request's tokens, concatenated, are the bytes of its text even where a token holds only part of a character
    (emoji, CJK). A token whose bytes are no complete UTF-8 text is shown as OpenAI shows it, `bytes:\\xNN...`
    (`"bytes:\\xf0\\x9f"`); special tokens show their own text (and add nothing to the request's text).

    Example:

    ```python
    >>> texts = TokenTexts(None)  # no tokenizer: token ids are their own text
    >>> texts(7), texts.bytes(7)
    ('7', b'7')

    ```
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        decoder = _decoder_state(tokenizer)
        self._byte_level = '"ByteLevel"' in decoder
        self._byte_fallback = '"ByteFallback"' in decoder
        self._metaspace = "\u2581" in decoder or "\\u2581" in decoder  # SentencePiece's "▁" (raw or JSON-escaped)

    def __call__(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        """The token's own UTF-8 bytes."""
        return self._entry(token_id)[1]

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a special token (which the request's text skips)."""
        return token_id in self._special

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            if len(self._cache) >= TOKEN_CACHE_SIZE:  # bounded: the oldest entry goes
                del self._cache[next(iter(self._cache))]
            entry = self._cache[token_id] = (text, raw)
        return entry

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return str(token_id).encode()
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(char in _BYTE_OF_CHAR for char in piece):
                return bytes(_BYTE_OF_CHAR[char] for char in piece)
            if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self._metaspace:
                return piece.replace("▁", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")


def _decoder_state(tokenizer) -> str:
    """The JSON of a fast tokenizer's decoder (`""` when there is none to read)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        return decoder.__getstate__().decode("utf-8") if decoder is not None else ""
    except Exception:  # noqa: BLE001 - an unusual decoder: tokens are read as their text
        return ""


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level table: every byte as the printable character byte-level BPE vocabularies spell it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {char: byte for byte, char in _byte_to_char().items()}


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
        tools (`ToolCalling`, *optional*): the chat call's tools: a reply holding calls becomes `tool_calls`
            (streamed in one chunk once complete; words stream as they come).
    """

    def __init__(
        self,
        model_name: str,
        chat: bool,
        token_text: TokenTexts,
        logprobs: int | None = None,
        echo: str = "",
        include_usage: bool = False,
        tools=None,
    ):
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_name = model_name
        self.chat = chat
        self.token_text = token_text
        self.logprobs = logprobs
        self.echo = echo
        self.include_usage = include_usage
        self.tools = tools
        self._held: dict[int, str] = {}  # with tools: text held back per choice while it may be a call
        self._in_words: set[int] = set()  # with tools: choices whose reply began as text (no call can follow)
        self._offsets: dict[int, tuple] = {}  # completions' text offset so far and its UTF-8 decoder, per choice

    # ------------------------------------------------------------------ whole replies
    def complete(self, finals: list[RequestOutput], prompt_tokens: int) -> dict:
        """The non-streaming body for the final outputs of every choice."""
        choices = []
        for index, output in enumerate(finals):
            logprobs = self._logprobs(index, output.logprobs, output) if self.logprobs is not None else None
            calls = None if self.tools is None else self.tools.parse(output.text or "")
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                choice = {"index": index, "message": message, "logprobs": logprobs}
            elif self.chat:
                message = {"role": "assistant", "content": output.text or ""}
                choice = {"index": index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": self.echo + (output.text or ""), "logprobs": logprobs}
            choice["finish_reason"] = self.tools.finish_reason() if calls is not None else output.finish_reason
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
            logprobs = self._logprobs(index, output.new_logprobs, output)
        reason = output.finish_reason if output.finished else None
        if self.tools is not None:
            return self._tool_chunk(index, output, logprobs, reason)
        if not output.new_text and logprobs is None and reason is None:
            return None
        if self.chat:
            delta = {"content": output.new_text} if output.new_text else {}
            return self._event(self._chat_choice(index, delta, logprobs, reason))
        return self._event(self._text_choice(index, output.new_text or "", logprobs, reason))

    def _tool_chunk(self, index: int, output: RequestOutput, logprobs, reason) -> str | None:
        """With tools: a reply that begins as calls do (`[`, or `<` for tags) is held until it is complete and sent as
        `tool_calls`; a reply that begins with other text streams as it comes."""
        text = output.new_text or ""
        if index not in self._in_words:
            held = self._held.pop(index, "") + text
            if held and self.tools.begins_call(held):
                if reason is None:
                    self._held[index] = held
                    return None  # the held tokens' log-probabilities wait for the call too
                if self.logprobs is not None:  # every token was held
                    logprobs = self._logprobs(index, output.logprobs, output)
                calls = self.tools.parse(held)
                if calls is not None:
                    delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                    return self._event(self._chat_choice(index, delta, logprobs, self.tools.finish_reason()))
            elif held:
                self._in_words.add(index)
            text = held  # text, or a call cut short by max_tokens
        if not text and logprobs is None and reason is None:
            return None
        return self._event(self._chat_choice(index, {"content": text} if text else {}, logprobs, reason))

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
    def _logprobs(self, index: int, entries: list[TokenLogprob] | None, output: RequestOutput) -> dict:
        entries = entries or []
        if self.chat:
            return self._chat_logprobs(entries)
        return self._completion_logprobs(index, entries, len(self.echo) + len(output.text or ""))

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        content = []
        for entry in entries:
            item = self._chat_token(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_token(t, lp) for t, lp in entry.top[: self.logprobs]]
            content.append(item)
        return {"content": content, "refusal": None}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": logprob, "bytes": list(self.token_text.bytes(token_id))}

    def _completion_logprobs(self, index: int, entries: list[TokenLogprob], text_length: int) -> dict:
        """The legacy format: `tokens`, `token_logprobs`, `top_logprobs` (the top `logprobs` tokens plus the chosen
        one, so up to `logprobs + 1` entries) and `text_offset`: where each token begins in the choice's text
        (`text_length` characters so far, the echoed prompt included), counting the characters the bytes of the
        tokens before it complete. A token that continues a character begun by the tokens before it therefore
        starts where that character does; special tokens add no text; no offset passes the text (tokens of a stop
        string cut from it)."""
        tokens, top, offsets = [], [], []
        offset, decoder = self._offsets.get(index) or (len(self.echo), codecs.getincrementaldecoder("utf-8")("replace"))
        for entry in entries:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            alternatives = {self.token_text(t): lp for t, lp in entry.top[: self.logprobs]}
            alternatives.setdefault(text, entry.logprob)
            top.append(alternatives)
            offsets.append(min(offset, text_length))
            if not self.token_text.is_special(entry.token_id):
                offset += len(decoder.decode(self.token_text.bytes(entry.token_id)))
        self._offsets[index] = (offset, decoder)
        token_logprobs = [entry.logprob for entry in entries]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(body: dict) -> str:
    """One server-sent event carrying `body` as JSON."""
    return f"data: {json.dumps(body)}\n\n"
