"""Per-forward addressing: which slots a forward's new tokens go to, and where each layer reads its K/V from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .allocator import BlockTable
from .storage import head_rows


@dataclass(frozen=True)
class ForwardInputs:
    """What the forward pre-hook tells the cache about the coming forward."""

    attention_mask: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    reads_tables: bool = False


@dataclass
class Addressing:
    """Where one layer group's new tokens go and where its layers read their K/V from, in one forward.

    `slot_map[b, j]` is the slot (`block_id * block_size + offset`) of padded position `j` of row `b`; left-pad
    positions and positions whose block was released (behind the group's sliding window) name the row's first
    live slot, which the attention mask hides (a sliding layer reads from `first_visible` on, and every query whose
    output is used sees only positions inside its window). `write_slots` are the slots of the new tokens
    that are stored; `write_index` selects them from the flattened `[batch * num_new]` new tokens (`None` when every
    new token is stored).
    """

    slot_map: torch.Tensor
    write_slots: torch.Tensor
    write_index: torch.Tensor | None
    _moved: dict = field(default_factory=dict)
    _head_rows: dict = field(default_factory=dict)

    def head_rows(self, num_heads: int, first: int) -> torch.Tensor:
        """`storage.head_rows` of `slot_map[:, first:]`, computed once per forward for all layers alike."""
        key = (num_heads, first)
        if key not in self._head_rows:
            self._head_rows[key] = head_rows(self.slot_map[:, first:], num_heads)
        return self._head_rows[key]

    def on(self, device: torch.device) -> Addressing:
        """This addressing with its index tensors on `device` (for models whose layers sit on several devices)."""
        if device == self.slot_map.device:
            return self
        if device not in self._moved:
            index = None if self.write_index is None else self.write_index.to(device)
            self._moved[device] = Addressing(self.slot_map.to(device), self.write_slots.to(device), index)
        return self._moved[device]


@dataclass
class ForwardPlan:
    """One forward, planned once for all layers: the `Addressing` of every layer group, and which layers have
    written and read so far."""

    groups: list[Addressing]
    reads_tables: bool
    num_new: int
    layers_written: set[int] = field(default_factory=set)
    layers_read: set[int] = field(default_factory=set)
    last_layer: int | None = None


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
    num_cols = max(len(t.block_ids) for t in rows)
    released = [t.num_released for t in rows]
    blocks = torch.tensor(
        [
            [t.block_ids[dead]] * dead + t.block_ids[dead:] + [t.block_ids[dead]] * (num_cols - len(t.block_ids))
            for t, dead in zip(rows, released)
        ],
        dtype=torch.long,
        device=device,
    )
    pads = torch.tensor(leading_pads, dtype=torch.long, device=device)
    logical = torch.arange(length, device=device)[None, :] - pads[:, None]
    first_live = torch.tensor(released, dtype=torch.long, device=device)[:, None] * block_size
    position = torch.maximum(logical, first_live)  # pad and released positions read the row's first live slot
    slot_map = blocks.gather(1, position // block_size) * block_size + position % block_size
    write_slots = slot_map[:, length - num_new :].reshape(-1)
    stores = [num_new] * len(rows) if stores is None else stores
    if writers is None and all(count == num_new for count in stores):
        return Addressing(slot_map, write_slots, None)
    first_stored = torch.tensor([t.num_tokens - count for t, count in zip(rows, stores)], device=device)
    stored = logical[:, length - num_new :] >= first_stored[:, None]
    if writers is not None:
        stored &= torch.tensor(writers, device=device)[:, None]
    stored = stored.reshape(-1)
    return Addressing(slot_map, write_slots[stored], stored.nonzero().squeeze(1))


def extend_addressing(previous: Addressing, rows: list[BlockTable], block_size: int, num_new: int) -> Addressing:
    """The previous forward's slot map plus this forward's `num_new` tokens per row, valid when the tables changed
    only by appending (no reorder, crop, copy-on-write or released block since `previous`) and every new token is
    stored."""
    new = [
        [
            t.block_ids[p // block_size] * block_size + p % block_size
            for p in range(t.num_tokens - num_new, t.num_tokens)
        ]
        for t in rows
    ]
    new_slots = torch.tensor(new, dtype=torch.long, device=previous.slot_map.device)
    slot_map = torch.cat([previous.slot_map, new_slots], dim=1)
    return Addressing(slot_map, new_slots.reshape(-1), None)


def duplicate_row_leaders(inputs: ForwardInputs, batch: int, num_new: int) -> list[int] | None:
    """For each row, the first row with the same new tokens, mask and positions; `None` when all rows differ or the
    inputs are unknown (e.g. `inputs_embeds`). `generate` repeats every prompt `num_beams` / `num_return_sequences`
    times before prefill: those rows then share one copy of the prompt's blocks."""
    input_ids = inputs.input_ids
    if batch < 2 or input_ids is None or input_ids.dim() != 2 or input_ids.shape != (batch, num_new):
        return None
    parts = [input_ids]
    for extra in (inputs.attention_mask, inputs.position_ids):
        if extra is not None and extra.dim() == 2 and extra.shape[0] == batch:
            parts.append(extra[:, -num_new:].to(input_ids.device, input_ids.dtype))
    keys = torch.cat(parts, dim=1)
    _, group = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), batch, dtype=torch.long, device=group.device)
    first.scatter_reduce_(0, group, torch.arange(batch, device=group.device), reduce="amin")
    leaders = first[group].tolist()
    return None if leaders == list(range(batch)) else leaders
