"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice or a grammar (xgrammar's token masks).

`ResponseFormat` says what an output must be; the Engine takes one per request (`response_format=`), `hf-paged
serve` reads OpenAI's `response_format` and the `structured_outputs` extension, and `GrammarLogitsProcessor` brings
the same to `model.generate` with any cache. Needs the "structured" extra (`pip install 'hf_paged[structured]'`).
"""

from .formats import ResponseFormat, ResponseFormatError
from .grammar import GrammarCompiler, TokenConstraint, compiler_for, mask_logits
from .logits_processor import GrammarLogitsProcessor

__all__ = [
    "GrammarCompiler",
    "GrammarLogitsProcessor",
    "ResponseFormat",
    "ResponseFormatError",
    "TokenConstraint",
    "compiler_for",
    "mask_logits",
]
