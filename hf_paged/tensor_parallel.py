"""What one rank of a tensor-parallel model stores: its place in transformers' tensor-parallel group and the KV heads
its attention layers actually hold.

A model loaded with `from_pretrained(path, tp_plan="auto")` under `torchrun` keeps its parameters as `DTensor`s;
a column-wise sharded key projection holds only this rank's rows, so this rank's attention writes (and its pool
stores) only its share of the KV heads. The share is measured from those local shapes, not assumed from the plan.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

logger = logging.getLogger(__name__)

# the parameters whose output rows are the attention keys: separate (Llama, Qwen2, Mistral, ...) or fused with the
# queries and values (Phi-3, Falcon, GPT-NeoX, GPT-2, MPT)
_KEY_PROJECTION = re.compile(r"(?:^|\.)(?:k_proj|key_proj|qkv_proj|query_key_value|c_attn|Wqkv)\.weight$")


@dataclass(frozen=True)
class TensorParallelPlacement:
    """Where this process sits in the model's tensor-parallel group.

    Attributes:
        rank (`int`): this process's index in the tensor-parallel group (0 without tensor parallelism).
        world_size (`int`): processes sharing the model's heads (1 without tensor parallelism).
        kv_share (`fractions.Fraction`): the part of every layer's KV heads this rank stores (1 when the key
            projections are not sharded).
    """

    rank: int = 0
    world_size: int = 1
    kv_share: Fraction = Fraction(1)

    @property
    def is_sharded(self) -> bool:
        return self.kv_share != 1


def tensor_parallel_placement(model: torch.nn.Module) -> TensorParallelPlacement:
    """This process's `TensorParallelPlacement` for `model` (rank 0 of 1 for a model without tensor parallelism).

    Example:

    ```python
    >>> from hf_paged.reference_models import tiny_model
    >>> tensor_parallel_placement(tiny_model("llama"))
    TensorParallelPlacement(rank=0, world_size=1, kv_share=Fraction(1, 1))

    ```
    """
    world_size = getattr(model, "tp_size", None) or 1
    if world_size < 2:
        return TensorParallelPlacement()
    return TensorParallelPlacement(_tp_rank(model, world_size), world_size, _kv_share(model, world_size))


def local_kv_shapes(shapes: list[tuple[int, int]], placement: TensorParallelPlacement) -> list[tuple[int, int]]:
    """`(num_kv_heads, head_dim)` of every layer as this rank stores it: `shapes` (the whole model's, from its
    config) with the heads cut to the rank's share.

    Raises:
        ValueError: the tensor-parallel degree does not divide a layer's KV heads (each rank would hold part of a
            head).

    Example:

    ```python
    >>> from fractions import Fraction
    >>> local_kv_shapes([(4, 16), (4, 16)], TensorParallelPlacement(1, 2, Fraction(1, 2)))
    [(2, 16), (2, 16)]

    ```
    """
    if not placement.is_sharded:
        return list(shapes)
    local = []
    for layer_idx, (num_kv_heads, head_dim) in enumerate(shapes):
        heads = num_kv_heads * placement.kv_share
        if num_kv_heads % placement.world_size or heads.denominator != 1:
            raise ValueError(
                f"tensor parallelism over tp_size={placement.world_size} ranks cannot split the {num_kv_heads} KV "
                f"heads of layer {layer_idx}: the KV heads must be a multiple of the tensor-parallel degree (choose "
                f"a tp_size that divides {num_kv_heads})"
            )
        local.append((int(heads), head_dim))
    return local


def _tp_rank(model: torch.nn.Module, world_size: int) -> int:
    """This process's coordinate on the "tp" axis of the model's device mesh (transformers keeps the mesh as
    `model._device_mesh`, axes `("pp", "fsdp", "tp")`); the global rank modulo the degree where there is none."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        return mesh.get_local_rank("tp")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        logger.info("hf_paged: the model has no tensor-parallel mesh; its rank is the process rank mod %d", world_size)
        return dist.get_rank() % world_size
    raise ValueError(
        f"the model reports tp_size={world_size} but torch.distributed is not initialized; launch every rank "
        f"with torchrun (or init_process_group) before loading it"
    )


def _kv_share(model: torch.nn.Module, world_size: int) -> Fraction:
    """The part of the KV heads this rank stores, measured from its key projections' local shards."""
    shares = set()
    for name, parameter in model.named_parameters():
        if _KEY_PROJECTION.search(name) is None:
            continue
        local = _local_shape(parameter)
        sharded = [(small, full) for small, full in zip(local, parameter.shape) if small != full]
        shares.add(Fraction(sharded[0][0], sharded[0][1]) if sharded else Fraction(1))
    if not shares:
        logger.warning(
            "hf_paged: no key projection found in %s; sizing the pool for 1/%d of the KV heads per rank",
            type(model).__name__,
            world_size,
        )
        return Fraction(1, world_size)
    if len(shares) > 1:
        raise ValueError(
            f"the key projections of {type(model).__name__} are sharded unevenly across tp_size={world_size} ranks "
            f"(shares {sorted(shares)}); hf_paged needs every layer's KV heads split the same way"
        )
    return shares.pop()


def _local_shape(parameter: torch.Tensor) -> torch.Size:
    to_local = getattr(parameter, "to_local", None)  # a DTensor: this rank's shard
    if to_local is None:
        return parameter.shape
    with torch.no_grad():
        return to_local().shape
