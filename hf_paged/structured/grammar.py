"""Compiled grammars and per-sequence matchers over xgrammar: the token masks of structured outputs.

One `GrammarCompiler` per tokenizer and vocabulary size (its token table is read once, about 0.1 s for a 49k
vocabulary); compiled grammars are cached by format. A `TokenConstraint` is one sequence's position in its grammar:
`fill` writes the bitmask of the tokens that may come next, `accept` advances it by the token chosen.
"""

from __future__ import annotations

import json
import sys
import threading
import weakref
from collections import OrderedDict

import torch

from .formats import ResponseFormat, ResponseFormatError

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per compiler (least recently used dropped first)
DEAD_END = -1  # what the sampler returns for a row whose mask leaves no token
MAX_TAGGED_CALLS = 4  # most <tool_call> blocks in one reply (each count is a branch of the grammar)
CALL_TAGS = ("<tool_call>\n", "\n</tool_call>")
TEXT = {"json": r"[^\[{][\s\S]*", "hermes": r"[^<][\s\S]*"}  # words that cannot begin a call


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        raise ResponseFormatError(
            f"structured outputs need xgrammar ({error}): pip install 'hf_paged[structured]'"
        ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles response formats for one tokenizer and vocabulary size (the width of the model's logits, which may
    exceed the tokenizer's: the extra ids are never allowed).

    Args:
        tokenizer: a Hugging Face tokenizer.
        vocab_size (`int`): the model's vocabulary size (`logits.shape[-1]`).

    Example:

    ```python
    >>> from hf_paged.structured import GrammarCompiler, ResponseFormat
    >>> compiler = GrammarCompiler(tokenizer, model.config.vocab_size)  # doctest: +SKIP
    >>> constraint = compiler.constraint(ResponseFormat.choice(["yes", "no"]), stop_token_ids=[2])  # doctest: +SKIP

    ```
    """

    def __init__(self, tokenizer, vocab_size: int):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: OrderedDict[ResponseFormat, object] = OrderedDict()
        self._lock = threading.Lock()
        self._json_words: torch.Tensor | None = None

    def json_words(self) -> torch.Tensor:
        """Bitmask words (int32, xgrammar's layout) allowing every token but those whose text holds a control
        character (U+0000-U+001F): compact JSON never holds one raw, and xgrammar lets them into strings with
        `minLength`/`maxLength` (measured: `"a\x1cb"` accepted under `{"type": "string", "maxLength": 8}`)."""
        if self._json_words is None:
            allowed = torch.ones((self.vocab_size + 31) // 32 * 32, dtype=torch.bool)
            special = set(self.info.special_token_ids)
            for token, text in enumerate(self.info.decoded_vocab[: self.vocab_size]):
                if token not in special and any(byte < 0x20 for byte in text):
                    allowed[token] = False
            weights = torch.tensor([1 << bit for bit in range(32)], dtype=torch.int64)
            words = (allowed.view(-1, 32).long() * weights).sum(dim=1)
            self._json_words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return self._json_words

    def compile(self, response_format: ResponseFormat):
        """The compiled grammar of `response_format` (cached); `ResponseFormatError` for a regex or grammar that does
        not parse, or a schema xgrammar refuses."""
        with self._lock:
            compiled = self._compiled.get(response_format)
            if compiled is not None:
                self._compiled.move_to_end(response_format)
                return compiled
        compiled = self._compile(response_format)
        with self._lock:
            self._compiled[response_format] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, response_format: ResponseFormat):
        kind, spec = response_format.kind, response_format.spec
        try:
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "json_schema":
                return self._compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=False)
            if kind == "tool_calls":
                return self._compiler.compile_grammar(tool_call_grammar(**json.loads(spec)))
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                alternatives = " | ".join(_ebnf_string(choice) for choice in json.loads(spec))
                return self._compiler.compile_grammar(f"root ::= {alternatives}")
            return self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as error:
            message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            if "] " in message and message.startswith("["):  # xgrammar prefixes "[time] file:line: "
                message = message.split(": ", 1)[-1]
            what = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "tool_calls": "tool call"}[kind]  # fmt: skip
            raise ResponseFormatError(f"the {what} response format cannot be compiled: {message}") from None

    def constraint(self, response_format: ResponseFormat, stop_token_ids=()) -> TokenConstraint:
        """A fresh matcher for one sequence. The output ends with one of `stop_token_ids` once the grammar is
        complete (the only tokens then allowed); with none, it ends as soon as the grammar is complete."""
        words = self.json_words() if response_format.kind in ("json_object", "json_schema") else None
        return TokenConstraint(self, self.compile(response_format), list(stop_token_ids), words=words)


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """The `GrammarCompiler` of `tokenizer` at `vocab_size`, built once and kept while the tokenizer lives."""
    with _compilers_lock:
        by_size = _compilers.setdefault(tokenizer, {})
        compiler = by_size.get(vocab_size)
        if compiler is None:
            compiler = by_size[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


def tool_call_grammar(schema: dict, syntax: str, parallel: bool, or_text: bool):
    """The grammar of `ResponseFormat.tool_calls`."""
    xgr = _xgrammar()
    if syntax == "json":
        array = {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        calls = xgr.Grammar.from_json_schema(json.dumps(array), any_whitespace=False, strict_mode=False)
    else:
        opening, closing = (xgr.Grammar.from_ebnf(f"root ::= {_ebnf_string(tag)}") for tag in CALL_TAGS)
        call = xgr.Grammar.concat(
            opening, xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False), closing
        )
        newline = xgr.Grammar.from_ebnf('root ::= "\\n"')
        counts = range(1, (MAX_TAGGED_CALLS if parallel else 1) + 1)
        calls = xgr.Grammar.union(*(xgr.Grammar.concat(*[call, *[newline, call] * (n - 1)]) for n in counts))
    return xgr.Grammar.union(calls, xgr.Grammar.from_regex(TEXT[syntax])) if or_text else calls


def request_constraint(tokenizer, vocab_size: int, response_format: ResponseFormat, stop_token_ids) -> TokenConstraint:
    """A new request's matcher; `ResponseFormatError` without a tokenizer or for a format that does not compile."""
    if tokenizer is None:
        raise ResponseFormatError("a response_format needs the engine's tokenizer: Engine(model, tokenizer=...)")
    return compiler_for(tokenizer, vocab_size).constraint(response_format, stop_token_ids)


class TokenConstraint:
    """One sequence's matcher: which tokens may come next, advanced token by token."""

    def __init__(self, compiler: GrammarCompiler, compiled, stop_token_ids: list[int], matcher=None, words=None):
        self.compiler = compiler
        self._compiled = compiled
        self._stop_token_ids = stop_token_ids
        self._words = words  # tokens allowed whatever the grammar says (JSON: no raw control character)
        if matcher is None:
            xgr = _xgrammar()
            if stop_token_ids:
                matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
            else:
                matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        self._matcher = matcher

    @property
    def terminated(self) -> bool:
        """Whether the output is complete (its stop token accepted, or with no stop token the grammar's end)."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (`allocate_bitmask`)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._words is not None:
            bitmask[row] &= self._words

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; `False` (and no change) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def fork(self) -> TokenConstraint:
        """An independent copy at the same position (beam search: two beams from one parent)."""
        return TokenConstraint(self.compiler, self._compiled, self._stop_token_ids, self._matcher.fork(), self._words)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows allowing every token (xgrammar's layout: bit `t % 32` of int32 `t // 32`)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, constraints: list[TokenConstraint | None]) -> torch.Tensor:
    """`logits` (`[rows, vocab]`, one row per constraint) with every token the constraints do not allow at -inf
    (a new float32 tensor). A terminated constraint, or `None`, leaves its row as it is."""
    rows, vocab_size = logits.shape
    bitmask = allocate_bitmask(rows, vocab_size)
    for index, constraint in enumerate(constraints):
        if constraint is not None and not constraint.terminated:
            constraint.fill(bitmask, index)
    masked = logits.to(torch.float32, copy=True)
    return masked.add_(bitmask_bias(bitmask.to(logits.device), vocab_size))


def accept_all(constraints: list[TokenConstraint], tokens: list[int]) -> None:
    """Advance every constraint by its token (one call into xgrammar for the whole step)."""
    if constraints:
        _xgrammar().BatchGrammarMatcher.batch_accept_token([c._matcher for c in constraints], tokens)


_BYTE_BIASES: dict[torch.device, torch.Tensor] = {}
_buffers = threading.local()  # the gathered bias of the last step, per thread and device: reused, not reallocated


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The additive bias of `bitmask`: 0 where a token is allowed, -inf elsewhere (`[rows, vocab_size]`, float32; a
    buffer reused by the next call in this thread). Each byte of the mask picks its 8 biases from a 256-row table: one
    gather and one add instead of a select per element (xgrammar's CPU `apply_token_bitmask_inplace` takes ten
    times longer on a 49k vocabulary)."""
    device = bitmask.device
    table = _BYTE_BIASES.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_BIASES[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    assert sys.byteorder == "little"  # int32 words read byte by byte, lowest token first
    codes = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    buffers = getattr(_buffers, "by_device", None)
    if buffers is None:
        buffers = _buffers.by_device = {}
    buffer = buffers.get(device)
    if buffer is None or buffer.shape[0] < codes.numel():
        buffer = buffers[device] = torch.empty(codes.numel(), 8, device=device)
    bias = torch.index_select(table, 0, codes, out=buffer[: codes.numel()])
    return bias.view(bitmask.shape[0], -1)[:, :vocab_size]


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)
