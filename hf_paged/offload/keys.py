"""Keys of blocks kept outside the process: what makes K/V valid in another process, on another machine, later.

The prefix cache's own chain roots (`hf_paged.prefix`) hold values that are valid only in this process (tensor
version counters, Python's salted `hash`). A block written to a tier is keyed instead by a chain over its tokens from
a *persistent root*, a digest of:

- every parameter and buffer of the model, byte for byte (adapter weights included; computed once per set of
  weights: about 1.0 s for SmolLM2-135M in float32 on 2 CPU cores, then cached until a weight changes);
- the model's class and config (its path left out: a copy elsewhere holds the same weights), its dtype and
  `torch.autocast`'s, the adapters' state (which run, disabled, merged, their scaling);
- the pool's page format and block size, and the tensor-parallel rank;
- the versions of transformers, torch and the on-disk format (`codec.FORMAT`).

A model in training mode (dropout) gets no persistent root: its blocks are never written.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

from ..prefix import DIGEST_SIZE, _local_shard, adapter_states, weights_key
from ..storage import autocast_dtype
from .codec import FORMAT

_digests: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()


def weights_digest(model: torch.nn.Module) -> str:
    """A blake2b digest of every parameter and buffer of `model` (names, dtypes, shapes and bytes), computed again
    only when `weights_key(model)` changes (a weight was edited or trained).

    Example:

    ```python
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> before = weights_digest(model)
    >>> with torch.no_grad():
    ...     _ = model.lm_head.weight.add_(1.0)
    >>> weights_digest(model) != before
    True

    ```
    """
    current = weights_key(model)
    cached = _digests.get(model)
    if cached is not None and cached[0] == current:
        return cached[1]
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"hf_paged-wdigest")
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        tensor = _local_shard(tensor).detach()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        flat = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(flat.numpy())
    _digests[model] = (current, digest.hexdigest())
    return _digests[model][1]


def persistent_root(model: torch.nn.Module, kv_dtype: str, block_size: int, tp_rank: int = 0) -> bytes | None:
    """The chain root of `model`'s blocks in tiers shared across processes (see the module docstring); `None` for a
    model in training mode."""
    if model.training:
        return None
    import transformers

    config = model.config.to_dict()
    for name in ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version"):
        config.pop(name, None)
    parts = {
        "format": FORMAT,
        "class": type(model).__name__,
        "config": config,
        "dtype": str(next(model.parameters()).dtype),
        "autocast": str(autocast_dtype(model)),
        "weights": weights_digest(model),
        "adapters": adapter_states(model),
        "kv_dtype": kv_dtype,
        "block_size": block_size,
        "tp_rank": tp_rank,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE, person=b"hf_paged-proot").digest()
