"""Which models a `PagedCache` can serve exactly, and the reason it refuses the others."""

from __future__ import annotations

import inspect

import torch

ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention")
# model types whose attention transforms the K/V the cache update returns before attending (stock then transforms
# every cached position; the "hf_paged" attention, handed only the new tokens, would attend to untransformed K/V)
KV_TRANSFORMED_AFTER_UPDATE = {
    "diffllama": "splits and repeats the values for its two softmax maps",
    "doge": "computes its dynamic attention mask from the values",
    "jetmoe": "repeats the K/V once per active attention expert",
}


def layer_kinds(text_config) -> list[str]:
    """The kind of each decoder layer: `layer_types` when the config has them, else `"sliding_attention"` with a
    `sliding_window`, `"chunked_attention"` with an `attention_chunk_size`, and `"full_attention"` otherwise."""
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    return [_layer_kind(config) for config in layer_configs(text_config, text_config.num_hidden_layers)]


def layer_configs(config, count: int) -> list:
    """The config of each decoder layer: a heterogeneous config's own (transformers' `per_layer_config`, whose
    per-layer attributes raise when read globally), else `config` itself `count` times (its layers all alike)."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * count


def _layer_kind(config) -> str:
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    if getattr(config, "attention_chunk_size", None) is not None:
        return "chunked_attention"
    return "full_attention"


def check_supported(model: torch.nn.Module) -> None:
    """Raise `NotImplementedError` naming the model and the reason when a `PagedCache` cannot serve it exactly.

    A paged cache stores, per decoder layer, the keys and values of every head for each token, and reads them back
    in full or through a sliding window. Refused: encoder-decoder models (their decoder cache also holds
    cross-attention K/V of the encoder output), layers that keep a recurrent or linear-attention state, chunked
    attention, multi-head latent attention (the cache holds compressed latents of two different widths instead of
    per-head K/V), cross-attention layers (Mllama: their cache holds the image features' K/V), layers that read the
    K/V of another layer (KV sharing), values wider than keys, and models transformers builds no `DynamicCache`
    for (a cache of their own).

    Example:

    ```python
    >>> from transformers import MambaConfig, MambaForCausalLM
    >>> try:
    ...     check_supported(MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=32)))
    ... except NotImplementedError as error:
    ...     print(str(error).split(";")[0])
    MambaForCausalLM has no attention heads (it keeps a recurrent state per layer)

    ```
    """
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"{name} is an encoder-decoder model (its decoder cache also holds the cross-attention K/V of the encoder "
            "output); PagedCache serves decoder-only models"
        )
    text_config = config.get_text_config(decoder=True)
    if all(heads is None for heads in _layer_values(text_config, "num_attention_heads")):
        raise NotImplementedError(
            f"{name} has no attention heads (it keeps a recurrent state per layer); PagedCache stores the keys and "
            "values of attention layers"
        )
    kinds = layer_kinds(text_config)
    unsupported = sorted({kind for kind in kinds if kind not in ATTENTION_LAYER_KINDS})
    if unsupported:
        where = [i for i, kind in enumerate(kinds) if kind not in ATTENTION_LAYER_KINDS]
        raise NotImplementedError(
            f"{name} has {unsupported} layers (layers {where[:8]}); PagedCache serves full and sliding-window "
            "attention layers, whose cache is per-token K/V (not a recurrent, linear-attention or chunked state)"
        )
    latent_ranks = sorted({rank for rank in _layer_values(text_config, "kv_lora_rank") if rank is not None})
    if latent_ranks:
        raise NotImplementedError(
            f"{name} uses multi-head latent attention (kv_lora_rank={latent_ranks[0]}): its cache holds "
            "compressed latents expanded inside the attention, not per-head K/V; PagedCache does not serve it"
        )
    cross = [i for i in _global_value(text_config, "cross_attention_layers") or () if i < text_config.num_hidden_layers]
    if cross:
        raise NotImplementedError(
            f"{name} has cross-attention layers (layers {cross[:8]}) whose cache holds the K/V of the image "
            "features, not of the text positions; PagedCache stores self-attention K/V"
        )
    sharing = _global_value(text_config, "kv_sharing_modes")
    if sharing is not None and any(mode == "reuse" for mode in sharing):
        raise NotImplementedError(
            f"{name} shares K/V between layers (kv_sharing_modes); PagedCache stores each layer's own K/V"
        )
    widths = zip(_layer_values(text_config, "head_dim"), _layer_values(text_config, "v_head_dim"))
    head_dim, v_head_dim = next(((k, v) for k, v in widths if None not in (k, v) and k != v), (None, None))
    if v_head_dim is not None:
        raise NotImplementedError(
            f"{name} has values of v_head_dim={v_head_dim} dims and keys of head_dim={head_dim}; PagedCache stores "
            "the keys and values of a layer in blocks of one shape"
        )
    # transformers' own judgement (`generate` builds no DynamicCache for models with a cache of their own); read
    # defensively, as it is not a public API
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        raise NotImplementedError(
            f"{name} keeps a cache of its own (transformers builds no DynamicCache for it); PagedCache does not "
            "apply to it"
        )


def _layer_values(config, name: str) -> list:
    """The values of `config.name` over the decoder layers (`None` where absent): one per layer where a
    heterogeneous config sets it layer by layer, else the one value."""
    return [getattr(layer_config, name, None) for layer_config in layer_configs(config, 1)]


def _global_value(config, name: str):
    """`config.name`, or `None` when absent or set per layer (a heterogeneous config, e.g. Gemma 4's head
    dimensions, raises on global access)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def kv_transformed_after_update(model: torch.nn.Module) -> str | None:
    """How `model`'s attention transforms the K/V its cache update returns before attending, or `None`: such a
    model reads the paged cache as dense K/V through its own attention (the `"hf_paged"` attention reads the
    stored, untransformed K/V)."""
    text_config = model.config.get_text_config(decoder=True)
    return KV_TRANSFORMED_AFTER_UPDATE.get(getattr(text_config, "model_type", None))


def cache_dropped_by_checkpointing(model: torch.nn.Module) -> str | None:
    """Why `model`'s forward would drop any KV cache, or `None`: in training mode with activation (gradient)
    checkpointing on, transformers' decoder layers run with `use_cache=False` and `past_key_values=None` (stock
    `generate` then runs without a cache).

    Example:

    ```python
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> model.activation_checkpointing_enable()
    >>> cache_dropped_by_checkpointing(model) is None, cache_dropped_by_checkpointing(model.train())[:41]
    (True, 'LlamaForCausalLM is in training mode with')

    ```
    """
    if not (model.training and getattr(model, "is_activation_checkpointing", False)):
        return None
    return (
        f"{type(model).__name__} is in training mode with activation (gradient) checkpointing on, under which "
        "transformers' decoder layers drop the KV cache (use_cache=False, past_key_values=None): a paged cache would "
        "never be filled. Call model.eval() (or model.activation_checkpointing_disable()) before generating with it"
    )


def prompt_learning_method(model: torch.nn.Module) -> str | None:
    """The PEFT prompt-learning method `model` runs with (`"PROMPT_TUNING"`, `"PREFIX_TUNING"`, ...), or `None`.
    `model` is a `PeftModel`, or the base model that a `PeftModel`'s `generate` runs (its
    `prepare_inputs_for_generation` is then the `PeftModel`'s, which adds the virtual tokens or K/V)."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    for owner in (model, getattr(prepare, "__self__", None)):
        config = getattr(owner, "active_peft_config", None)
        if config is not None and getattr(config, "is_prompt_learning", False):
            peft_type = config.peft_type
            return str(getattr(peft_type, "value", peft_type))
    return None


def check_cache_kept(model: torch.nn.Module) -> None:
    """Raise `ValueError` (`cache_dropped_by_checkpointing`'s reason) when `model`'s forward would drop the cache."""
    dropped = cache_dropped_by_checkpointing(model)
    if dropped is not None:
        raise ValueError(dropped)


def cache_not_taken(model: torch.nn.Module) -> str | None:
    """Why `model`'s forward cannot read a KV cache handed to it, or `None`: a forward that takes no
    `past_key_values` (GPT-1, XLNet, XLM, Reformer: no KV cache, or one of their own) recomputes every position from
    the tokens it is given. `generate` runs such a model as stock does (the cache stays empty); the Engine, whose
    steps feed only the tokens its cache does not hold, cannot serve it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model: its base model
    try:
        parameters = inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):  # no signature to read: let the forward decide
        return None
    if "past_key_values" in parameters:
        return None
    return (
        f"{type(base).__name__}'s forward takes no past_key_values (it keeps no KV cache, or one of its own), so "
        "it cannot read the K/V the Engine caches between steps; model.generate runs it as stock does"
    )


def pads_read_by_stock(model: torch.nn.Module, kwargs: dict) -> str | None:
    """Why stock `generate` on `model` would attend to left pads' K/V in the call of `kwargs`, which a paged cache
    never stores (so paged generation would differ), or `None`. GIT without an image: from the first decode step
    its forward widens the padding mask by its image-patch count as if the cache held image positions, so the mask
    no longer lines up with the cache and a left-padded row's pads become visible."""
    text_config = model.config.get_text_config(decoder=True)
    if getattr(text_config, "model_type", None) != "git" or kwargs.get("pixel_values") is not None:
        return None
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None or bool(attention_mask.bool().all()):
        return None
    return (
        f"{type(model).__name__} without an image widens the padding mask by its image patches at every decode step, "
        "so stock generation attends to a left-padded row's pad positions, which a paged cache does not store: the "
        "outputs would differ. Generate the rows one at a time (no padding), with their images, or without a paged "
        "cache"
    )
