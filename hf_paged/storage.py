"""Physical KV tensors: the only owner of the pool's memory."""

from __future__ import annotations

import threading

import torch

from .allocator import BlockCopy
from .kv_format import FORMATS, SCALE_DTYPE, KVFormat, QuantizedPages


class KVStorage:
    """K and V tensors of shape `[num_blocks, block_size, num_kv_heads, head_dim]` per lane (the layout paged
    GPU kernels such as flash-attn's `flash_attn_with_kvcache(block_table=...)` read).

    A lane is one layer's place in a block (a slot is one token's place). Every layer has a lane of its own, except
    in hybrid models split into layer groups (see `KVLayout`), where layer `l` uses lane `layer_lanes[l]`, shared with
    one layer of every other group: a block belongs to one group at a time, so its lanes hold that group's layers. A
    lane's tensors are allocated on the first write, on the
    device and in the dtype of the K/V its layer produces, so models spread over several devices keep each layer's
    blocks next to its weights. Slots are addressed as `block_id * block_size + offset`.

    Args:
        num_blocks (`int`): blocks per lane.
        block_size (`int`): tokens per block.
        layer_lanes (`tuple[int, ...]`, *optional*): the lane of every layer (default: layer `l` uses lane `l`).
        kv_format (`KVFormat`, *optional*): how tokens are stored (default: in the dtype the model produces them
            in). A quantized format keeps int8 (or packed int4) codes `[num_blocks, block_size, num_kv_heads,
            code_dim]` in `keys`/`values` and a bfloat16 scale per token and head in `key_scales`/`value_scales`
            (see `hf_paged.kv_format`); reads dequantize into the dtype the model produced.

    `stages_keys` is `False`: every token is stored as it is written (see `StagedKVStorage` for the format that
    keeps an open block's keys aside until the block fills).

    Example:

    ```python
    >>> import torch
    >>> storage = KVStorage(num_blocks=4, block_size=2)
    >>> k = v = torch.arange(12.0).view(3, 1, 4)          # 3 tokens, 1 head, head_dim 4
    >>> storage.write(0, torch.tensor([2, 3, 6]), k, v)    # tokens land in blocks 1 and 3
    >>> keys, _ = storage.gather(0, torch.tensor([[2, 3, 6]]))
    >>> keys.shape, torch.equal(keys[0, 0], k[:, 0])
    (torch.Size([1, 1, 3, 4]), True)

    ```
    """

    stages_keys = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layer_lanes: tuple[int, ...] | None = None,
        kv_format: KVFormat | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layer_lanes = layer_lanes
        self.format = kv_format or FORMATS["auto"]
        self.keys: dict[int, torch.Tensor] = {}  # by lane: K/V, or their codes in a quantized format
        self.values: dict[int, torch.Tensor] = {}
        self.key_scales: dict[int, torch.Tensor] = {}  # by lane, quantized formats only: [blocks, block_size, heads]
        self.value_scales: dict[int, torch.Tensor] = {}
        self.lane_kv: dict[int, tuple[int, int, torch.dtype]] = {}  # by lane: (num_kv_heads, head_dim, dtype)
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Drop every lane's tensors (each is allocated again on its next write)."""
        with self._lock:
            for tensors in (self.keys, self.values, self.key_scales, self.value_scales, self.lane_kv):
                tensors.clear()

    def lane_of(self, layer_idx: int) -> int:
        return layer_idx if self.layer_lanes is None else self.layer_lanes[layer_idx]

    @property
    def nbytes(self) -> int:
        """Bytes of every allocated lane, scales included."""
        tensors = (self.keys, self.values, self.key_scales, self.value_scales)
        return sum(t.numel() * t.element_size() for lanes in tensors for t in lanes.values())

    def has_layer(self, layer_idx: int) -> bool:
        """Whether `layer_idx`'s tensors are allocated (its first K/V was written)."""
        return self.lane_of(layer_idx) in self.keys

    def ensure_layer(self, layer_idx: int, like: torch.Tensor, values_like: torch.Tensor | None = None) -> None:
        """Allocate `layer_idx` for tokens shaped like `like` (`[..., num_kv_heads, head_dim]`) or check it matches.
        K and V share one dtype, the one that holds both exactly: under `torch.autocast` a layer's keys can come out
        in float32 (after RoPE) and its values in bfloat16; both are then stored in float32 without loss."""
        dtype = like.dtype if values_like is None else torch.promote_types(like.dtype, values_like.dtype)
        num_heads, head_dim = like.shape[-2], like.shape[-1]
        if values_like is not None and values_like.shape[-2:] != like.shape[-2:]:
            raise NotImplementedError(
                f"layer {layer_idx} produced keys of {num_heads} heads x {head_dim} dims and values of "
                f"{values_like.shape[-2]} x {values_like.shape[-1]}: the pool stores a layer's keys and values in "
                "blocks of one shape"
            )
        lane = self.lane_of(layer_idx)
        if lane not in self.keys:
            self.format.check_head_dim(head_dim, f"layer {layer_idx}")
            with self._lock:
                if lane not in self.keys:
                    self._allocate(lane, num_heads, head_dim, dtype, like.device)
            return
        existing_heads, existing_dim, existing_dtype = self.lane_kv[lane]
        existing_device = self.keys[lane].device
        if (existing_heads, existing_dim) != (num_heads, head_dim) and lane != layer_idx:
            raise NotImplementedError(
                f"layer {layer_idx} produced K/V of {num_heads} heads x {head_dim} dims, but lane {lane}, which it "
                f"shares with a layer of another layer group, holds {existing_heads} x {existing_dim}: the "
                "pool needs the layers of every layer group (full and sliding attention) to have K/V of one shape"
            )
        if (existing_heads, existing_dim) != (num_heads, head_dim) or existing_device != like.device:
            raise self._mismatch(layer_idx, like)
        for produced in (like, values_like):
            if produced is not None and not _accepts(existing_dtype, produced):
                raise self._mismatch(layer_idx, produced)

    def _allocate(self, lane: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (self.num_blocks, self.block_size, num_heads)
        # empty, not zeros: pages are touched only as blocks are used, and reads only ever name slots that were
        # written (pad positions name the row's first real slot)
        with torch.inference_mode(False):  # normal tensors: written in and out of inference mode
            if self.format.quantized:
                code_shape = (*shape, self.format.code_dim(head_dim))
                for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
                    codes[lane] = torch.empty(code_shape, dtype=self.format.code_dtype, device=device)
                    scales[lane] = torch.empty(shape, dtype=SCALE_DTYPE, device=device)
            else:
                self.keys[lane] = torch.empty((*shape, head_dim), dtype=dtype, device=device)
                self.values[lane] = torch.empty((*shape, head_dim), dtype=dtype, device=device)
        self.lane_kv[lane] = (num_heads, head_dim, dtype)

    def _mismatch(self, layer_idx: int, like: torch.Tensor) -> ValueError:
        lane = self.lane_of(layer_idx)
        shared = "" if lane == layer_idx else f" (lane {lane}, shared with other layer groups)"
        num_heads, head_dim = like.shape[-2], like.shape[-1]
        existing_heads, existing_dim, existing_dtype = self.lane_kv[lane]
        return ValueError(
            f"layer {layer_idx}{shared} of the KV pool holds {existing_heads} heads x {existing_dim} "
            f"dims of {existing_dtype} on {self.keys[lane].device}, but the model produced {num_heads} heads x "
            f"{head_dim} dims of {like.dtype} on {like.device}. A pool serves one model in one dtype: release the "
            "caches that hold blocks (an idle pool follows a dtype change by itself), or call "
            "hf_paged.release_pool(model) after moving the model to another device."
        )

    def write(self, layer_idx: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store tokens `keys[i]`, `values[i]` (each `[num_tokens, num_kv_heads, head_dim]`) into `slots[i]`. Under
        `torch.autocast` a dtype the storage holds exactly (bfloat16 in float32) is converted (autocast converts what
        the attention reads back); any other dtype is refused (`ValueError`)."""
        lane = self.lane_of(layer_idx)
        if lane not in self.keys:
            self.ensure_layer(layer_idx, keys, values)
        dtype = self.lane_kv[lane][2]
        if keys.dtype != dtype or values.dtype != dtype:
            self.ensure_layer(layer_idx, keys, values)  # raises unless both convert exactly
            keys, values = keys.to(dtype), values.to(dtype)
        if not self.format.quantized:
            self.keys[lane].view(-1, *keys.shape[1:]).index_copy_(0, slots, keys)
            self.values[lane].view(-1, *values.shape[1:]).index_copy_(0, slots, values)
            return
        for tensor, codes, scales in ((keys, self.keys, self.key_scales), (values, self.values, self.value_scales)):
            self.format.store(tensor, codes[lane], scales[lane], slots)  # each token on its own: written once

    def gather(
        self, layer_idx: int, slot_map: torch.Tensor, head_index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots in `slot_map` (`[batch, length]`) as contiguous `[batch, num_kv_heads, length,
        head_dim]` tensors, read head by head (`head_index = head_rows(slot_map, num_kv_heads)` may be passed in when
        several layers share it)."""
        lane = self.lane_of(layer_idx)
        num_heads, head_dim, dtype = self.lane_kv[lane]
        if head_index is None:
            head_index = head_rows(slot_map, num_heads)
        batch, length = slot_map.shape
        out = []
        for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            rows = codes[lane].view(-1, codes[lane].shape[-1]).index_select(0, head_index)
            if self.format.quantized:
                rows = self.format.dequantize(rows, scales[lane].view(-1).index_select(0, head_index), dtype)
            out.append(rows.view(batch, num_heads, length, head_dim))
        return out[0], out[1]

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy whole blocks `src -> dst` in every allocated lane (copy-on-write)."""
        if not copies:
            return
        for lane, keys in self.keys.items():
            src = torch.tensor([c.src for c in copies], device=keys.device)
            dst = torch.tensor([c.dst for c in copies], device=keys.device)
            for tensors in (self.keys, self.values, self.key_scales, self.value_scales):
                if lane in tensors:  # codes and their scales travel together
                    tensors[lane].index_copy_(0, dst, tensors[lane].index_select(0, src))

    def blocks_tensors(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """A copy on the CPU of blocks `block_ids` in every allocated lane, as stored (codes and scales of a quantized
        format): `k.LANE`, `v.LANE` (`[len(block_ids), block_size, num_kv_heads, head_dim or code_dim]`), `ks.LANE`,
        `vs.LANE` (`[len(block_ids), block_size, num_kv_heads]`)."""
        out, indices = {}, {}
        for prefix, tensors in zip(_PARTS, (self.keys, self.values, self.key_scales, self.value_scales)):
            for lane, tensor in tensors.items():
                index = indices.get(tensor.device)
                if index is None:
                    index = indices[tensor.device] = torch.tensor(block_ids, device=tensor.device)
                out[f"{prefix}.{lane}"] = tensor.index_select(0, index).to("cpu")
        return out

    def block_fits(self, tensors: dict[str, torch.Tensor], num_lanes: int) -> bool:
        """Whether one block's `tensors` (`blocks_tensors` of one block) fit this storage: its lanes, and the shapes
        and dtypes of the lanes already allocated."""
        prefixes = _PARTS if self.format.quantized else _PARTS[:2]
        if set(tensors) != {f"{prefix}.{lane}" for prefix in prefixes for lane in range(num_lanes)}:
            return False
        for lane in range(num_lanes):
            key = tensors[f"k.{lane}"]
            if key.dim() != 3 or key.shape[0] != self.block_size or tensors[f"v.{lane}"].shape != key.shape:
                return False
            if self.format.quantized:
                if key.dtype != self.format.code_dtype or tensors[f"ks.{lane}"].shape != key.shape[:2]:
                    return False
                if tensors[f"vs.{lane}"].shape != key.shape[:2]:
                    return False
            if lane in self.keys and (key.shape != self.keys[lane].shape[1:] or key.dtype != self.keys[lane].dtype):
                return False
        return True

    def load_blocks(
        self, block_ids: list[int], blocks: list[dict[str, torch.Tensor]], dtype: torch.dtype, device
    ) -> None:
        """Write `blocks[i]` (one block's tensors, checked by `block_fits`) into block `block_ids[i]`, one copy per
        lane and part for all of them; a lane not allocated yet is allocated on `device`, its K/V read back in
        `dtype`."""
        if not block_ids:
            return
        first, index = blocks[0], torch.tensor(block_ids)
        with torch.no_grad():
            for name in first:
                target = self._load_target(name, first, dtype, torch.device(device))
                if target is not None:
                    copy_blocks_in(target, index, [block[name] for block in blocks])

    def _load_target(self, name: str, first: dict[str, torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
        """The tensor that an entry's part `name` (`k.3`, `vs.0`, ...) is copied into, its lane allocated from the
        shapes in `first` (one block's tensors) where it is not yet."""
        prefix, lane = name.split(".")
        lane = int(lane)
        if lane not in self.keys:
            heads, width = first[f"k.{lane}"].shape[1:]
            head_dim = width * 8 // self.format.bits if self.format.quantized else width
            stored = dtype if self.format.quantized else first[f"k.{lane}"].dtype
            with self._lock:
                if lane not in self.keys:
                    self._allocate(lane, heads, head_dim, stored, device)
        parts = dict(zip(_PARTS, (self.keys, self.values, self.key_scales, self.value_scales)))
        return parts[prefix][lane]

    def layer_tensors(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedPages, QuantizedPages]:
        """The K and V blocks holding `layer_idx`: tensors `[num_blocks, block_size, num_kv_heads, head_dim]`, or in a
        quantized format `QuantizedPages` (codes and scales) that look like them."""
        lane = self.lane_of(layer_idx)
        if not self.format.quantized:
            return self.keys[lane], self.values[lane]
        dtype = self.lane_kv[lane][2]
        return (
            QuantizedPages(self.format, self.keys[lane], self.key_scales[lane], dtype),
            QuantizedPages(self.format, self.values[lane], self.value_scales[lane], dtype),
        )

    def device_of(self, layer_idx: int) -> torch.device:
        return self.keys[self.lane_of(layer_idx)].device

    def num_heads(self, layer_idx: int) -> int:
        return self.keys[self.lane_of(layer_idx)].shape[2]


_PARTS = ("k", "v", "ks", "vs")


def copy_blocks_in(target: torch.Tensor, block_ids: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """`target[block_ids[i]] = tensors[i]` as one copy."""
    device = target.device
    target.index_copy_(0, block_ids.to(device), torch.stack(tensors).to(device, target.dtype))


def head_rows(slot_map: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a `[slots * num_heads, head_dim]` view of a layer, in `[batch, head, position]` order: gathering them
    yields K or V already laid out as contiguous `[batch, num_heads, length, head_dim]`."""
    heads = torch.arange(num_heads, device=slot_map.device)
    return (slot_map[:, None, :] * num_heads + heads[None, :, None]).reshape(-1)


def _accepts(stored: torch.dtype, produced: torch.Tensor) -> bool:
    """Whether K/V `produced` may go into storage of dtype `stored`: the same dtype, or under `torch.autocast` one
    whose every value `stored` holds exactly (bfloat16 or float16 in float32)."""
    if produced.dtype == stored:
        return True
    autocast = _autocast_dtype_on(produced.device.type) is not None
    return autocast and torch.promote_types(stored, produced.dtype) == stored


def autocast_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype `torch.autocast` computes `model`'s forward in now, or `None` outside autocast."""
    return _autocast_dtype_on(next(model.parameters()).device.type)


def _autocast_dtype_on(device_type: str) -> torch.dtype | None:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know ("meta")
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None
