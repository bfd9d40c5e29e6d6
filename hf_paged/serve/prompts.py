"""`PromptEncoder`: prompts and chat messages to token ids, with an early refusal of prompts evidently longer than
the model's context (before tokenizing megabytes). Tokenizing and templating are CPU-bound: the server calls them
from a worker thread."""

from __future__ import annotations

from ..engine.prompts import out_of_vocabulary
from .errors import APIError


class PromptEncoder:
    """Tokenizes prompts and applies the chat template of `tokenizer`.

    A prompt is *evidently* too long when it has more characters than `max_context` tokens can spell: no token of
    the vocabulary decodes to more characters than its longest entry (`longest_token_chars`), so
    `len(text) > max_context * longest_token_chars` means more than `max_context` tokens.

    Args:
        tokenizer: the model's tokenizer (`None`: only token-id prompts).
        max_context (`int`, *optional*): the model's context window in tokens.
        vocab_size (`int`, *optional*): token-id prompts are checked to lie in `[0, vocab_size)`.

    Example:

    ```python
    >>> class Letters:  # every token is one letter
    ...     def get_vocab(self):
    ...         return {"a": 0, "b": 1}
    >>> encoder = PromptEncoder(Letters(), max_context=4)
    >>> encoder.max_chars
    4
    >>> try:
    ...     encoder.check_evident_length(5, "prompt")
    ... except APIError as error:
    ...     print(error.code)
    context_length_exceeded

    ```
    """

    def __init__(self, tokenizer, max_context: int | None, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.max_chars = None
        if tokenizer is not None and max_context is not None:
            self.max_chars = max_context * longest_token_chars(tokenizer)

    def check_evident_length(self, num_chars: int, param: str) -> None:
        """Raise a 400 when `num_chars` characters are certainly more than the context window."""
        if self.max_chars is not None and num_chars > self.max_chars:
            raise APIError(
                400,
                f"{param}: {num_chars} characters are more than the model's context window of {self.max_context} "
                f"tokens can hold (at most {self.max_chars} characters with this vocabulary)",
                param,
                "context_length_exceeded",
            )

    def encode(self, prompt: str | list[int], special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (token ids are returned as given, once checked against the vocabulary).
        A text prompt is tokenized as `tokenizer(prompt)` does, with the tokenizer's special tokens (a BOS token,
        for most tokenizers), as stock `generate` users and vLLM tokenize it; `special_tokens=False` for a text
        that already holds them (a chat template's)."""
        if isinstance(prompt, list):
            bad = [] if self.vocab_size is None else out_of_vocabulary(prompt, self.vocab_size)
            if bad:
                raise APIError(400, f"prompt: token ids must be in [0, {self.vocab_size}), got {bad[:5]}", "prompt")
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer: send the prompt as a list of token ids", "prompt")
        return self.tokenizer(prompt, add_special_tokens=special_tokens)["input_ids"]

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (and `tools`, for a template that renders them), ending with the
        assistant's turn."""
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def longest_token_chars(tokenizer) -> int:
    """The most characters any vocabulary entry has (byte-level and SentencePiece entries spell one character per
    byte or character of the text they decode to)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1
