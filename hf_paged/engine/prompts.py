"""What a request's prompt and options become before the Engine queues it: token ids and `SamplingParams`, checked,
with errors that name the value and the limit."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

from transformers import GenerationConfig

from .params import SamplingParams

Prompt = str | Sequence[int]


def sampling_params(generation_config, options: dict, model_config: GenerationConfig) -> SamplingParams:
    """`SamplingParams` of `options` over `generation_config` (a `GenerationConfig` or `SamplingParams`; `None`: the
    model's, `model_config`)."""
    if isinstance(generation_config, SamplingParams):
        return SamplingParams.from_generation_config(None, **{**_fields(generation_config), **options})
    config = generation_config if generation_config is not None else model_config
    return SamplingParams.from_generation_config(config, **options)


def masked_pad(generation_config, options: dict, model_config: GenerationConfig) -> int | None:
    """The pad token `generate` masks in a tensor of token ids given without an attention mask: the config's
    `pad_token_id` (`model_config`'s when `generation_config` is none), unless it is also an end-of-sequence token
    (then `generate` cannot tell pads apart)."""
    config = generation_config if isinstance(generation_config, GenerationConfig) else model_config
    pad = config.pad_token_id
    eos = options.get("eos_token_id")
    if eos is None:
        eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = config.eos_token_id
    eos = [] if eos is None else [eos] if is_token(eos) else list(eos)
    return None if pad is None or pad in eos else pad


def prompt_token_ids(prompt: Prompt, tokenizer, vocab_size: int, max_context: int | None) -> list[int]:
    """The token ids of one prompt (a string, with `tokenizer`; token ids; a 1-D or `[1, length]` tensor or array; a
    tokenizer's output of one prompt), refused when empty, outside the vocabulary or as long as the context window."""
    if isinstance(prompt, Mapping):  # a tokenizer's output (apply_chat_template's)
        prompts = _encoded_prompts(prompt)
        if len(prompts) != 1:
            raise ValueError(f"one prompt was expected, got a tokenizer output of {len(prompts)}")
        prompt = prompts[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: Engine(model, tokenizer)")
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    elif hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # a torch tensor or a numpy array
        if prompt.ndim > 2 or (prompt.ndim == 2 and prompt.shape[0] != 1):
            raise ValueError(
                f"a prompt tensor must be 1-D or [1, length], got shape {tuple(prompt.shape)} (several prompts: "
                "add them one by one, or pass the tensor to generate)"
            )
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, Sequence):
        if any(isinstance(t, Mapping) and "role" in t for t in prompt):
            raise ValueError(f"got chat messages: {CHAT_TEMPLATE_HINT}")
        ids = [operator.index(t) if is_token(t) else t for t in prompt]  # numpy integers are token ids too
    else:
        raise ValueError(f"a prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    bad = out_of_vocabulary(ids, vocab_size)
    if bad:
        raise ValueError(f"token ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    if not ids:
        raise ValueError("the prompt is empty; a request needs at least one token")
    if max_context is not None and len(ids) >= max_context:
        raise ValueError(f"the prompt has {len(ids)} tokens; the model's context window is {max_context} tokens")
    return ids


def out_of_vocabulary(token_ids, vocab_size: int) -> list:
    """The entries of `token_ids` that are no token id of a `vocab_size` vocabulary (not an int, or out of range)."""
    return [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


CHAT_TEMPLATE_HINT = (
    "apply the chat template first, e.g. tokenizer.apply_chat_template(messages, add_generation_prompt=True)"
)


def check_stop_strings(stop: tuple[str, ...], tokenizer) -> None:
    """Refuse stop strings without a tokenizer, and those holding a special token's text: the text they are
    searched in skips special tokens (end on such a token with `eos_token_id` instead)."""
    if tokenizer is None:
        raise ValueError(f"stop strings {list(stop)} need a tokenizer: Engine(model, tokenizer)")
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    for text in stop:
        for special in sorted(specials):
            if special and special in text:
                token_id = tokenizer.convert_tokens_to_ids(special)
                raise ValueError(
                    f"stop string {text!r} holds the special token {special!r} (id {token_id}), which the text stop "
                    f"strings are searched in never shows (special tokens are skipped); end on it with "
                    f"eos_token_id={token_id} instead"
                )


def as_prompt_list(prompts, masked_pad: int | None = None) -> list:
    """One prompt (a string, token ids, a 1-D tensor or array) or several (a list of them, a 2-D tensor or array,
    a tokenizer's output) as a list of prompts. A 2-D tensor or array holding `masked_pad` loses those positions,
    as `generate` masks them when it is given no attention mask."""
    if isinstance(prompts, Mapping):
        return _encoded_prompts(prompts)
    if hasattr(prompts, "ndim") and hasattr(prompts, "tolist"):  # a torch tensor or a numpy array
        if prompts.ndim not in (1, 2):
            raise ValueError(f"a tensor of prompts must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
        if prompts.ndim == 1:
            return [prompts.tolist()]
        rows = prompts.tolist()
        if masked_pad is not None and any(masked_pad in row for row in rows):
            rows = [[token for token in row if token != masked_pad] for row in rows]
        return rows
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and is_token(prompts[0])):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(
            f"prompts must be a string, token ids, a tensor, or a non-empty list of these, got {prompts!r:.80}"
        )
    return list(prompts)


def _encoded_prompts(encoding: Mapping) -> list[list[int]]:
    """The prompts of a tokenizer's output (a `BatchEncoding`, as `apply_chat_template` returns, or a dict): its
    `input_ids`, one prompt or a batch, without the positions its `attention_mask` marks as padding."""
    if "input_ids" not in encoding:
        if "role" in encoding:
            raise ValueError(f"got a chat message: {CHAT_TEMPLATE_HINT}")
        raise ValueError(f"a mapping of prompts needs input_ids (a tokenizer's output), got keys {sorted(encoding)}")
    ids, mask = encoding["input_ids"], encoding.get("attention_mask")
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    mask = mask.tolist() if hasattr(mask, "tolist") else mask
    if ids and is_token(ids[0]):  # one prompt
        ids, mask = [ids], None if mask is None else [mask]
    if mask is None:
        return ids
    return [[token for token, keep in zip(row, keep_row) if keep] for row, keep_row in zip(ids, mask)]


def is_token(value) -> bool:
    """Whether `value` is one token id (an int, a numpy integer or a 0-d integer tensor; not a bool)."""
    if isinstance(value, bool | float):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def per_prompt(generation_config, count: int) -> list:
    if isinstance(generation_config, Sequence) and not isinstance(generation_config, str):
        if len(generation_config) != count:
            raise ValueError(f"{len(generation_config)} generation configs for {count} prompts")
        return list(generation_config)
    return [generation_config] * count
