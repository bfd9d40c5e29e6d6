"""One block as bytes: its tensors in safetensors format, its key in the metadata, and a checksum over the whole.

`MAGIC` (8 bytes) + blake2b digest of the rest (16 bytes) + a safetensors file whose metadata names the block's key
and the on-disk format. `decode` returns the tensors only when every part checks out: the magic, the digest (a
truncated or flipped file fails it), the safetensors header, and the key (an entry stored under another key).

Example:

```python
>>> import torch
>>> data = encode("ab12", {"k.0": torch.ones(2, 3)})
>>> decode("ab12", data)["k.0"].shape
torch.Size([2, 3])
>>> decode("ffff", data)
Traceback (most recent call last):
...
hf_paged.offload.codec.CorruptBlockError: the entry stored under ffff holds block ab12
```
"""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import load, save

FORMAT = "hf_paged-kv/1"
MAGIC = b"HFPGKV01"
_DIGEST = 16


class CorruptBlockError(ValueError):
    """An entry that cannot be served: truncated, altered, of another format, or stored under another key."""


def encode(key: str, tensors: dict[str, torch.Tensor]) -> bytes:
    body = save(tensors, metadata={"key": key, "format": FORMAT})
    return MAGIC + _digest(body) + body


def decode(key: str, data: bytes) -> dict[str, torch.Tensor]:
    if len(data) < len(MAGIC) + _DIGEST or data[: len(MAGIC)] != MAGIC:
        raise CorruptBlockError(f"the entry stored under {key} is not an hf_paged block ({len(data)} bytes)")
    body = data[len(MAGIC) + _DIGEST :]
    if _digest(body) != data[len(MAGIC) : len(MAGIC) + _DIGEST]:
        raise CorruptBlockError(f"the entry stored under {key} fails its checksum (truncated or altered)")
    try:
        metadata = _metadata(body)
        tensors = load(body)
    except Exception as error:  # a header that passed the checksum but does not parse: written by something else
        raise CorruptBlockError(f"the entry stored under {key} does not parse: {error}") from error
    if metadata.get("format") != FORMAT:
        raise CorruptBlockError(f"the entry stored under {key} has format {metadata.get('format')!r}, not {FORMAT}")
    if metadata.get("key") != key:
        raise CorruptBlockError(f"the entry stored under {key} holds block {metadata.get('key')}")
    return tensors


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_DIGEST, person=b"hf_paged-kvfile").digest()


def _metadata(body: bytes) -> dict:
    import json

    header_size = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + header_size]).get("__metadata__", {})
