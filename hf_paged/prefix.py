"""Content addresses of full blocks: a chained cryptographic hash of the tokens from the start of a sequence."""

from __future__ import annotations

import hashlib
from array import array

import torch

DIGEST_SIZE = 16


def prefix_namespace(model: torch.nn.Module) -> bytes:
    """What besides the tokens decides a block's K/V: the model, its dtype, its active adapters and the version of
    its weights (every in-place update of a parameter, e.g. an optimizer step, bumps its tensor version, so blocks
    computed before training are never reused after it).

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

    ```
    """
    config = model.config
    peft_config = getattr(model, "peft_config", None)
    adapters = sorted(peft_config) if isinstance(peft_config, dict) else []
    if getattr(model, "_hf_peft_config_loaded", False):
        adapters += ["active:" + name for name in model.active_adapters()]
    dtype = next(model.parameters()).dtype
    weights_version = sum(parameter._version for parameter in model.parameters())
    parts = [type(model).__name__, str(getattr(config, "_name_or_path", "")), str(dtype), ",".join(adapters)]
    parts.append(str(weights_version))
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
