"""Memory sizes as users write them (bytes, or a number with a unit: `"512MiB"`, `"2 GB"`) and as hf_paged prints
them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_MEMORY_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: int | str, name: str = "max_memory") -> int:
    """Bytes from an int or a string such as `"512MiB"`, `"2 GB"` or `"1.5GiB"`.

    Example:

    ```python
    >>> parse_memory("512MiB"), parse_memory("2GB"), parse_memory(4096)
    (536870912, 2000000000, 4096)

    ```
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int (bytes) or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        match = _MEMORY_PATTERN.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a memory size; use bytes or a number with one of the units "
                f"{sorted(u for u in _UNITS if u)} (e.g. '512MiB')"
            )
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(f"{name} must be an int (bytes) or a string like '512MiB', got {type(value).__name__}")
    if number <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return number


def format_bytes(num_bytes: int) -> str:
    """`num_bytes` in the largest binary unit it reaches, one decimal.

    Example:

    ```python
    >>> format_bytes(3 * 2**29), format_bytes(2048), format_bytes(12)
    ('1.5 GiB', '2.0 KiB', '12 B')

    ```
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
