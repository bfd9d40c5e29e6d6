"""Generation glue: the only module that touches transformers internals.

`enable()` (run by `import hf_paged`) registers the `"hf_paged"` attention and mask, and wraps two methods of
`GenerationMixin`:

- `generate`: catches `cache_implementation="paged"` (argument or generation config) before transformers reroutes it
  to its own continuous batching or silently falls back to `DynamicCache`; switches the model's attention for the call
  and restores it; returns every block when the cache is not handed back to the caller.
- `_prepare_cache_for_generation`: where `generate` builds its cache; for a paged request it builds a `PagedCache`
  from `cache_config`, and lets its decode steps compile where transformers would compile a `StaticCache`'s;

and `PreTrainedModel.get_compiled_call`, which answers a paged call that compiles with the model's `CompiledDecode`.

The forward hooks and the attention switch it uses live in `forward.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput

from .attention import paged_attention_forward, paged_attention_mask
from .cache import PagedCache
from .compiled_decode import CompiledDecode
from .config import ATTENTION_NAME, PagedCacheConfig
from .forward import (
    TOKEN_INPUTS_OF_GENERATE,
    attach_to_model,
    attention_implementation,
    inputs_beyond_token_ids,
    paged_attention_for,
)
from .planner import ForwardPlanner
from .prompt_prefix import prompt_groups
from .support import (
    cache_dropped_by_checkpointing,
    check_cache_kept,
    check_supported,
    pads_read_by_stock,
    prompt_learning_method,
)

logger = logging.getLogger(__name__)

SUPPORTED_TRANSFORMERS = (">=5.23", "<5.24")
PAGED = "paged"
# Decoding loops whose prefill feeds only the prompt positions the cache does not hold yet; the others (assisted
# decoding feeds the whole prompt on its first iteration) must start from an empty cache.
_MODES_THAT_SLICE_A_STARTED_CACHE = {
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
}

# Decoding loops that run their decode steps through `get_compiled_call` when the cache is compileable
_MODES_THAT_COMPILE = {GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE}

_original_generate = GenerationMixin.generate
_original_prepare_cache = GenerationMixin._prepare_cache_for_generation
_original_get_compiled_call = PreTrainedModel.get_compiled_call
_state = threading.local()


def is_enabled() -> bool:
    return GenerationMixin.generate is not _original_generate


def enable() -> None:
    """Make `cache_implementation="paged"` use `PagedCache` in `generate` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_attention_mask)
    if not is_enabled():
        GenerationMixin.generate = _paged_generate
        GenerationMixin._prepare_cache_for_generation = _prepare_paged_cache
        PreTrainedModel.get_compiled_call = _paged_compiled_call


def disable() -> None:
    """Restore stock `generate` and unregister the `"hf_paged"` attention (idempotent)."""
    GenerationMixin.generate = _original_generate
    GenerationMixin._prepare_cache_for_generation = _original_prepare_cache
    PreTrainedModel.get_compiled_call = _original_get_compiled_call
    AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
    AttentionMaskInterface._global_mapping.pop(ATTENTION_NAME, None)


# ---------------------------------------------------------------------- generate wrapper
class _PagedRequest:
    """One paged `generate` call of this thread: what cache to build, and the cache built."""

    def __init__(self, model: torch.nn.Module, config: PagedCacheConfig, input_ids=None, attention_mask=None):
        self.model = model
        self.config = config
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.cache: PagedCache | None = None


CACHE_INJECTING_METHODS = ("PREFIX_TUNING", "CARTRIDGE")


def _requests() -> list[_PagedRequest]:
    if not hasattr(_state, "requests"):
        _state.requests = []
    return _state.requests


def _generation_option(model, generation_config: GenerationConfig | None, kwargs: dict, name: str):
    """The value `generate` will use for the generation option `name`: the argument, else the generation config
    passed, else the model's own generation config (transformers merges them in that order); `None` when unset."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (generation_config, getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _paged_request_source(model, generation_config: GenerationConfig | None, kwargs: dict) -> str | None:
    """`"argument"` when `generate` got `cache_implementation="paged"`, `"config"` when the generation config passed
    or, for keys it leaves unset, the model's own generation config asks for it, else `None`."""
    if _generation_option(model, generation_config, kwargs, "cache_implementation") != PAGED:
        return None
    return "argument" if kwargs.get("cache_implementation") is not None else "config"


def _asks_for_attentions(model, generation_config: GenerationConfig | None, kwargs: dict) -> bool:
    return bool(_generation_option(model, generation_config, kwargs, "output_attentions"))


def _outputs_every_position(model, generation_config: GenerationConfig | None, kwargs: dict) -> bool:
    """Whether the call returns attention weights or hidden states of every prompt position: then no cached prefix
    may stand in for their prefill (its positions would be missing from the outputs)."""
    return any(
        _generation_option(model, generation_config, kwargs, name)
        for name in ("output_attentions", "output_hidden_states")
    )


def _uses_cache(model, generation_config: GenerationConfig | None, kwargs: dict) -> bool:
    """Whether stock `generate` builds a cache for this call: not with `use_cache=False`, except that a decoder-only
    model prompted with `inputs_embeds` always caches (transformers forces it)."""
    if kwargs.get("inputs_embeds") is not None and not model.config.is_encoder_decoder:
        return True
    return _generation_option(model, generation_config, kwargs, "use_cache") is not False


def _cache_config_of(model, generation_config: GenerationConfig | None, kwargs: dict) -> PagedCacheConfig:
    return PagedCacheConfig.from_dict(_generation_option(model, generation_config, kwargs, "cache_config"))


def _assistant_cache_frames() -> list[list[PagedCache]]:
    if not hasattr(_state, "assistant_caches"):
        _state.assistant_caches = []
    return _state.assistant_caches


@contextmanager
def _releasing_assistant_caches():
    """Paged caches built for an assistant model during this `generate` (assisted decoding keeps one between its
    candidate calls) go back to the pool when it returns or fails."""
    frames = _assistant_cache_frames()
    frames.append([])
    try:
        yield
    finally:
        for cache in frames.pop():
            if not cache.is_released:
                cache.release()


def _prompt_beyond_token_ids(model, inputs, kwargs: dict) -> bool:
    """Whether this `generate` call's K/V depend on more than its token ids (then its blocks are not addressed by
    token ids: prefix caching is off for it)."""
    extra = inputs_beyond_token_ids(kwargs, TOKEN_INPUTS_OF_GENERATE)
    if isinstance(inputs, torch.Tensor) and getattr(model, "main_input_name", "input_ids") != "input_ids":
        extra.append(model.main_input_name)
    if extra:
        logger.info("hf_paged: prefix caching is off for this call: %s decide K/V besides the token ids", extra)
    return bool(extra)


def _check_prompt(model: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
    """Refuse prompts that would fail inside the model with an unclear message (or a device-side assert)."""
    if input_ids is None:
        return
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got a tensor of {input_ids.dtype}")
    if input_ids.shape[-1] == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: every prompt needs at least one token")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab_size = getattr(embeddings, "num_embeddings", None)
    if vocab_size is not None:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"input_ids holds token id {low if low < 0 else high}, outside the model's vocabulary [0, {vocab_size})"
            )


def _check_prefill_chunks(generation_config, attention_mask: torch.Tensor | None) -> None:
    """Refuse a `prefill_chunk_size` whose first chunk holds no real token of some left-padded row: a paged cache
    stores no pad position, so such a row would have nothing to attend to in that chunk."""
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if chunk is None or attention_mask is None or attention_mask.dim() != 2:
        return
    leading = (attention_mask.to(torch.int32).cumsum(-1) == 0).sum(-1)
    leading = leading.where(attention_mask.bool().any(-1), 0)  # an empty row is refused on its own, later
    row = int(leading.argmax())
    if int(leading[row]) >= chunk:
        raise ValueError(
            f"prefill_chunk_size={chunk} leaves row {row} without a real token in the first prefill chunk (it has "
            f"{int(leading[row])} left-pad positions); a paged cache stores no pad position, so every row needs one "
            f"there: use a prefill_chunk_size above {int(leading[row])}, or none"
        )


def _generate_on_user_cache(model, cache: PagedCache, inputs, generation_config, input_ids, kwargs):
    """Stock `generate` continuing from the caller's `PagedCache`. A call that fails on a cache that held nothing
    leaves it empty again (its blocks back in the pool)."""
    attach_to_model(model)
    check_cache_kept(model)
    if not getattr(generation_config, "is_assistant", False):
        _check_prompt(model, input_ids)
    was_empty = not cache.is_released and cache.batch_size == 0
    if cache.prefix_caching and not cache.is_released:
        if _prompt_beyond_token_ids(model, inputs, kwargs):
            cache.stop_prefix_caching()
        else:  # the weights may have been trained since the cache was built
            cache.refresh_prefix_root()
    lookup = not _outputs_every_position(model, generation_config, kwargs)
    cache.start_from_prompt(input_ids, kwargs.get("attention_mask"), lookup)
    request = _PagedRequest(model, cache.cache_config, input_ids, kwargs.get("attention_mask"))
    request.cache = cache  # sized up front like a fresh call's, in `_prepare_paged_cache`
    requests = _requests()
    requests.append(request)
    try:
        implementation = paged_attention_for(
            model, cache.cache_config, _asks_for_attentions(model, generation_config, kwargs)
        )
        with attention_implementation(model, implementation), _compiled_decode_scope():
            return _original_generate(model, inputs, generation_config, **kwargs)
    except BaseException:
        if was_empty and not cache.is_released:
            cache.reset()
        raise
    finally:
        requests.remove(request)


@functools.wraps(_original_generate)
def _paged_generate(self, inputs=None, generation_config=None, **kwargs):
    if getattr(generation_config, "is_assistant", False):
        return _generate(self, inputs, generation_config, kwargs)
    with _releasing_assistant_caches():
        return _generate(self, inputs, generation_config, kwargs)


def _check_no_cache_injection(model) -> None:
    """PEFT prefix tuning (and Cartridge) hands `generate` learned K/V as its cache: refuse, a paged cache cannot
    hold K/V it did not compute."""
    method = prompt_learning_method(model)
    if method in CACHE_INJECTING_METHODS:
        raise NotImplementedError(
            f"PEFT {method} puts its learned K/V in the cache it builds itself (past_key_values); a paged cache "
            "cannot hold them: generate without cache_implementation='paged'"
        )


def _generate(model, inputs, generation_config, kwargs: dict):
    user_cache = kwargs.get("past_key_values")
    input_ids = inputs if isinstance(inputs, torch.Tensor) else kwargs.get("input_ids")
    source = _paged_request_source(model, generation_config, kwargs)
    if source is not None or isinstance(user_cache, PagedCache):
        _check_no_cache_injection(model)
    if isinstance(user_cache, PagedCache) and source != "argument":
        # continue on the caller's cache (or, in assisted decoding, on the one the assistant's last call returned)
        return _generate_on_user_cache(model, user_cache, inputs, generation_config, input_ids, kwargs)
    if source is None:
        return _original_generate(model, inputs, generation_config, **kwargs)
    if not _uses_cache(model, generation_config, kwargs) or cache_dropped_by_checkpointing(model):
        # `use_cache=False`: stock builds no cache and recomputes the whole sequence every step; so does this call.
        # Under gradient checkpointing in training mode the layers drop whatever cache stock builds: run as stock
        kwargs.pop("cache_implementation", None)
        kwargs.pop("cache_config", None)
        return _original_generate(model, inputs, generation_config, **kwargs)

    if user_cache is not None:
        raise ValueError(
            "Passing both `cache_implementation='paged'` and `past_key_values` is unsupported: pass the PagedCache "
            "alone to continue from it, or neither to build a fresh one."
        )
    check_supported(model)
    if (reason := pads_read_by_stock(model, kwargs)) is not None:
        raise NotImplementedError(reason)
    config = _cache_config_of(model, generation_config, kwargs)
    implementation = paged_attention_for(model, config, _asks_for_attentions(model, generation_config, kwargs))
    if not getattr(generation_config, "is_assistant", False):
        _check_prompt(model, input_ids)
    if config.resolved_prefix_caching and _prompt_beyond_token_ids(model, inputs, kwargs):
        config = dataclasses.replace(config, prefix_caching=False)
    kwargs.pop("cache_implementation", None)
    kwargs.pop("cache_config", None)
    request = _PagedRequest(model, config, input_ids, kwargs.get("attention_mask"))
    requests = _requests()
    requests.append(request)
    try:
        with attention_implementation(model, implementation), _compiled_decode_scope():
            output = _original_generate(model, inputs, generation_config, **kwargs)
    except BaseException:
        if request.cache is not None and not request.cache.is_released:
            request.cache.release()
        raise
    finally:
        requests.remove(request)
    cache = request.cache
    if cache is None:
        return output
    if not (isinstance(output, ModelOutput) and output.get("past_key_values") is cache):
        cache.release()
    elif getattr(generation_config, "is_assistant", False) and _assistant_cache_frames():
        _assistant_cache_frames()[-1].append(cache)
    return output


def _refuse_if_too_large(
    request: _PagedRequest, generation_config, model_kwargs, num_rows: int, final_length: int, continuing=False
):
    """Refuse (`RequestTooLargeError`) a call whose rows, expanded for beams and returned sequences, may need more
    blocks than the whole pool, before its first forward (`continuing`: on the caller's cache)."""
    width = request.input_ids.shape[-1] if request.input_ids is not None else None
    if model_kwargs.get("inputs_embeds") is not None:
        width = model_kwargs["inputs_embeds"].shape[1]
    if width is None:
        return
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    prompts = prompt_groups(request.input_ids, request.attention_mask, num_rows, width, final_length, expand)
    request.cache.refuse_if_too_large(prompts, getattr(generation_config, "prefill_chunk_size", None), continuing)


def _prepare_paged_cache(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
    request = next((r for r in reversed(_requests()) if r.model is self and r.cache is None), None)
    if request is None:
        cache = model_kwargs.get("past_key_values")
        continued = next((r for r in reversed(_requests()) if r.model is self and r.cache is cache), None)
        if continued is not None and not generation_config.is_assistant:  # the caller's cache, continued
            _refuse_if_too_large(continued, generation_config, model_kwargs, batch_size, max_cache_length, True)
        if isinstance(cache, PagedCache):
            _decide_compiled_decode(self, cache, generation_config, model_kwargs, generation_mode, max_cache_length)
        if isinstance(cache, PagedCache) and generation_config.cache_implementation == PAGED:
            cache._is_user_defined = True  # a paged cache continued under a generation config that asks for one
            return None
        return _original_prepare_cache(
            self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
    if model_kwargs.get("past_key_values") is not None:
        raise ValueError("Passing both `cache_implementation='paged'` and `past_key_values` is unsupported.")
    _check_prefill_chunks(generation_config, model_kwargs.get("attention_mask"))
    ForwardPlanner.pool_for(self, request.config, caller="generate")  # built (or found) for this call
    request.cache = PagedCache(self, **request.config.options())
    if not generation_config.is_assistant:  # an assistant's cache grows over many short calls
        _refuse_if_too_large(request, generation_config, model_kwargs, batch_size, max_cache_length)
    if model_kwargs.get("inputs_embeds") is None and generation_mode in _MODES_THAT_SLICE_A_STARTED_CACHE:
        lookup = not _outputs_every_position(self, generation_config, {})
        request.cache.start_from_prompt(request.input_ids, request.attention_mask, lookup)
    model_kwargs["past_key_values"] = request.cache
    _decide_compiled_decode(self, request.cache, generation_config, model_kwargs, generation_mode, max_cache_length)
    if generation_config.is_assistant:
        request.cache.activate_past_recording()


# ---------------------------------------------------------------------- compiled decoding
def _compiled_decodes() -> list[tuple[torch.nn.Module, PagedCache]]:
    """The `(model, cache)` of this thread's running paged calls whose decode steps compile."""
    if not hasattr(_state, "compiled_decodes"):
        _state.compiled_decodes = []
    return _state.compiled_decodes


@contextmanager
def _compiled_decode_scope():
    """Caches a `generate` call let compile (`_decide_compiled_decode`) stop compiling when it returns or fails."""
    running = _compiled_decodes()
    depth = len(running)
    try:
        yield
    finally:
        for model, cache in running[depth:]:
            cache.compile_decode(model, None)
        del running[depth:]


def _decide_compiled_decode(model, cache: PagedCache, generation_config, model_kwargs, generation_mode, max_length):
    """Let `cache`'s decode steps compile where transformers would compile a `StaticCache`'s (its own criteria: the
    device, `compile_config`, `disable_compile`, the quantizer, offloading) and the cache can (under the `"hf_paged"`
    attention; `"int4-channel"` pages on the CPU only); greedy and sampling calls only (transformers compiles no
    other decoding loop), never an assistant's."""
    if generation_mode not in _MODES_THAT_COMPILE or generation_config.is_assistant:
        return
    if not cache.compile_decode(model, max_length):
        return
    if not model._valid_auto_compile_criteria(model_kwargs, generation_config):
        cache.compile_decode(model, None)
        return
    _compiled_decodes().append((model, cache))


def compiled_decode_of(model: torch.nn.Module) -> CompiledDecode | None:
    """The `CompiledDecode` that runs `model`'s compiled paged decode steps (its counters), or `None` before any."""
    return getattr(model, "_hf_paged_decode", None)


def _paged_compiled_call(self, compile_config=None):
    caches = [cache for model, cache in _compiled_decodes() if model is self and cache.is_compileable]
    if not caches:
        return _original_get_compiled_call(self, compile_config)
    for cache in caches:
        cache.decode_compile_taken()
    compile_config = compile_config or self._default_compile_config()
    decode = compiled_decode_of(self)
    if decode is None or decode.compile_config != compile_config:
        decode = self._hf_paged_decode = CompiledDecode(self, compile_config)
    return decode
