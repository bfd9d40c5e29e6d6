"""Layer groups: which decoder layers share one block table per row, and where each layer's K/V sits in a block."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .support import ATTENTION_LAYER_KINDS, layer_configs, layer_kinds

logger = logging.getLogger(__name__)


def skipped_tokens(num_tokens: int, window: int | None) -> int:
    """Leading tokens of a row of `num_tokens` that a sliding window of `window` skips from the row's next token on
    (it attends to the last `window - 1` and itself); the newest token is never skipped, so its block always stays.
    0 for full attention (`window=None`). The one definition of "skipped": giving blocks back, prefix lookups and the
    positions a sliding layer reads all use it.

    Example:

    ```python
    >>> skipped_tokens(10, 4), skipped_tokens(3, 4), skipped_tokens(10, None)
    (7, 0, 0)

    ```
    """
    if window is None:
        return 0
    return max(0, min(num_tokens - window + 1, num_tokens - 1))


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers whose K/V follow one block table per row.

    Attributes:
        layers (`tuple[int, ...]`): the layers, in model order.
        window (`int | None`): the window by which the group's rows skip blocks: the widest sliding window of its
            layers, `None` when the group keeps every block (full attention). A row gives back the blocks its window
            skipped during generation.
    """

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class KVLayout:
    """How a model's decoder layers map onto the pool's blocks.

    A model whose layers all attend alike (all full, or all sliding) has one group: a block holds K and V of its
    tokens for every layer, and one table per row addresses them. A hybrid model (full and sliding-window layers,
    e.g. Gemma2/3) splits its layers into groups of one kind each, every group `lanes_per_block` layers wide, with
    a block table per group per row: the blocks of a sliding group fall out of its window and go back to the pool
    while the full groups keep theirs. All groups draw from the same pool; a block holds `lanes_per_block` layers
    of K/V for the group that owns it (layer `l` uses lane `lane_of[l]`), so memory moves freely between groups.
    Groups are `min(number of full layers, number of sliding layers)` wide; the last group of a kind may be
    narrower (its blocks leave the unused lanes empty). Full groups come first.

    Attributes:
        groups (`tuple[LayerGroup, ...]`): the groups; a row holds one table per group, in this order.
        lanes_per_block (`int`): layers of K/V one block holds.
        group_of (`tuple[int, ...]`): the group of every layer.
        lane_of (`tuple[int, ...]`): the lane (place inside its group's blocks) of every layer.
        layer_windows (`tuple[int | None, ...]`): the attention window of every layer (`None`: full attention).

    Example:

    ```python
    >>> layout = KVLayout.for_windows([6, 6, None, 6, 6, None])  # Gemma3-style: two sliding layers, one full
    >>> [(group.layers, group.window) for group in layout.groups], layout.lanes_per_block
    ([((2, 5), None), ((0, 1), 6), ((3, 4), 6)], 2)
    >>> layout.group_of, layout.lane_of
    ((1, 1, 0, 2, 2, 0), (0, 1, 0, 0, 1, 1))
    >>> KVLayout.for_windows([None, None]).groups
    (LayerGroup(layers=(0, 1), window=None),)

    ```
    """

    groups: tuple[LayerGroup, ...]
    lanes_per_block: int
    group_of: tuple[int, ...]
    lane_of: tuple[int, ...]
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def for_windows(cls, windows: list[int | None], split: bool = True) -> KVLayout:
        """The layout for layers with these sliding windows (`None`: full attention); `split=False` keeps one group
        (every block holds every layer; blocks of a hybrid model are then never skipped)."""
        full = tuple(i for i, window in enumerate(windows) if window is None)
        sliding = tuple(i for i, window in enumerate(windows) if window is not None)
        widest = max((windows[i] for i in sliding), default=None)
        everything = tuple(range(len(windows)))
        if not full or not sliding:
            return cls._of((LayerGroup(everything, None if full else widest),), len(windows), windows)
        if not split:
            return cls._of((LayerGroup(everything, None),), len(windows), windows)
        width = min(len(full), len(sliding))
        groups = [LayerGroup(full[i : i + width], None) for i in range(0, len(full), width)]
        groups += [LayerGroup(sliding[i : i + width], widest) for i in range(0, len(sliding), width)]
        return cls._of(tuple(groups), width, windows)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> KVLayout:
        """The layout of `model`'s decoder layers. A hybrid model keeps one group (its sliding layers keep every
        block) when its layers run on several devices, or when its layers differ in KV heads or head size (e.g.
        Gemma4's wider full-attention layers): a lane is one tensor, on one device, of one shape."""
        text_config = model.config.get_text_config(decoder=True)
        windows = layer_windows(model, text_config)
        devices = _execution_devices(model)
        shapes = set(layer_kv_shapes(text_config))
        split = len(devices) <= 1 and len(shapes) == 1
        if not split and None in windows and any(w is not None for w in windows):
            logger.info(
                "hf_paged: %s runs on %s with KV shapes %s; its sliding-window layers keep every block (one block "
                "table per row)",
                type(model).__name__,
                sorted(devices) or "one device",
                sorted(shapes),
            )
        return cls.for_windows(windows, split=split)

    @classmethod
    def _of(cls, groups: tuple[LayerGroup, ...], lanes_per_block: int, windows: list[int | None]) -> KVLayout:
        num_layers = sum(len(group.layers) for group in groups)
        group_of, lane_of = [0] * num_layers, [0] * num_layers
        for index, group in enumerate(groups):
            for lane, layer in enumerate(group.layers):
                group_of[layer], lane_of[layer] = index, lane
        return cls(groups, lanes_per_block, tuple(group_of), tuple(lane_of), tuple(windows))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> list[int | None]:
        """The window by which every group skips blocks (`None`: the group keeps its blocks)."""
        return [group.window for group in self.groups]

    @property
    def skip_window(self) -> int | None:
        """The widest window of the groups that skip blocks; `None` when every group keeps its blocks."""
        return max((window for window in self.windows if window is not None), default=None)

    def with_skip_window(self, window: int | None) -> KVLayout:
        """This layout with every group whose layers all slide skipping blocks by `window` instead (`None`: every
        group keeps its blocks, e.g. to measure what skipping saves). Attention windows are unchanged.

        Example:

        ```python
        >>> KVLayout.for_windows([6, None]).with_skip_window(None).windows
        [None, None]

        ```
        """
        groups = tuple(LayerGroup(group.layers, window if self._all_slide(group) else None) for group in self.groups)
        return KVLayout(groups, self.lanes_per_block, self.group_of, self.lane_of, self.layer_windows)

    def _all_slide(self, group: LayerGroup) -> bool:
        return all(self.layer_windows[layer] is not None for layer in group.layers)

    def first_read(self, layer_idx: int, past_length: int) -> int:
        """The first of `past_length` cached padded positions that layer `layer_idx` reads: the tokens before it are
        skipped by the layer's sliding window (0 for full attention)."""
        return skipped_tokens(past_length, self.layer_windows[layer_idx])


def layer_kv_shapes(text_config) -> list[tuple[int, int]]:
    """`(num_kv_heads, head_dim)` of every decoder layer; a heterogeneous config (transformers' `per_layer_config`,
    e.g. Gemma4's full-attention layers) sets them layer by layer.

    Example:

    ```python
    >>> from transformers import LlamaConfig
    >>> layer_kv_shapes(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    [(2, 16), (2, 16)]

    ```
    """
    shapes = []
    for config in layer_configs(text_config, text_config.num_hidden_layers):
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        shapes.append((num_kv_heads, head_dim))
    return shapes


def _execution_devices(model: torch.nn.Module) -> set[str]:
    """Devices the model's layers compute on, from accelerate's `hf_device_map` (offloaded layers compute on the
    CPU); empty for a model that was not dispatched."""
    device_map = getattr(model, "hf_device_map", None) or {}
    devices = set()
    for device in device_map.values():
        name = str(device)
        devices.add("cpu" if name in ("cpu", "disk") else name)
    return devices


def layer_windows(model: torch.nn.Module, text_config) -> list[int | None]:
    """The sliding window of each decoder layer (`None` for full attention); other layer kinds are refused. A
    heterogeneous config (transformers' `per_layer_config`) may set the window layer by layer."""
    layer_types = layer_kinds(text_config)
    windows = [getattr(config, "sliding_window", None) for config in layer_configs(text_config, len(layer_types))]
    unsupported = sorted({t for t in layer_types if t not in ATTENTION_LAYER_KINDS})
    if unsupported:
        raise NotImplementedError(
            f"{type(model).__name__} has {unsupported} layers; PagedCache serves full and sliding-window attention"
        )
    return [window if kind == "sliding_attention" else None for kind, window in zip(layer_types, windows)]
