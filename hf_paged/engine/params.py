"""`SamplingParams`: what one request asks of the `Engine` (a `GenerationConfig`-style subset, validated)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from difflib import get_close_matches

from transformers import GenerationConfig

from ..structured.formats import ResponseFormat

_FROM_GENERATION_CONFIG = (
    "max_new_tokens",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
)
# the OpenAI API's names for options the Engine takes under generate's names (or not at all)
OPENAI_NAMES = {
    "max_tokens": "use max_new_tokens, generate's name for it",
    "max_completion_tokens": "use max_new_tokens, generate's name for it",
    "n": "add the prompt n times (a request returns one sequence; sampled ones draw seeds of their own)",
    "top_logprobs": "use logprobs=k (the k most likely tokens of every step)",
}
STOCK_DEFAULT_TOP_K = 50  # what `generate` samples with when neither the model's config nor the call sets `top_k`
MAX_PENALTY = 2.0  # frequency and presence penalties, as OpenAI's
MAX_LOGIT_BIAS = 100.0  # as OpenAI's
# GenerationConfig options that change which tokens come out and that the Engine does not implement, with the values
# that leave them off: any other value is refused rather than ignored
_UNIMPLEMENTED = {
    "max_length": (None,),  # off too whenever max_new_tokens is set (it takes precedence, as in generate)
    "min_length": (None, 0),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "num_beam_groups": (None, 1),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "bad_words_ids": (None, []),
    "sequence_bias": (None, {}),
    "no_repeat_ngram_size": (None, 0),
    "typical_p": (None, 1.0),
    "min_p": (None, 0.0),
    "top_h": (None,),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "renormalize_logits": (None, False),
    "watermarking_config": (None,),
}


@dataclass(frozen=True)
class SamplingParams:
    """Decoding options of one request.

    Attributes:
        max_new_tokens (`int`): most tokens to generate (0 returns at once).
        min_new_tokens (`int`): end-of-sequence tokens are suppressed until this many were generated.
        do_sample (`bool`): sample from the processed distribution (otherwise greedy).
        temperature, top_k, top_p (`float`, `int`, `float`): sampling warpers (ignored when greedy), as in
            `GenerationConfig`; `top_k=0` and `top_p=1.0` disable theirs.
        repetition_penalty (`float`): `RepetitionPenaltyLogitsProcessor`'s penalty (1.0: off).
        eos_token_id (`tuple[int, ...]`): tokens that end the request (kept in its output).
        stop (`tuple[str, ...]`): strings that end the request (cut from its text; needs a tokenizer).
        seed (`int`, *optional*): seed of the request's own random generator (in `[0, 2**64)`), so its samples do
            not depend on the other requests in the batch.
        frequency_penalty, presence_penalty (`float`): OpenAI's additive penalties, in [-2, 2]: a token's logit is
            lowered by `frequency_penalty` times the number of times it was generated so far, plus
            `presence_penalty` if it was generated at all (the prompt does not count); 0.0: off.
        logit_bias (`tuple[tuple[int, float], ...]`): `(token id, bias)` pairs added to the logits before sampling (a
            `dict` is accepted), biases in [-100, 100]; -100 in practice bans a token, +100 forces it.
        logprobs (`int`, *optional*): report each generated token's log-probability under the model's distribution
            (the raw logits, before penalties, bias and temperature) and the `logprobs` most likely tokens at that
            position; `None`: report nothing.
        response_format (`ResponseFormat`, *optional*): what the output must be (a JSON schema, JSON, a regex, a
            choice, a grammar; OpenAI's `response_format` object or a pydantic model class are accepted): tokens
            that would leave it are masked before sampling, and the request ends once the output is complete (with
            an end-of-sequence token when it has `eos_token_id`s). Needs the engine's tokenizer and xgrammar.

    Example:

    ```python
    >>> from hf_paged.engine import SamplingParams
    >>> SamplingParams(max_new_tokens=8, do_sample=True, top_p=0.9, seed=0).top_p
    0.9
    >>> SamplingParams(temperature=0).do_sample  # greedy: the warpers are ignored, as in generate
    False
    >>> SamplingParams(do_sample=True, temperature=0)
    Traceback (most recent call last):
    ...
    ValueError: temperature must be > 0 when sampling, got 0

    ```
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int | None = None
    response_format: ResponseFormat | None = None

    def __post_init__(self):
        object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        object.__setattr__(self, "eos_token_id", _as_tuple(self.eos_token_id, int, "eos_token_id"))
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop"))
        object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.do_sample and not self.temperature > 0:  # greedy ignores the warpers, as generate does
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature!r}")
        if self.do_sample and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] when sampling, got {self.top_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if any(not text for text in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or self.logprobs < 0
        ):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")

    @classmethod
    def from_generation_config(cls, generation_config: GenerationConfig | None = None, **overrides) -> SamplingParams:
        """Options from a `GenerationConfig` (the model's, usually), then `overrides` (`eos_token_id`, `stop` or
        `stop_strings`, `seed` and the fields above). Unknown names raise `TypeError`; a config option that would
        change the output and that the Engine does not implement (`num_beams`, `bad_words_ids`, `max_length`
        without `max_new_tokens`, ...) raises `ValueError`. An unset `top_k` is `generate`'s default, 50."""
        known = {f.name for f in fields(cls)} | {"stop_strings"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            hints = "".join(f"; {name}: {_hint(name, known)}" for name in unknown if _hint(name, known))
            raise TypeError(f"unknown generation options {unknown}{hints}; supported: {sorted(known)}")
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            kind = type(generation_config).__name__
            raise TypeError(f"generation_config must be a GenerationConfig or SamplingParams, got {kind}")
        values = {}
        if generation_config is not None:
            _check_implemented(generation_config, "max_new_tokens" in overrides)
            values["top_k"] = STOCK_DEFAULT_TOP_K
            for name in _FROM_GENERATION_CONFIG:
                value = getattr(generation_config, name, None)
                if value is not None:
                    values[name] = value
            if generation_config.eos_token_id is not None:
                values["eos_token_id"] = generation_config.eos_token_id
            if getattr(generation_config, "stop_strings", None):
                values["stop"] = generation_config.stop_strings
        if "stop_strings" in overrides:
            overrides["stop"] = overrides.pop("stop_strings")
        values.update({k: v for k, v in overrides.items() if v is not None or k == "seed"})
        if values.get("top_k") is None:
            values.pop("top_k", None)
        return cls(**values)

    def with_seed(self, seed: int) -> SamplingParams:
        return replace(self, seed=seed)

    @property
    def uses_processors(self) -> bool:
        """Whether next-token choice needs more than an argmax over the logits (masked first with a
        `response_format`)."""
        return (
            self.do_sample
            or self.repetition_penalty != 1.0
            or self.min_new_tokens > 0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )


def _hint(name: str, known: set[str]) -> str | None:
    """What to write instead of the unknown option `name`: the Engine's name for an OpenAI one, or a close match."""
    if name in OPENAI_NAMES:
        return f"the OpenAI API's name; {OPENAI_NAMES[name]}"
    close = get_close_matches(name, sorted(known), n=1)
    return f"did you mean {close[0]}?" if close else None


def _check_implemented(config: GenerationConfig, max_new_tokens_given: bool) -> None:
    for name, off in _UNIMPLEMENTED.items():
        value = getattr(config, name, None)
        if name == "max_length" and (max_new_tokens_given or config.max_new_tokens is not None):
            continue
        if not any(value == neutral for neutral in off):
            raise ValueError(
                f"the generation config sets {name}={value!r}, which the Engine does not implement (it would change "
                f"the output); leave it unset{' and set max_new_tokens' if name == 'max_length' else ''}, or use "
                "model.generate"
            )


def _as_tuple(value, kind: type, name: str) -> tuple:
    if value is None:
        return ()
    items = (value,) if isinstance(value, kind) else tuple(value)
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {value!r}")
    return items


def _as_bias(value) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted `(token id, bias)` pairs, from a mapping or pairs."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}") from None
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias!r} for token "
                f"{token}"
            )
    return tuple(sorted((token, float(bias)) for token, bias in pairs))
