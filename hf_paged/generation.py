"""Generation glue: the only module that touches transformers internals.

`enable()` (run by `import hf_paged`) registers the `"hf_paged"` attention and mask, and wraps two methods of
`GenerationMixin`:

- `generate`: catches `cache_implementation="paged"` (argument or generation config) before transformers reroutes it
  to its own continuous batching or silently falls back to `DynamicCache`; switches the model's attention for the call
  and restores it; returns every block when the cache is not handed back to the caller.
- `_prepare_cache_for_generation`: where `generate` builds its cache; for a paged request it builds a `PagedCache`
  from `cache_config`.

A forward pre-hook on each model that meets a `PagedCache` hands the cache the forward's 2D attention mask (so pad
tokens are never stored) and, under the `"hf_paged"` attention, passes the cache to the attention function.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import ModelOutput

from .attention import ATTENTION_NAME, paged_attention_forward
from .cache import PagedCache
from .config import PagedCacheConfig
from .plan import ForwardInputs

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

_original_generate = GenerationMixin.generate
_original_prepare_cache = GenerationMixin._prepare_cache_for_generation
_state = threading.local()
_switch_lock = threading.Lock()
_switched: dict[int, list] = {}  # id(model) -> [users, previous implementation]


def is_enabled() -> bool:
    return GenerationMixin.generate is not _original_generate


def enable() -> None:
    """Make `cache_implementation="paged"` use `PagedCache` in `generate` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    if not is_enabled():
        GenerationMixin.generate = _paged_generate
        GenerationMixin._prepare_cache_for_generation = _prepare_paged_cache


def disable() -> None:
    """Restore stock `generate` and unregister the `"hf_paged"` attention (idempotent)."""
    GenerationMixin.generate = _original_generate
    GenerationMixin._prepare_cache_for_generation = _original_prepare_cache
    AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
    AttentionMaskInterface._global_mapping.pop(ATTENTION_NAME, None)


# ---------------------------------------------------------------------- forward pre-hook
def attach_to_model(model: torch.nn.Module) -> None:
    """Install (once) the forward pre-hook that binds a `PagedCache` to each forward of `model`."""
    if getattr(model, "_hf_paged_hook", None) is None:
        model._hf_paged_hook = model.register_forward_pre_hook(_before_forward, with_kwargs=True)


@functools.cache
def _forward_takes_kwargs(model_class: type) -> bool:
    parameters = inspect.signature(model_class.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _before_forward(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, PagedCache):
        return None
    reads_tables = module.config._attn_implementation == ATTENTION_NAME and _forward_takes_kwargs(type(module))
    inputs = ForwardInputs(
        attention_mask=kwargs.get("attention_mask"),
        input_ids=kwargs.get("input_ids"),
        position_ids=kwargs.get("position_ids"),
        reads_tables=reads_tables,
    )
    cache.bind_forward(module, inputs)
    if not reads_tables:
        return None
    kwargs["paged_cache"] = cache
    return args, kwargs


# ---------------------------------------------------------------------- attention switch
@contextmanager
def attention_implementation(model: torch.nn.Module, implementation: str):
    """Run the block with `model` on `implementation`, restoring the previous one afterwards (nesting and threads
    sharing the model are counted: the last one out restores)."""
    key = id(model)
    with _switch_lock:
        entry = _switched.get(key)
        if entry is None:
            previous = model.config._attn_implementation
            if previous != implementation:
                model.set_attn_implementation(implementation)
            entry = _switched[key] = [0, previous]
        elif (current := model.config._attn_implementation) != implementation:
            raise RuntimeError(
                f"{type(model).__name__} is running paged generation with attention {current!r} in another thread; "
                f"cannot switch to {implementation!r} concurrently"
            )
        entry[0] += 1
    try:
        yield
    finally:
        with _switch_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _switched[key]
                if model.config._attn_implementation != entry[1]:
                    model.set_attn_implementation(entry[1])


# ---------------------------------------------------------------------- generate wrapper
class _PagedRequest:
    """One paged `generate` call of this thread: what cache to build, and the cache built."""

    def __init__(self, model: torch.nn.Module, config: PagedCacheConfig, input_ids=None, attention_mask=None):
        self.model = model
        self.config = config
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.cache: PagedCache | None = None


def _requests() -> list[_PagedRequest]:
    if not hasattr(_state, "requests"):
        _state.requests = []
    return _state.requests


def _asks_for_paged(model, generation_config: GenerationConfig | None, kwargs: dict) -> bool:
    if kwargs.get("cache_implementation") is not None:
        return kwargs["cache_implementation"] == PAGED
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    return getattr(config, "cache_implementation", None) == PAGED


def _cache_config_of(model, generation_config: GenerationConfig | None, kwargs: dict) -> PagedCacheConfig:
    options = kwargs.get("cache_config")
    if options is None:
        config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        options = getattr(config, "cache_config", None)
    return PagedCacheConfig.from_dict(options)


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


def _generate_on_user_cache(model, cache: PagedCache, inputs, generation_config, input_ids, kwargs):
    """Stock `generate` continuing from the caller's `PagedCache`. A call that fails on a cache that held nothing
    leaves it empty again (its blocks back in the pool)."""
    attach_to_model(model)
    _check_prompt(model, input_ids)
    was_empty = not cache.is_released and cache.batch_size == 0
    cache.start_from_prompt(input_ids, kwargs.get("attention_mask"))
    try:
        with attention_implementation(model, cache.cache_config.resolved_attn_implementation):
            return _original_generate(model, inputs, generation_config, **kwargs)
    except BaseException:
        if was_empty and not cache.is_released:
            cache.reset()
        raise


@functools.wraps(_original_generate)
def _paged_generate(self, inputs=None, generation_config=None, **kwargs):
    user_cache = kwargs.get("past_key_values")
    input_ids = inputs if isinstance(inputs, torch.Tensor) else kwargs.get("input_ids")
    if not _asks_for_paged(self, generation_config, kwargs):
        if isinstance(user_cache, PagedCache):
            return _generate_on_user_cache(self, user_cache, inputs, generation_config, input_ids, kwargs)
        return _original_generate(self, inputs, generation_config, **kwargs)

    if user_cache is not None:
        raise ValueError(
            "Passing both `cache_implementation='paged'` and `past_key_values` is unsupported: pass the PagedCache "
            "alone to continue from it, or neither to build a fresh one."
        )
    if self.config.is_encoder_decoder:
        raise NotImplementedError(
            f"{type(self).__name__} is an encoder-decoder model; paged generation serves decoder-only models"
        )
    config = _cache_config_of(self, generation_config, kwargs)
    _check_prompt(self, input_ids)
    kwargs.pop("cache_implementation", None)
    kwargs.pop("cache_config", None)
    request = _PagedRequest(self, config, input_ids, kwargs.get("attention_mask"))
    requests = _requests()
    requests.append(request)
    try:
        with attention_implementation(self, config.resolved_attn_implementation):
            output = _original_generate(self, inputs, generation_config, **kwargs)
    except BaseException:
        if request.cache is not None and not request.cache.is_released:
            request.cache.release()
        raise
    finally:
        requests.remove(request)
    cache = request.cache
    if cache is not None and not (isinstance(output, ModelOutput) and output.get("past_key_values") is cache):
        cache.release()
    return output


def _prepare_paged_cache(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
    request = next((r for r in reversed(_requests()) if r.model is self and r.cache is None), None)
    if request is None:
        return _original_prepare_cache(
            self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
    if model_kwargs.get("past_key_values") is not None:
        raise ValueError("Passing both `cache_implementation='paged'` and `past_key_values` is unsupported.")
    if not self._supports_default_dynamic_cache():
        raise NotImplementedError(
            f"{type(self).__name__} keeps a recurrent state, not a KV cache; paged generation does not apply to it"
        )
    request.cache = PagedCache(self, **request.config.options())
    if model_kwargs.get("inputs_embeds") is None and generation_mode in _MODES_THAT_SLICE_A_STARTED_CACHE:
        request.cache.start_from_prompt(request.input_ids, request.attention_mask)
    model_kwargs["past_key_values"] = request.cache
    if generation_config.is_assistant:
        request.cache.activate_past_recording()
