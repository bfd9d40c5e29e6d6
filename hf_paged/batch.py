"""`ForwardBatch`: one forward, planned before the model runs — where its new tokens are written and where each
layer reads its K/V from. The cache writes and reads through it; it takes no block."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .allocator import BlockTable
from .groups import KVLayout
from .key_groups import split_by_length
from .rows import Row
from .storage import KVStorage, head_rows
from .transfer import device_tensor


@dataclass(frozen=True)
class ForwardInputs:
    """What the forward pre-hook knows about the coming forward.

    Attributes:
        attention_mask, input_ids, position_ids (`torch.Tensor`, *optional*): the forward's inputs.
        shape (`tuple[int, int] | None`): `(batch, new positions)` from `input_ids` or `inputs_embeds`; `None` when
            neither was given (the forward is then planned at its first K/V write).
        device (`torch.device`, *optional*): where those inputs are.
        reads_tables (`bool`): whether the model's attention is `"hf_paged"` (it reads K/V through the tables).
        beyond_token_ids (`bool`): whether other tensor inputs (images, `inputs_embeds`, ...) decide K/V too.
    """

    attention_mask: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    shape: tuple[int, int] | None = None
    device: torch.device | None = None
    reads_tables: bool = False
    beyond_token_ids: bool = False


@dataclass
class Addressing:
    """Where one layer group's new tokens go and where its layers read their K/V from, in one forward.

    `slot_map[b, j]` is the slot (`block_id * block_size + offset`) of padded position `j` of row `b`; left-pad
    positions and positions whose block the group's window skipped name the row's first live slot, which the
    attention mask hides (a sliding layer reads from `KVLayout.first_read` on, and every query whose output is used
    sees only positions inside its window). `write_slots` are the slots of the new tokens that are stored;
    `write_index` selects them from the flattened `[batch * num_new]` new tokens (`None` when every new token is
    stored).
    """

    slot_map: torch.Tensor
    write_slots: torch.Tensor
    write_index: torch.Tensor | None
    _moved: dict = field(default_factory=dict)
    _read_indexes: dict = field(default_factory=dict)

    def read_index(
        self, num_heads: int, first: int, stop: int | None = None, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(slots, storage.head_rows(slots))` of positions `first .. stop - 1` of `rows` (default: all; on any
        device), computed once per forward for all layers alike (`rows` must live as long as the forward)."""
        key = (num_heads, first, stop, None if rows is None else id(rows))
        if key not in self._read_indexes:
            slots = self.slot_map if rows is None else self.slot_map.index_select(0, rows.to(self.slot_map.device))
            slots = slots[:, first:stop]
            self._read_indexes[key] = slots, head_rows(slots, num_heads)
        return self._read_indexes[key]

    def on(self, device: torch.device) -> Addressing:
        """This addressing with its index tensors on `device` (for models whose layers sit on several devices)."""
        if device == self.slot_map.device:
            return self
        if device not in self._moved:
            index = None if self.write_index is None else self.write_index.to(device)
            self._moved[device] = Addressing(self.slot_map.to(device), self.write_slots.to(device), index)
        return self._moved[device]


@dataclass(frozen=True)
class KeyGroup:
    """Rows of a right-aligned forward that read their keys together, from padded position `start` on (their
    longest row's first position)."""

    rows: torch.Tensor
    start: int


@dataclass
class QueryGroup:
    """Rows of a packed forward whose queries attend together: `[rows, heads, width, head_dim]`, each row's spare
    query slots repeating its last token.

    Attributes:
        rows (`torch.Tensor`): `[rows]` indices of the group's rows in the batch.
        width (`int`): the most new tokens of a row in the group.
        unpack_index (`torch.Tensor`): `[rows * width]` packed index of every query slot.
        token_index (`torch.Tensor`): packed indices of the group's real tokens, in row order.
        source_index (`torch.Tensor`): where each of those tokens sits in the `[rows * width]` layout.
        query_positions (`torch.Tensor`): `[rows, width]` logical position of every query slot.
        lengths (`torch.Tensor`): `[rows]` tokens of every row after this forward (its keys `0 .. length - 1`).
        key_length (`int`): the longest row of the group: keys past it are not read.
        causal (`bool`): the group is one whole prompt (plain causal attention).
        row_ids (`tuple[int, ...]`): `rows` on the host (read without a device synchronisation).
    """

    rows: torch.Tensor
    width: int
    unpack_index: torch.Tensor
    token_index: torch.Tensor
    source_index: torch.Tensor
    query_positions: torch.Tensor
    lengths: torch.Tensor
    key_length: int
    causal: bool = False
    row_ids: tuple[int, ...] = ()
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean `[rows, 1, width, key_length]`: query `j` of a row sees its row's keys up to its own position (the
        last `window` of them for a sliding layer). `None` for a group that is one whole prompt with no window in
        reach: plain causal attention, which SDPA computes without a mask (faster on long prompts)."""
        if self.causal and (window is None or window >= self.key_length):
            return None
        if window not in self._masks:
            keys = torch.arange(self.key_length, device=self.lengths.device)[None, None, :]
            queries = self.query_positions[:, :, None]
            visible = (keys <= queries) & (keys < self.lengths[:, None, None])
            if window is not None:
                visible &= queries - keys < window
            self._masks[window] = visible[:, None]
        return self._masks[window]


@dataclass(frozen=True)
class InPlacePart:
    """The rows of a packed forward whose attention an in-place kernel computes (`PackedRows.in_place_part`).

    Attributes:
        rows (`torch.Tensor`): `[rows]` batch indices of the rows, in the order the kernel sees them.
        query_start (`torch.Tensor`): int32 `[rows + 1]`: where each row's queries start in the kernel's queries.
        token_index (`torch.Tensor`, *optional*): packed indices of those queries (`None`: every token of the
            forward, in packed order).
        rest (`list[QueryGroup]`): the query groups that gather instead.
    """

    rows: torch.Tensor
    query_start: torch.Tensor
    token_index: torch.Tensor | None
    rest: list


GROUPINGS = ("log2", "one", "rows")


def _group_key(grouping: str, row: int, count: int) -> int:
    if grouping == "one":
        return 0
    if grouping == "rows":
        return row
    return (count - 1).bit_length()  # "log2": widths within a factor of 2; every decoding row (1 token) together


@dataclass
class PackedRows:
    """How the tokens of a packed forward (`[1, T]`: every row's new tokens one after another, no pad position)
    belong to its rows, and how their queries are grouped for attention.

    Rows are grouped by their number of new tokens (`grouping="log2"`: counts within a factor of 2 share a group, so
    every decoding row is in one group and a long prompt chunk does not pad the decoding rows' queries to its
    width), and, given a group `cost`, each such group is split by the rows' lengths (`key_groups.split_by_length`:
    short rows do not read up to the longest row's length); each group attends in one call over its rows' keys.

    Attributes:
        counts (`list[int]`): new tokens of every row, in row order (`T = sum(counts)`).
        starts (`list[int]`): index of every row's first new token in the packed sequence.
        groups (`list[QueryGroup]`): the query groups.
    """

    counts: list[int]
    starts: list[int]
    groups: list[QueryGroup]
    _in_place: dict = field(default_factory=dict)

    @classmethod
    def of(
        cls, pasts: list[int], counts: list[int], device, grouping: str = "log2", cost: int | None = None
    ) -> PackedRows:
        """The packing of rows holding `pasts[i]` tokens before the forward and storing `counts[i]` new ones (`cost`:
        of one more group, in key positions; `None`: no split by length)."""
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        members: dict[int, list[int]] = {}
        for row, count in enumerate(counts):
            members.setdefault(_group_key(grouping, row, count), []).append(row)
        runs = [rows for _, rows in sorted(members.items())]
        if cost is not None:
            lengths = [past + count for past, count in zip(pasts, counts)]
            runs = [
                [rows[i] for i in part] for rows in runs for part in split_by_length([lengths[r] for r in rows], cost)
            ]
        groups = [cls._group(rows, pasts, counts, starts, device) for rows in runs]
        return cls(counts, starts, groups)

    @staticmethod
    def _group(rows: list[int], pasts, counts, starts, device) -> QueryGroup:
        group_counts = [counts[row] for row in rows]
        group_starts = [starts[row] for row in rows]
        group_pasts = [pasts[row] for row in rows]
        width = max(group_counts)
        count_column = device_tensor(group_counts, device)
        start_column = device_tensor(group_starts, device)
        last = torch.minimum(torch.arange(width, device=device)[None, :], count_column[:, None] - 1)
        unpack = start_column[:, None] + last  # spare query slots repeat the row's last token
        real = torch.arange(width, device=device)[None, :] < count_column[:, None]  # [rows, width] real queries
        lengths = [past + count for past, count in zip(group_pasts, group_counts)]
        return QueryGroup(
            device_tensor(rows, device),
            width,
            unpack.reshape(-1),
            unpack[real],  # real query slots, row by row: their packed tokens ...
            real.reshape(-1).nonzero().squeeze(1),  # ... and their places in the [rows * width] layout
            device_tensor(group_pasts, device)[:, None] + last,
            device_tensor(lengths, device),
            max(lengths),
            causal=len(rows) == 1 and group_pasts[0] == 0,
            row_ids=tuple(rows),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def in_place_part(self, max_queries: int | None) -> InPlacePart | None:
        """The rows an in-place kernel attends for: those of every query group at most `max_queries` wide (`None`:
        every group), with the query groups left to gather; `None` when no group qualifies. Computed once per
        forward for all layers."""
        if max_queries not in self._in_place:
            taken = [g for g in self.groups if max_queries is None or g.width <= max_queries]
            part = None
            if taken:
                device = taken[0].rows.device
                rows = torch.cat([g.rows for g in taken]) if len(taken) > 1 else taken[0].rows
                row_ids = [row for g in taken for row in g.row_ids]  # on the host: no device read
                counts = [self.counts[row] for row in row_ids]
                query_start = device_tensor([0, *itertools.accumulate(counts)], device, torch.int32)
                whole = len(taken) == len(self.groups) and row_ids == list(range(len(self.counts)))
                token_index = None if whole else torch.cat([g.token_index for g in taken])
                rest = [g for g in self.groups if not (max_queries is None or g.width <= max_queries)]
                part = InPlacePart(rows, query_start, token_index, rest)
            self._in_place[max_queries] = part
        return self._in_place[max_queries]

    @property
    def last_token_index(self) -> torch.Tensor:
        """`[rows]` packed index of every row's last new token (whose logits sample the row's next token)."""
        return torch.tensor([start + count - 1 for start, count in zip(self.starts, self.counts)])


@dataclass
class ForwardBatch:
    """One forward of `rows`, planned once for all layers by `ForwardPlanner`: its blocks are taken (copy-on-write
    copies done) before the model runs. Every row computes the last `num_new` of its `length` padded positions.

    Attributes:
        rows (`list[Row]`): the rows, in batch order (not owned: their blocks belong to whoever built them).
        groups (`list[Addressing]`): the addressing of every layer group (`KVLayout.groups`).
        layout (`KVLayout`): the layer groups and windows.
        past_length (`int`): padded positions cached before this forward.
        num_new (`int`): positions every row computes.
        reads_tables (`bool`): whether attention reads K/V through the tables (`"hf_paged"`): `write` then hands
            back only the new tokens.
        num_copies (`int`): blocks copied (copy-on-write) while planning it.
        leading_pads (`list[int]`): every row's left-pad positions (never stored).
        packed (`PackedRows`, *optional*): set when the forward's tokens are packed into one `[1, T]` sequence
            with no pad position (the Engine under `"hf_paged"` attention); rows then need no left padding.
        layers_written, layers_read (`set[int]`): the layers that wrote and read so far.
    """

    rows: list[Row]
    groups: list[Addressing]
    layout: KVLayout
    past_length: int
    num_new: int
    reads_tables: bool
    num_copies: int = 0
    leading_pads: list[int] = field(default_factory=list)
    packed: PackedRows | None = None
    layers_written: set[int] = field(default_factory=set)
    layers_read: set[int] = field(default_factory=set)
    last_layer: int | None = None
    _key_groups: dict = field(default_factory=dict)
    _kernel_tables: dict = field(default_factory=dict)
    _causal_masks: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Padded positions after this forward."""
        return self.past_length + self.num_new

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def input_shape(self) -> tuple[int, int]:
        """`(batch, positions)` of the forward's inputs: `(1, T)` when packed."""
        if self.packed is not None:
            return 1, self.packed.num_tokens
        return self.batch_size, self.num_new

    def write(self, storage: KVStorage, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store layer `layer_idx`'s new K/V (`[batch, num_kv_heads, num_new, head_dim]`) in the planned slots."""
        self.layers_written.add(layer_idx)
        self.last_layer = layer_idx
        batch, num_heads, num_new, head_dim = key_states.shape
        local = self.groups[self.layout.group_of[layer_idx]].on(key_states.device)
        new_keys = key_states.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
        new_values = value_states.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
        if local.write_index is not None:
            new_keys = new_keys.index_select(0, local.write_index)
            new_values = new_values.index_select(0, local.write_index)
        storage.write(layer_idx, local.write_slots, new_keys, new_values)

    def read(
        self,
        storage: KVStorage,
        layer_idx: int,
        rows: torch.Tensor | None = None,
        start: int = 0,
        stop: int | None = None,
        new: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `layer_idx` for the padded positions it attends to, gathered through the block tables:
        `[batch, num_kv_heads, positions, head_dim]`; only `rows` (default: all) and positions `start .. stop - 1`
        (default: all; never before what the layer's window reads) when given. `new`: the forward's own K/V of its
        new positions, put in the last positions read (what stock attends to: the values stored, and the left pads'
        K/V, which are never stored and which only this forward's pad queries see)."""
        if layer_idx not in self.layers_written:
            raise RuntimeError(f"layer {layer_idx} did not write its K/V in this forward")
        self.layers_read.add(layer_idx)
        local = self.groups[self.layout.group_of[layer_idx]].on(storage.device_of(layer_idx))
        first = max(start, self.layout.first_read(layer_idx, self.past_length))
        keys, values = storage.gather(layer_idx, *local.read_index(storage.num_heads(layer_idx), first, stop, rows))
        if new is not None:
            count = new[0].shape[2]
            if storage.stages_keys:  # stored positions as read; only the left pads' K/V (never stored) from `new`
                positions = torch.arange(self.length - count, self.length, device=keys.device)
                pads = positions[None, :] < device_tensor(self.leading_pads, keys.device)[:, None]
                for read, given in zip((keys, values), new):
                    read[:, :, -count:] = torch.where(pads[:, None, :, None], given, read[:, :, -count:])
            else:  # as the pages hold them (quantized pages: what every later read gives back)
                keys[:, :, -count:], values[:, :, -count:] = (storage.format.round_trip(tensor) for tensor in new)
        return keys, values

    def read_in_place(self, layer_idx: int) -> None:
        """Note that `layer_idx`'s attention reads its K/V where they lie (a kernel), not through `read`."""
        if layer_idx not in self.layers_written:
            raise RuntimeError(f"layer {layer_idx} did not write its K/V in this forward")
        self.layers_read.add(layer_idx)

    def kernel_tables(self, layer_idx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(block_tables, seq_lens)` of `layer_idx`'s layer group for a paged-attention kernel: int32
        `[rows, max blocks]` (blocks a window skipped, and the entries past a row's end, name its first live block)
        and int32 `[rows]` tokens of every row after this forward. Built once per forward and group."""
        group = self.layout.group_of[layer_idx]
        key = (group, device)
        if key not in self._kernel_tables:
            tables = [row.tables[group] for row in self.rows]
            blocks, _ = _live_blocks(tables, device, torch.int32)
            lengths = device_tensor([table.num_tokens for table in tables], device, torch.int32)
            self._kernel_tables[key] = blocks, lengths
        return self._kernel_tables[key]

    def in_place_readable(self, attention_mask: torch.Tensor | None, window: int | None) -> bool:
        """Whether a kernel reading each row's tokens `0 .. length - 1` causally (within `window`) attends exactly as
        `attention_mask` (the model's mask of this right-aligned forward, `[batch, 1, num_new, width]` over the last
        `width` padded positions) says: every new position is a real token (no left pad among the queries) and the
        mask hides exactly the left pads, the future and what lies outside the window (no hole, no custom mask).
        Checked once per mask tensor and forward."""
        entry = self._causal_masks.get(id(attention_mask))
        if entry is not None and entry[0] is attention_mask:
            return entry[1]
        readable = self._mask_is_causal(attention_mask, window)
        self._causal_masks[id(attention_mask)] = (attention_mask, readable)  # the reference keeps the id unique
        return readable

    def _mask_is_causal(self, attention_mask: torch.Tensor | None, window: int | None) -> bool:
        if self.packed is not None or min(row.num_tokens for row in self.rows) < self.num_new:
            return False
        pads = self.leading_pads
        if attention_mask is None:
            return not any(pads)
        batch, num_new, length = self.batch_size, self.num_new, self.length
        if attention_mask.dim() != 4 or tuple(attention_mask.shape[:3]) != (batch, 1, num_new):
            return False
        width = attention_mask.shape[-1]
        if width > length:
            return False
        if width < length and min(pads) < length - width and (window is None or width - num_new + 1 < window):
            return False  # positions before the mask's columns would be visible to the kernel
        if attention_mask.dtype == torch.bool:
            visible = attention_mask[:, 0]
        elif attention_mask.is_floating_point():
            visible = attention_mask[:, 0] == 0
            if not bool(((attention_mask == 0) | (attention_mask == torch.finfo(attention_mask.dtype).min)).all()):
                return False
        else:
            return False
        device = attention_mask.device
        keys = torch.arange(length - width, length, device=device)[None, None, :]
        queries = torch.arange(length - num_new, length, device=device)[None, :, None]
        expected = (keys <= queries) & (keys >= device_tensor(pads, device)[:, None, None])
        if window is not None:
            expected &= queries - keys < window
        return torch.equal(visible, expected)

    def key_groups(self, cost: int) -> list[KeyGroup] | None:
        """How the rows of a right-aligned forward split to read their keys (`key_groups.split_by_length`, each
        group from its longest row's first position on), or `None` when one group of all rows reads best."""
        if cost not in self._key_groups:
            lengths = [self.length - pads for pads in self.leading_pads]
            groups = None
            if len(lengths) > 1 and min(lengths) < max(lengths):
                split = split_by_length(lengths, cost)
                if len(split) > 1:
                    device = self.groups[0].slot_map.device
                    groups = [
                        KeyGroup(device_tensor(rows, device), self.length - max(lengths[r] for r in rows))
                        for rows in split
                    ]
            self._key_groups[cost] = groups
        return self._key_groups[cost]

    def is_complete(self, num_layers: int) -> bool:
        """Whether every layer has written (the forward's full blocks can be found by others)."""
        return len(self.layers_written) == num_layers

    def unread_layer(self, next_layer: int | None, num_layers: int) -> int | None:
        """Under `"hf_paged"` attention, the layer that wrote last but did not read its K/V back through the tables
        (its attention saw only the new tokens: the model does not route it through the registered function),
        noticed when `next_layer` writes next (`None`: when the next forward starts); `None` when there is none."""
        last = self.last_layer
        if not self.reads_tables or last is None or last in self.layers_read:
            return None
        unfinished = len(self.layers_written) < num_layers
        if unfinished and (next_layer is None or next_layer in self.layers_written):
            return None  # an unfinished forward is dropped, not a layer that skipped its read
        return last


def _live_blocks(tables: list[BlockTable], device, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, list[int]]:
    """`[rows, max blocks]` block ids of `tables`, every skipped or missing entry replaced by the row's first live
    block (always written, so reading it is safe; the mask hides those positions), and each table's skipped count."""
    num_cols = max(len(t.block_ids) for t in tables)
    skipped = [t.num_skipped for t in tables]
    blocks = device_tensor(
        [
            [t.block_ids[first]] * first + t.block_ids[first:] + [t.block_ids[first]] * (num_cols - len(t.block_ids))
            for t, first in zip(tables, skipped)
        ],
        device,
        dtype,
    )
    return blocks, skipped


def address_tables(
    rows: list[BlockTable],
    leading_pads: list[int],
    block_size: int,
    length: int,
    num_new: int,
    device: torch.device,
    stores: list[int] | None = None,
    writers: list[bool] | None = None,
) -> Addressing:
    """Addressing, computed from one layer group's block tables, for a forward whose stored tokens were just
    appended to `rows` (padded length now `length`).

    Row `i` stores the last `stores[i]` of the forward's `num_new` positions (all of them by default); the positions
    before those are left pads or tokens the row already holds (recomputed, not written again). Rows whose `writers`
    entry is False share the blocks of another row that writes the same tokens (duplicate prompts), so their new
    tokens are not written again."""
    blocks, skipped = _live_blocks(rows, device)
    pads = device_tensor(leading_pads, device, torch.long)
    logical = torch.arange(length, device=device)[None, :] - pads[:, None]
    first_live = device_tensor(skipped, device, torch.long)[:, None] * block_size
    position = torch.maximum(logical, first_live)  # pad and skipped positions read the row's first live slot
    slot_map = blocks.gather(1, position // block_size) * block_size + position % block_size
    write_slots = slot_map[:, length - num_new :].reshape(-1)
    stores = [num_new] * len(rows) if stores is None else stores
    if writers is None and all(count == num_new for count in stores):
        return Addressing(slot_map, write_slots, None)
    first_stored = device_tensor([t.num_tokens - count for t, count in zip(rows, stores)], device)
    stored = logical[:, length - num_new :] >= first_stored[:, None]
    if writers is not None:
        stored &= device_tensor(writers, device)[:, None]
    stored = stored.reshape(-1)
    return Addressing(slot_map, write_slots[stored], stored.nonzero().squeeze(1))


def extend_addressing(previous: Addressing, rows: list[BlockTable], block_size: int, num_new: int) -> Addressing:
    """The previous forward's slot map plus this forward's `num_new` tokens per row, valid when the tables changed
    only by appending (no reorder, truncation, copy-on-write or skipped block since `previous`) and every new token
    is stored."""
    new = [
        [
            t.block_ids[p // block_size] * block_size + p % block_size
            for p in range(t.num_tokens - num_new, t.num_tokens)
        ]
        for t in rows
    ]
    new_slots = device_tensor(new, previous.slot_map.device, torch.long)
    slot_map = torch.cat([previous.slot_map, new_slots], dim=1)
    return Addressing(slot_map, new_slots.reshape(-1), None)


def address_packed(tables: list[BlockTable], counts: list[int], block_size: int, device) -> Addressing:
    """Addressing of a packed forward, from one layer group's block tables, whose rows just appended `counts[i]`
    tokens each: `slot_map[b, p]` is the slot of logical position `p` of row `b` (no left pads; positions past the
    row's end and positions its window skipped name its first live slot, hidden by the mask), and the write slots
    follow the packed order of the new tokens."""
    blocks, skipped = _live_blocks(tables, device)
    length = max(t.num_tokens for t in tables)
    logical = torch.arange(length, device=device)[None, :]
    lengths = device_tensor([t.num_tokens for t in tables], device)
    first_live = device_tensor(skipped, device, torch.long)[:, None] * block_size
    position = torch.where(logical < lengths[:, None], torch.maximum(logical, first_live), first_live)
    slot_map = blocks.gather(1, position // block_size) * block_size + position % block_size
    count_column = device_tensor(counts, device)
    rows = torch.repeat_interleave(torch.arange(len(tables), device=device), count_column)
    ends = torch.repeat_interleave(lengths, count_column)  # every new token's row length ...
    back = torch.repeat_interleave(torch.cumsum(count_column, 0), count_column) - torch.arange(
        rows.numel(), device=device
    )
    written = rows * length + ends - back  # ... minus how far from its row's end it is
    return Addressing(slot_map, slot_map.reshape(-1).index_select(0, written), None)
