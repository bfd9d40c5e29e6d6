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
