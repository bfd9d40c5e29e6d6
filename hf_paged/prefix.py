"""Content addresses of full blocks: a chained cryptographic hash of the tokens from the start of a sequence."""

from __future__ import annotations

import hashlib
import itertools
import sys
import weakref
from array import array

import torch

from .storage import autocast_dtype

DIGEST_SIZE = 16


SAMPLES_PER_PARAMETER = 16


class _ModelSample:
    """What is read of one model's state at every prefix lookup, found once per set of parameters (rebuilt when a
    parameter is added, removed, replaced or moved: the storage addresses change):

    - strided views of `SAMPLES_PER_PARAMETER` elements of every parameter: views share their parameter's storage, so
      they see every in-place change, `.data` writes included;
    - the model's PEFT adapter layers (adding or deleting an adapter adds or removes parameters).
    """

    def __init__(self, model: torch.nn.Module, parameters: list[torch.Tensor], addresses: list[int]):
        self.addresses = addresses
        self.views = []
        for parameter in parameters:
            if parameter.device.type == "meta" or parameter.numel() == 0:
                continue  # offloaded to disk by accelerate (its version still counts), or empty
            flat = parameter.detach().reshape(-1)
            self.views.append(flat[:: max(1, flat.numel() // SAMPLES_PER_PARAMETER)])
        tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no adapter layer can exist
        self.adapter_layers = (
            [] if tuners is None else [m for m in model.modules() if isinstance(m, tuners.BaseTunerLayer)]
        )

    def weights_key(self, parameters: list[torch.Tensor]) -> str:
        version = sum(parameter._version for parameter in parameters)
        if not self.views:
            return f"{version}:"
        values = torch.cat(self.views).to("cpu", torch.float32)
        digest = hashlib.blake2b(values.numpy().tobytes(), digest_size=DIGEST_SIZE, person=b"hf_paged-weights")
        return f"{version}:{digest.hexdigest()}"

    def adapter_states(self) -> tuple:
        """Every adapter layer's state that changes its output without changing a weight: its active adapters,
        whether adapters are disabled, the merged ones, and their scaling (plain values, the same in every
        process)."""
        return tuple(
            (
                tuple(layer.active_adapters),
                layer.disable_adapters,
                tuple(layer.merged_adapters),
                _scaling(layer),
            )
            for layer in self.adapter_layers
        )

    def adapter_key(self) -> str:
        """`adapter_states` as a hash valid within this process (see `adapter_state_key`)."""
        if not self.adapter_layers:
            return ""
        return f"adapters:{hash(self.adapter_states())}"


def _scaling(layer) -> tuple | str:
    scaling = getattr(layer, "scaling", None)  # LoRA's: {adapter: factor}
    return tuple(scaling.items()) if isinstance(scaling, dict) else repr(scaling)


_model_samples: weakref.WeakKeyDictionary[torch.nn.Module, _ModelSample] = weakref.WeakKeyDictionary()


def _local_shard(parameter: torch.Tensor) -> torch.Tensor:
    """This process's part of `parameter`: the local shard of a tensor-parallel `DTensor` (a tensor sharing its
    storage and version counter), else the parameter itself."""
    to_local = getattr(parameter, "to_local", None)
    if to_local is None:
        return parameter
    with torch.no_grad():
        return to_local()


def _parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """`list(model.parameters())`, in its order, by a walk that builds no module names: read at every step of the
    Engine, where `Module.parameters()` cost a third of a millisecond for SmolLM2 and this a tenth."""
    parameters, seen_parameters, seen_modules, stack = [], set(), set(), [model]
    while stack:
        module = stack.pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen_parameters:
                seen_parameters.add(id(parameter))
                parameters.append(parameter)
        stack.extend(reversed([child for child in module._modules.values() if child is not None]))
    return parameters


def _sample_of(model: torch.nn.Module) -> tuple[_ModelSample, list[torch.Tensor]]:
    parameters = [_local_shard(parameter) for parameter in _parameters(model)]
    addresses = [parameter.data_ptr() for parameter in parameters]
    sample = _model_samples.get(model)
    if sample is None or sample.addresses != addresses:
        sample = _model_samples[model] = _ModelSample(model, parameters, addresses)
    return sample, parameters


def weights_key(model: torch.nn.Module) -> str:
    """What tells this model's weights apart from their earlier values, at a cost of under a millisecond for a
    135M-parameter model on a CPU: the sum of the parameters' tensor versions (every in-place update through autograd's
    view of a parameter: optimizer steps, `torch.no_grad()` edits, `load_state_dict`) and a digest of a fixed
    sample of every parameter's values, which catches writes that bypass the version counter (`.data` edits such
    as PEFT's `merge_and_unload`, tensors swapped in with `param.data = ...`). An edit through `.data` of a few
    elements that the sample does not cover escapes both: call `BlockPool.clear_prefix_cache()` after one. A model
    sharded by tensor parallelism is read through each rank's own shard (no communication), so ranks' keys differ
    while their hits and misses agree as long as every rank's weights change together.
    """
    sample, parameters = _sample_of(model)
    return sample.weights_key(parameters)


def adapter_state_key(model: torch.nn.Module) -> str:
    """The state of the model's PEFT adapter layers that changes their output without changing a weight: the
    adapters each layer runs (`set_adapter`), whether adapters are disabled (`disable_adapter()`), which are merged,
    and their scaling (`set_scale`). Empty without adapter layers."""
    return _sample_of(model)[0].adapter_key()


def adapter_states(model: torch.nn.Module) -> tuple:
    """The PEFT adapter layers' state that changes their output without changing a weight, as plain values (what
    `adapter_state_key` hashes; `hf_paged.offload` keys blocks kept across processes by it)."""
    return _sample_of(model)[0].adapter_states()


_training_reads = itertools.count()


def prefix_namespace(model: torch.nn.Module) -> bytes:
    """What besides the tokens decides a block's K/V: the model, its dtype, its adapters (names, and the layers'
    `adapter_state_key`), its weights as they are now (`weights_key`: blocks computed before training, a merge or
    an edit are never reused after it) and its mode: a model in training mode (dropout) gets a namespace of its own
    at every read, so K/V computed in training mode are never reused; and `torch.autocast`'s dtype, if any.

    Example:

    ```python
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> before = prefix_namespace(model)
    >>> before == prefix_namespace(tiny_model("qwen2"))
    False
    >>> with torch.no_grad():
    ...     _ = model.lm_head.weight.mul_(2.0)
    >>> prefix_namespace(model) == before
    False
    >>> edited = prefix_namespace(model)
    >>> model.model.layers[0].self_attn.q_proj.weight.data += 1.0  # bypasses the version counter
    >>> prefix_namespace(model) == edited
    False
    >>> _ = model.train()  # dropout: no two reads alike
    >>> prefix_namespace(model) == prefix_namespace(model)
    False

    ```
    """
    config = model.config
    peft_config = getattr(model, "peft_config", None)
    adapters = sorted(peft_config) if isinstance(peft_config, dict) else []
    if getattr(model, "_hf_peft_config_loaded", False):
        adapters += ["active:" + name for name in model.active_adapters()]
    dtype = next(model.parameters()).dtype
    parts = [type(model).__name__, str(getattr(config, "_name_or_path", "")), str(dtype), ",".join(adapters)]
    sample, parameters = _sample_of(model)
    parts += [sample.adapter_key(), sample.weights_key(parameters), f"autocast:{autocast_dtype(model)}"]
    if model.training:
        parts.append(f"training:{next(_training_reads)}")
    return "\x1f".join(parts).encode()


def root_hash(namespace: bytes) -> bytes:
    return hashlib.blake2b(namespace, digest_size=DIGEST_SIZE, person=b"hf_paged-root").digest()


def group_roots(root: bytes, num_groups: int) -> list[bytes]:
    """The chain root of every layer group (a block of one group never stands in for another group's): `[root]` for
    a single group.

    Example:

    ```python
    >>> root = root_hash(b"model")
    >>> group_roots(root, 1) == [root], len(set(group_roots(root, 3)))
    (True, 3)

    ```
    """
    if num_groups == 1:
        return [root]
    return [
        hashlib.blake2b(root + index.to_bytes(4, "little"), digest_size=DIGEST_SIZE, person=b"hf_paged-group").digest()
        for index in range(num_groups)
    ]


def block_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Hash of one full block: its parent's hash and its token ids (blake2b, never Python's `hash`).

    Example:

    ```python
    >>> root = root_hash(b"model")
    >>> block_hash(root, [1, 2, 3]) == block_hash(root, [1, 2, 3]) != block_hash(root, [1, 2, 4])
    True
    >>> block_hash(block_hash(root, [1, 2, 3]), [4]) != block_hash(root, [4])  # the chain makes position count
    True

    ```
    """
    digest = hashlib.blake2b(parent, digest_size=DIGEST_SIZE, person=b"hf_paged-block")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def chain(parent: bytes, tokens: list[int], block_size: int) -> list[tuple[bytes, tuple[int, ...]]]:
    """`(hash, tokens)` of every full block of `tokens`, chained from `parent`."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = block_hash(parent, block)
        out.append((parent, block))
    return out
