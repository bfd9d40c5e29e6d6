"""`StagedKVStorage`: the pool's K/V tensors for `kv_dtype="int4-channel"`, where a block's keys are quantized per
channel once the block is full and kept exactly in companion blocks until then (`hf_paged.channel_keys`,
`hf_paged.staging`)."""

from __future__ import annotations

import torch

from .channel_keys import StagedLayout, dequantize_keys, quantize_key_blocks
from .kv_format import FORMATS, SCALE_DTYPE, KVFormat
from .staging import Staging
from .storage import KVStorage


class StagedKVStorage(KVStorage):
    """K/V blocks whose keys are quantized per channel once the block is full, values per token (`"int4"`).

    Every lane is one byte tensor `raw[lane]` `[num_blocks, row_bytes]` (the parts of a block laid out by
    `StagedLayout`), seen through typed views: `keys` / `values` (codes `[num_blocks, block_size, heads, head_dim /
    2]`), `value_scales` (`[num_blocks, block_size, heads]`), `key_scales` (`[num_blocks, heads, 2, head_dim]`: each
    channel's step and minimum) and `staging` (a companion block's row as `[staging_tokens, heads, head_dim]` keys
    in the model's dtype). Which companions hold which block's keys comes from the allocator's `Staging` through
    `apply_staging`, kept here as int32 `[num_blocks, 2, companions]` tables (the companions of the open block, then
    those of the block being filled; -1 where none).

    A write stores every value quantized and every key of an open block in its companions; a write that fills a
    block (its last slot) quantizes the block's keys from its companions and the new keys, then and only then.
    Every read gives back an open block's keys exactly and a full block's dequantized.

    Args:
        num_blocks, block_size, layer_lanes: as `KVStorage`.
        kv_format (`KVFormat`): a format with `keys_per_channel`.
        companions (`int`): companion blocks of an open block (the allocator's).
        tables (`torch.Tensor`, *optional*): companion tables to use (`over_lane`); new ones, all -1, by default.

    Example:

    ```python
    >>> import torch
    >>> from hf_paged.allocator import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=8, block_size=4, companions=2)
    >>> storage = StagedKVStorage(8, 4, kv_format=FORMATS["int4-channel"], companions=2)
    >>> table = allocator.new_table()
    >>> _ = allocator.append(table, 3)                        # block 0, its keys kept in companion blocks 1 and 2
    >>> storage.apply_staging(allocator.staging)
    >>> k = v = torch.randn(3, 2, 8)                          # 3 tokens, 2 KV heads, head_dim 8
    >>> storage.write(0, torch.tensor([0, 1, 2]), k, v)
    >>> keys, _ = storage.gather(0, torch.tensor([[0, 1, 2]]))
    >>> torch.equal(keys[0].transpose(0, 1), k)               # open: exact
    True
    >>> _ = allocator.append(table, 1)                        # the 4th token fills block 0
    >>> storage.apply_staging(allocator.staging)
    >>> storage.write(0, torch.tensor([3]), k[:1], v[:1])
    >>> keys, _ = storage.gather(0, torch.tensor([[0, 1, 2, 3]]))
    >>> torch.equal(keys[0, :, :3].transpose(0, 1), k)        # full: quantized per channel
    False

    ```
    """

    stages_keys = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layer_lanes: tuple[int, ...] | None = None,
        kv_format: KVFormat | None = None,
        companions: int = 1,
        tables: torch.Tensor | None = None,
    ):
        super().__init__(num_blocks, block_size, layer_lanes, kv_format or FORMATS["int4-channel"])
        self.companions = companions
        self.value_format = FORMATS["int4"]
        self.raw: dict[int, torch.Tensor] = {}
        self.staging: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, StagedLayout] = {}
        if tables is None:
            tables = torch.full((num_blocks, 2, companions), -1, dtype=torch.int32)
        self._tables = tables
        self._device_tables: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def over_lane(
        cls,
        rows: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> StagedKVStorage:
        """A storage of one lane (lane 0) over existing tensors, nothing copied: `rows` (`raw[lane]` of a pool's
        storage, `[num_blocks, row_bytes]`) and its companion `tables` (`[num_blocks, 2, companions]`), as a compiled
        step's ops receive them."""
        storage = cls(rows.shape[0], block_size, companions=tables.shape[2], tables=tables)
        storage._adopt(0, rows, StagedLayout(block_size, num_heads, head_dim), num_heads, dtype)
        return storage

    # ------------------------------------------------------------------ companions
    def apply_staging(self, staging: Staging) -> None:
        """Follow the allocator's companions: the blocks whose companions changed get their rows of the tables, and
        the full blocks made open again get their keys read back into their companions (dequantized)."""
        if not staging.changed and not staging.reopened:
            return
        for block in staging.changed:
            for column, companions in enumerate((staging.companions_of(block), staging.sealing_companions_of(block))):
                row = self._tables[block, column]
                row.fill_(-1)
                if companions:
                    row[: len(companions)] = torch.tensor(companions, dtype=torch.int32)
        staging.changed.clear()
        self._device_tables.clear()
        reopened, staging.reopened[:] = list(staging.reopened), []
        for lane in self.raw:
            self._read_back(lane, reopened)

    def tables_on(self, device: torch.device) -> torch.Tensor:
        """The companion tables on `device` (copied once after each change)."""
        tables = self._device_tables.get(device)
        if tables is None:
            tables = self._device_tables[device] = self._tables.to(device)
        return tables

    def _read_back(self, lane: int, blocks: list[int]) -> None:
        if not blocks:
            return
        index = torch.tensor(blocks, device=self.raw[lane].device)
        keys = self._dequantized_blocks(lane, index)  # [n, B, H, D]
        offsets = torch.arange(self.block_size, device=index.device)
        rows, within = self._staged_at(lane, self.tables_on(index.device)[index, 0], offsets[None, :])
        self.staging[lane].index_put_((rows, within), keys.to(self.staging[lane].dtype))

    def _staged_at(
        self, lane: int, companions: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Companion block and row in `lane` of each offset (`offsets` broadcast against `companions[..., k]`); -1
        blocks where none."""
        per = self.staging[lane].shape[1]
        column = (offsets // per).long().expand(*companions.shape[:-1], offsets.shape[-1])
        return companions.gather(-1, column).long(), (offsets % per).expand_as(column)

    # ------------------------------------------------------------------ lanes
    def clear(self) -> None:
        with self._lock:
            super().clear()
            for tensors in (self.raw, self.staging, self.layouts):
                tensors.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.raw.values())

    def _allocate(self, lane: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        layout = StagedLayout(self.block_size, num_heads, head_dim)
        if layout.companions(dtype) > self.companions:
            raise NotImplementedError(
                f"kv_dtype={self.format.name!r}: the keys of an open block of {self.block_size} tokens x {num_heads} "
                f"heads x {head_dim} dims in {dtype} take {layout.companions(dtype)} companion blocks, and the pool "
                f"was sized for {self.companions} (for the model's dtype); keep K/V in the model's dtype"
            )
        with torch.inference_mode(False):
            raw = torch.empty((self.num_blocks, layout.row_bytes), dtype=torch.uint8, device=device)
        self._adopt(lane, raw, layout, num_heads, dtype)

    def _adopt(self, lane: int, raw: torch.Tensor, layout: StagedLayout, num_heads: int, dtype: torch.dtype) -> None:
        """Make `raw` lane `lane`'s rows, with its typed views."""
        n, b, h, head_dim = self.num_blocks, self.block_size, num_heads, layout.head_dim
        codes = layout.code_bytes
        self.raw[lane], self.layouts[lane] = raw, layout
        self.keys[lane] = raw[:, :codes].view(n, b, h, head_dim // 2)
        self.values[lane] = raw[:, codes : 2 * codes].view(n, b, h, head_dim // 2)
        at = layout.value_scales_at
        self.value_scales[lane] = raw[:, at : at + 2 * b * h].view(SCALE_DTYPE).view(n, b, h)
        at = layout.key_params_at
        self.key_scales[lane] = raw[:, at : at + 4 * h * head_dim].view(SCALE_DTYPE).view(n, h, 2, head_dim)
        tokens = layout.staging_tokens(dtype)
        self.staging[lane] = raw.view(dtype)[:, : tokens * h * head_dim].view(n, tokens, h, head_dim)
        self.lane_kv[lane] = (num_heads, head_dim, dtype)

    # ------------------------------------------------------------------ writes and reads
    def write(self, layer_idx: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store tokens `keys[i]`, `values[i]` (`[num_tokens, num_kv_heads, head_dim]`) into `slots[i]`: values
        quantized per token, keys into their open block's companions, and the keys of every block this write fills
        quantized per channel."""
        lane = self.lane_of(layer_idx)
        if lane not in self.keys or keys.dtype != self.lane_kv[lane][2] or values.dtype != keys.dtype:
            self.ensure_layer(layer_idx, keys, values)
            keys, values = keys.to(self.lane_kv[lane][2]), values.to(self.lane_kv[lane][2])
        self.write_lane(lane, slots, keys, values)

    def write_lane(self, lane: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`write` into an allocated lane, `keys` and `values` in its dtype (`ops.write_kv_staged`)."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        codes, scales = self.value_format.quantize(values)
        self.values[lane].index_put_((blocks, offsets), codes)
        self.value_scales[lane].index_put_((blocks, offsets), scales)
        tables = self.tables_on(slots.device)
        companions, within = self._staged_at(lane, tables[blocks, 0], offsets[:, None])
        companions, within = companions[:, 0], within[:, 0]
        staged = companions >= 0
        if bool(staged.any()):
            self.staging[lane].index_put_((companions[staged], within[staged]), keys[staged])
        filled = offsets == self.block_size - 1
        if bool(filled.any()):
            self._seal(lane, blocks, offsets, keys, blocks[filled], tables)

    def _seal(self, lane, blocks, offsets, keys, sealed, tables) -> None:
        """Quantize the keys of the full blocks `sealed`: those written before from their sealing companions, the
        rest from this write's `keys`."""
        positions = torch.arange(self.block_size, device=sealed.device)
        companions, within = self._staged_at(lane, tables[sealed, 1], positions[None, :])  # [S, B]
        earlier = self.staging[lane][companions.clamp(min=0), within].float()  # [S, B, H, D]
        earlier = earlier.masked_fill((companions < 0)[..., None, None], 0.0)
        mine = (blocks[:, None] == sealed[None, :]).nonzero()  # (token, sealed block) pairs
        earlier[mine[:, 1], offsets[mine[:, 0]]] = keys[mine[:, 0]].float()
        codes, params = quantize_key_blocks(earlier.to(keys.dtype))
        self.keys[lane].index_copy_(0, sealed, codes)
        self.key_scales[lane].index_copy_(0, sealed, params)

    def _dequantized_blocks(self, lane: int, index: torch.Tensor) -> torch.Tensor:
        """Every key of blocks `index` as its codes give it back (fp32, `[n, B, H, D]`)."""
        params = self.key_scales[lane].index_select(0, index)
        return dequantize_keys(
            self.keys[lane].index_select(0, index), params[:, None, :, 0], params[:, None, :, 1], torch.float32
        )

    def read_keys(self, lane: int, slots: torch.Tensor) -> torch.Tensor:
        """Keys of `slots` (any shape), `[*slots.shape, heads, head_dim]` in the lane's dtype: an open block's
        exactly, a full block's dequantized."""
        dtype = self.lane_kv[lane][2]
        blocks, offsets = slots // self.block_size, slots % self.block_size
        params = self.key_scales[lane][blocks]  # [..., H, 2, D]
        keys = dequantize_keys(self.keys[lane][blocks, offsets], params[..., 0, :], params[..., 1, :], dtype)
        companions, within = self._staged_at(lane, self.tables_on(slots.device)[blocks, 0], offsets[..., None])
        companions, within = companions[..., 0], within[..., 0]
        staged = self.staging[lane][companions.clamp(min=0), within]
        return torch.where((companions >= 0)[..., None, None], staged, keys)

    def read_values(self, lane: int, slots: torch.Tensor) -> torch.Tensor:
        """Values of `slots` (any shape), `[*slots.shape, heads, head_dim]` in the lane's dtype."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return self.value_format.dequantize(
            self.values[lane][blocks, offsets], self.value_scales[lane][blocks, offsets], self.lane_kv[lane][2]
        )

    def gather(
        self, layer_idx: int, slot_map: torch.Tensor, head_index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots in `slot_map` (`[batch, length]`) as contiguous `[batch, num_kv_heads, length,
        head_dim]` tensors (`head_index` is not used)."""
        lane = self.lane_of(layer_idx)
        return tuple(read(lane, slot_map).transpose(1, 2).contiguous() for read in (self.read_keys, self.read_values))

    def copy_blocks(self, copies) -> None:
        """Copy whole blocks `src -> dst` in every allocated lane (copy-on-write; companions are copied as blocks)."""
        if not copies:
            return
        for raw in self.raw.values():
            src = torch.tensor([c.src for c in copies], device=raw.device)
            dst = torch.tensor([c.dst for c in copies], device=raw.device)
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def blocks_tensors(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """A copy on the CPU of full blocks `block_ids` in every allocated lane: `r.LANE` (`[len(block_ids),
        row_bytes]`, the rows as stored) and `m.LANE` (`[len(block_ids), 3]`: heads, head_dim, bytes of the lane's
        dtype)."""
        out = {}
        for lane, raw in self.raw.items():
            out[f"r.{lane}"] = raw.index_select(0, torch.tensor(block_ids, device=raw.device)).to("cpu")
            heads, head_dim, dtype = self.lane_kv[lane]
            out[f"m.{lane}"] = torch.tensor([[heads, head_dim, torch.finfo(dtype).bits // 8]] * len(block_ids))
        return out

    def block_fits(self, tensors: dict[str, torch.Tensor], num_lanes: int) -> bool:
        if set(tensors) != {f"{part}.{lane}" for part in "rm" for lane in range(num_lanes)}:
            return False
        for lane in range(num_lanes):
            heads, head_dim, _ = (int(x) for x in tensors[f"m.{lane}"])
            layout = StagedLayout(self.block_size, heads, head_dim)
            row = tensors[f"r.{lane}"]
            if row.dtype != torch.uint8 or tuple(row.shape) != (layout.row_bytes,):
                return False
            if lane in self.raw and (heads, head_dim) != self.lane_kv[lane][:2]:
                return False
        return True

    def _load_target(self, name: str, first: dict[str, torch.Tensor], dtype: torch.dtype, device):
        """A lane's row of bytes for part `r.LANE` (its lane allocated where it is not yet); `None` for the lane's
        shape part `m.LANE`, which is not copied."""
        part, lane = name.split(".")
        if part != "r":
            return None
        lane = int(lane)
        if lane not in self.raw:
            heads, head_dim, _ = (int(x) for x in first[f"m.{lane}"])
            with self._lock:
                if lane not in self.raw:
                    self._allocate(lane, heads, head_dim, dtype, device)
        return self.raw[lane]

    def layer_tensors(self, layer_idx: int):
        """The K and V blocks of `layer_idx` as `StagedPages` (read by the gather reference only)."""
        lane = self.lane_of(layer_idx)
        return StagedPages(self, lane, "keys"), StagedPages(self, lane, "values")


class StagedPages:
    """One lane's keys (or values) of a `StagedKVStorage`, as the kernels read them: `read(slots)` for the gather
    reference, the storage's views for the CPU and Triton kernels (the in-place backends that read these pages:
    `in_place_backends`; flash-attn does not), and `shape` / `dtype` / `device` of the dense blocks it stands
    for."""

    in_place_backends = ("cpu", "triton")
    keys_per_channel = True  # `attends_rotated_pages` hands the kernels the query unrotated too

    def __init__(self, storage: StagedKVStorage, lane: int, part: str):
        self.storage, self.lane, self.part = storage, lane, part
        heads, head_dim, self.dtype = storage.lane_kv[lane]
        self.shape = torch.Size((storage.num_blocks, storage.block_size, heads, head_dim))
        self.format = storage.format

    @property
    def device(self) -> torch.device:
        return self.storage.raw[self.lane].device

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        read = self.storage.read_keys if self.part == "keys" else self.storage.read_values
        return read(self.lane, slots)

    def __repr__(self) -> str:
        return f"StagedPages({self.format.name} {self.part}, shape={tuple(self.shape)}, dtype={self.dtype})"
