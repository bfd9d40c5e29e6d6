"""The running forward: hooks that hand a paged cache its forward's inputs, the per-thread binding the `"hf_paged"`
attention reads the cache through, and the attention switch a paged call (`generate` or the Engine) runs under.

The cache and the Engine import this module; it imports neither of them (a cache that wants its forward's inputs
subclasses `ForwardBoundCache`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from contextlib import contextmanager

import torch

from .batch import ForwardInputs
from .config import ATTENTION_NAME, PagedCacheConfig
from .support import check_cache_kept, kv_transformed_after_update

logger = logging.getLogger(__name__)

EAGER = "eager"
# tensor inputs that decide no K/V beyond what the token ids say: of a `generate` call, of one forward of the model
TOKEN_INPUTS_OF_GENERATE = frozenset({"input_ids", "attention_mask"})
TOKEN_INPUTS_OF_FORWARD = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache_position", "logits_to_keep"}  # the last selects outputs
)

_bound = threading.local()
_switch_lock = threading.Lock()
_switched: dict[int, list] = {}  # id(model) -> [users, previous implementation]


class ForwardBoundCache:
    """A cache that is told about every forward of its model before it runs (`BatchCache`, `PagedCache`)."""

    def prepare_forward(self, model: torch.nn.Module, inputs: ForwardInputs) -> None:
        raise NotImplementedError

    def forward_failed(self) -> None:
        """The forward prepared last raised an `Exception`."""

    def forward_finished(self) -> None:
        """The forward prepared last returned. Neither this nor `forward_failed` is called when it is left by a
        `BaseException` such as `KeyboardInterrupt` (torch runs no forward hook then)."""


# ---------------------------------------------------------------------- the cache bound to the running forward
def _bindings() -> list:
    if not hasattr(_bound, "stack"):
        _bound.stack = []
    return _bound.stack


def bind_paged_cache(owner: torch.nn.Module, cache, prepared: ForwardBoundCache | None = None) -> None:
    """Make `cache` (a `PagedCache`, or `None`) what `paged_attention_forward` reads in this thread until
    `unbind_paged_cache(owner)`: the forward hooks bind around every forward of a model that has met a paged
    cache, so its attention finds the cache even when the model does not pass keyword arguments down to its
    attention modules. Bindings nest; a stale one of `owner` (a forward interrupted by `KeyboardInterrupt`) is
    dropped. `prepared` is the cache whose forward the hook prepared (told if the forward fails)."""
    stack = _bindings()
    stack[:] = [entry for entry in stack if entry[0] is not owner]
    stack.append((owner, cache, prepared))


def unbind_paged_cache(owner: torch.nn.Module) -> ForwardBoundCache | None:
    """End `owner`'s binding; returns the cache whose forward was prepared, if any."""
    stack = _bindings()
    if stack and stack[-1][0] is owner:
        return stack.pop()[2]
    return None


def bound_paged_cache():
    """The `PagedCache` bound to this thread's running forward, or `None`."""
    stack = _bindings()
    return stack[-1][1] if stack else None


# ---------------------------------------------------------------------- forward hooks
def attach_to_model(model: torch.nn.Module) -> None:
    """Install (once) the forward hooks that bind a `ForwardBoundCache` to each forward of `model`."""
    if getattr(model, "_hf_paged_hook", None) is None:
        model._hf_paged_hook = (
            model.register_forward_pre_hook(_before_forward, with_kwargs=True),
            model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True),
        )


def inputs_beyond_token_ids(kwargs: dict, token_inputs: frozenset) -> list[str]:
    """Names of the tensor inputs in `kwargs` other than `token_inputs` (images, audio, `inputs_embeds`, custom
    position ids...): K/V then depend on more than the token ids, so blocks cannot be addressed by token ids."""
    return [
        name
        for name, value in kwargs.items()
        if name not in token_inputs
        and (
            isinstance(value, torch.Tensor)
            or (isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))
        )
    ]


def forward_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> ForwardInputs:
    """What a forward of `module` called with `args` and `kwargs` tells its paged cache before it runs."""
    reads_tables = module.config._attn_implementation == ATTENTION_NAME
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args and isinstance(args[0], torch.Tensor):
        input_ids = args[0]
    shaped = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    shape = tuple(shaped.shape[:2]) if isinstance(shaped, torch.Tensor) and shaped.dim() >= 2 else None
    return ForwardInputs(
        attention_mask=kwargs.get("attention_mask"),
        input_ids=input_ids,
        position_ids=kwargs.get("position_ids"),
        shape=shape,
        device=None if shape is None else shaped.device,
        reads_tables=reads_tables,
        beyond_token_ids=bool(inputs_beyond_token_ids(kwargs, TOKEN_INPUTS_OF_FORWARD)),
    )


def _before_forward(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("past_key_values")
    if torch.compiler.is_compiling() and not isinstance(cache, ForwardBoundCache):
        # a compiled stock call (transformers compiling a StaticCache's decode): nothing paged runs in it, and the
        # per-thread binding would break its graph at every forward
        return None
    if not isinstance(cache, ForwardBoundCache):
        bind_paged_cache(module, None)
        return None
    check_cache_kept(module)
    inputs = forward_inputs(module, args, kwargs)
    cache.prepare_forward(module, inputs)
    bind_paged_cache(module, cache if inputs.reads_tables else None, cache)
    return None


def _after_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
    if torch.compiler.is_compiling() and not isinstance(kwargs.get("past_key_values"), ForwardBoundCache):
        return  # see `_before_forward`
    prepared = unbind_paged_cache(module)
    if prepared is None:
        return
    if output is None:  # torch calls an always-called hook with no output on an exception
        prepared.forward_failed()
    else:
        prepared.forward_finished()


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
            saved = _implementations(model.config)  # sub-models may differ (a Gemma2 text model on eager)
            if previous != implementation:
                _switch(model, implementation)
            entry = _switched[key] = [0, previous, saved]
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
                if _implementations(model.config) != entry[2]:
                    _restore_implementations(model, entry[2])


class _RecordedSwitch:
    """What `set_attn_implementation(implementation)` changed on one model: the configs it wrote (the model's, its
    sub-configs', its sub-models'), with their values before and after. The Engine switches its model at every step
    and back, and `set_attn_implementation` walks every module and checks the implementation each time (about a
    millisecond a step for SmolLM2); a switch from the same values replays the recorded writes instead."""

    def __init__(self, configs: list, implementation: str, before: tuple, after: tuple):
        self.configs, self.implementation, self.before, self.after = configs, implementation, before, after

    @classmethod
    def record(cls, model: torch.nn.Module, implementation: str) -> _RecordedSwitch:
        """Switch `model` to `implementation` with `set_attn_implementation`, recording what it wrote."""
        configs = _configs_of(model)
        before = _values(configs)
        model.set_attn_implementation(implementation)
        return cls(configs, implementation, before, _values(configs))

    def replay(self, implementation: str) -> bool:
        """Write the recorded values if the configs are as they were before the recorded switch; else `False`."""
        if implementation != self.implementation or _values(self.configs) != self.before:
            return False
        _write(self.configs, self.after)
        return True

    def undo(self) -> bool:
        """Put back the values from before the switch if nothing changed them since; else `False`."""
        if _values(self.configs) != self.after:
            return False
        _write(self.configs, self.before)
        return True


_recorded_switches: weakref.WeakKeyDictionary[torch.nn.Module, _RecordedSwitch] = weakref.WeakKeyDictionary()


def _switch(model: torch.nn.Module, implementation: str) -> None:
    recorded = _recorded_switches.get(model)
    if recorded is None or not recorded.replay(implementation):
        _recorded_switches[model] = _RecordedSwitch.record(model, implementation)


def _configs_of(model: torch.nn.Module) -> list:
    """Every config `set_attn_implementation` may write: the model's, its sub-configs' at any depth and its
    sub-models' (distinct objects, in a fixed order)."""
    configs, seen = [], set()
    pending = [model.config] + [m.config for m in model.modules() if m is not model and hasattr(m, "config")]
    while pending:
        config = pending.pop(0)
        if id(config) in seen or not hasattr(config, "_attn_implementation_internal"):
            continue
        seen.add(id(config))
        configs.append(config)
        pending += [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]
    return configs


def _values(configs: list) -> tuple:
    return tuple(config._attn_implementation_internal for config in configs)


def _write(configs: list, values: tuple) -> None:
    for config, value in zip(configs, values):
        config._attn_implementation_internal = value


def _implementations(config) -> dict:
    """The attention implementation of `config` and of each of its sub-configs, nested as
    `PreTrainedModel.set_attn_implementation` takes them: `{"": own, sub-config name: {...}}`."""
    tree = {"": config._attn_implementation}
    for name in getattr(config, "sub_configs", {}):
        sub_config = getattr(config, name, None)
        if sub_config is not None:
            tree[name] = _implementations(sub_config)
    return tree


def _restore_implementations(model: torch.nn.Module, saved: dict) -> None:
    """Put back the implementations `_implementations` saved (replaying the recorded switch backwards where
    nothing else changed them). A sub-config whose sub-model the model does not hold (Moshi's audio encoder) may
    have had none (`None`), which `set_attn_implementation` refuses: it gets `None` back directly."""
    recorded = _recorded_switches.get(model)
    if recorded is not None and recorded.undo() and _implementations(model.config) == saved:
        return
    model.set_attn_implementation(_pruned(saved))
    _reset_unset(model.config, saved)


def _pruned(tree: dict) -> dict:
    """`tree` without its `None` implementations."""
    pruned = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            value = _pruned(value)
        if value is not None and value != {}:
            pruned[name] = value
    return pruned


def _reset_unset(config, tree: dict) -> None:
    for name, value in tree.items():
        if name == "" and value is None:
            config._attn_implementation = None
        elif isinstance(value, dict) and getattr(config, name, None) is not None:
            _reset_unset(getattr(config, name), value)


def own_attention(model: torch.nn.Module) -> str:
    """The model's attention implementation outside paged calls (one running in another thread may have switched
    it for its duration)."""
    with _switch_lock:
        entry = _switched.get(id(model))
    return model.config._attn_implementation if entry is None else entry[1]


def paged_attention_for(
    model: torch.nn.Module, config: PagedCacheConfig, output_attentions: bool = False, keep_eager: bool = True
) -> str:
    """The attention implementation a paged call runs on: `cache_config`'s `attn_implementation` when given; else
    the model's own implementation when the call asks for attention weights or the model is set to eager attention
    and `keep_eager` (the caller's choice is kept, reading the paged cache as dense K/V, so `output_attentions`
    gives exactly what stock gives), or when its attention transforms the K/V after the cache update
    (`support.kv_transformed_after_update`), and `"hf_paged"` otherwise (the Engine, which never returns attention
    weights, passes `keep_eager=False` and has the `"hf_paged"` attention compute eager models in eager math). A
    model that hard-codes its attention classes (it does not dispatch through transformers' `AttentionInterface`,
    e.g. Falcon) cannot be switched: it keeps its own attention, which reads the paged cache as dense K/V; asking it
    for another implementation is refused."""
    own = own_attention(model)
    transformed = kv_transformed_after_update(model)
    if transformed is not None and config.attn_implementation == ATTENTION_NAME:
        raise NotImplementedError(
            f"{type(model).__name__}'s attention {transformed} after the cache update, so it must read the cached "
            f"K/V as dense tensors: the {ATTENTION_NAME!r} attention reads them untransformed through the block "
            "tables. Leave attn_implementation unset (the model's own attention then reads the paged cache)."
        )
    keeps_own = output_attentions or (own == EAGER and keep_eager) or transformed is not None
    requested = config.attn_implementation or (own if keeps_own else config.resolved_attn_implementation)
    current = model.config._attn_implementation
    if requested == current or model._can_set_attn_implementation():
        return requested
    if config.attn_implementation is None:
        logger.info(
            "hf_paged: %s hard-codes its attention classes; it reads the paged cache through its own %r attention",
            type(model).__name__,
            current,
        )
        return current
    raise ValueError(
        f"{type(model).__name__} hard-codes its attention classes (it does not dispatch through transformers' "
        f"AttentionInterface), so cache_config attn_implementation={requested!r} cannot be honoured; it reads the "
        f"paged cache as dense K/V through its own {current!r} attention. Leave attn_implementation unset, or load "
        f"the model with attn_implementation={requested!r}."
    )
