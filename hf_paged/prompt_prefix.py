"""How a `generate` prompt lines up with what a cache holds: its left padding, its tokens, the prefix they share."""

from __future__ import annotations

import torch

from .rows import Row


def prompt_tokens(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[list[int], list[list[int]]] | None:
    """Every row's left padding and real tokens of a `[batch, length]` prompt; `None` when the mask is not plain
    left padding (a hole in the middle of a row).

    Example:

    ```python
    >>> import torch
    >>> prompt_tokens(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    ([1, 0], [[5, 6], [7, 8, 9]])

    ```
    """
    batch, width = input_ids.shape
    mask = attention_mask if attention_mask is not None and attention_mask.shape == input_ids.shape else None
    pads = [0] * batch if mask is None else (mask.to(torch.int32).cumsum(-1) == 0).sum(-1).tolist()
    if mask is not None and int(mask.sum()) != sum(width - p for p in pads):
        return None
    return pads, [input_ids[row, pads[row] :].tolist() for row in range(batch)]


def prompt_groups(
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    num_rows: int,
    width: int,
    final_length: int,
    expand: int = 1,
) -> list[tuple[int, int, int]]:
    """What a `generate` call on a `[num_rows, width]` left-padded prompt stores, one `(prompt tokens, tokens at the
    end, rows)` per distinct prompt: rows with the same ids and mask share their prompt's blocks, and so do the
    `expand` rows `generate` makes of each (beams, `num_return_sequences`). Every row stores its positions from its
    first real token up to `final_length` (the padded length of the last forward). Without `input_ids` (a prompt of
    embeddings) every row counts as a prompt of its own.

    Example:

    ```python
    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    >>> mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    >>> prompt_groups(ids, mask, num_rows=3, width=3, final_length=10, expand=2)
    [(2, 9, 4), (3, 10, 2)]

    ```
    """
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if mask is not None and mask.shape[0] != num_rows:
        mask = None
    pads = [0] * num_rows if mask is None else (mask.to(torch.int32).cumsum(-1) == 0).sum(-1).tolist()
    pads = [min(pad, width - 1) for pad in pads]  # an empty row is refused on its own, later
    same_ids = input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == num_rows
    groups: dict = {}
    for row in range(num_rows):
        key = row
        if same_ids:
            key = (tuple(input_ids[row].tolist()), None if mask is None else tuple(mask[row].tolist()))
        pad, count = groups.get(key, (pads[row], 0))
        groups[key] = (pad, count + 1)
    return [(width - pad, max(final_length, width) - pad, count * expand) for pad, count in groups.values()]


def common_prompt_length(rows: list[Row], pads: list[int], tokens: list[list[int]], width: int) -> int | None:
    """The padded positions `rows` share with a prompt of `width` positions (`pads` and `tokens` per row), at most
    `width - 1` (`generate` computes the last prompt position); `None` when they cannot be compared (another
    batch size, or rows whose token ids are unknown)."""
    if len(rows) != len(tokens) or any(row.tokens is None for row in rows):
        return None
    common = width - 1
    for row, new_pads, new_tokens in zip(rows, pads, tokens):
        if row.leading_pads != new_pads:
            common = min(common, row.leading_pads, new_pads)
            continue
        same = 0
        for old, new in zip(row.tokens, new_tokens):
            if old != new:
                break
            same += 1
        common = min(common, new_pads + same)
    return common
