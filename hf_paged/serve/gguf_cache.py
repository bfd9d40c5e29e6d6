"""GGUF files converted once: the de-quantized model is saved in a user cache directory, keyed by the file's content
hash, so the next start loads a plain safetensors folder instead of converting again."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".hf_paged-complete"


def cache_root() -> Path:
    """`$HF_PAGED_CACHE`, else `$XDG_CACHE_HOME/hf_paged`, else `~/.cache/hf_paged`."""
    if os.environ.get("HF_PAGED_CACHE"):
        return Path(os.environ["HF_PAGED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hf_paged"


def file_digest(path: str | os.PathLike, chunk_bytes: int = 2**22) -> str:
    """The SHA-256 of a file's content, hex.

    Example:

    ```python
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "x"
    >>> _ = path.write_bytes(b"abc")
    >>> file_digest(path)[:16]
    'ba7816bf8f01cfea'

    ```
    """
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(model_path: str, gguf_file: str, target: Path) -> None:
    """De-quantize `gguf_file` (inside `model_path`) to an fp32 model and tokenizer saved in `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(model_path, gguf_file=gguf_file, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights are plain fp32 now
    model.hf_quantizer = None
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def converted_gguf(
    model_path: str,
    gguf_file: str,
    cache_dir: str | os.PathLike | None = None,
    convert: Callable[[str, str, Path], None] = convert_gguf,
) -> Path:
    """The folder holding `gguf_file` (in `model_path`) converted by `convert`: taken from
    `cache_dir/gguf/<sha256 of the file>` when an earlier start made it, else converted there first (in a staging
    folder renamed into place, so an interrupted conversion is never used). The folder gets the permissions the
    umask gives a new directory.

    Raises:
        FileNotFoundError: `model_path/gguf_file` is not a local file.
    """
    source = Path(model_path) / gguf_file
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file {source} not found")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / "gguf" / file_digest(source)
    if (target / COMPLETE_MARKER).exists():
        logger.info("hf_paged: using the converted copy of %s in %s", source, target)
        return target
    logger.info("hf_paged: converting %s once; the result is cached in %s", source, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        convert(model_path, gguf_file, staging)
        (staging / COMPLETE_MARKER).write_text(f"{source.name}\n")
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; a cache folder gets the usual mode
        try:
            staging.rename(target)
        except OSError:  # another process finished first, or an incomplete folder is in the way
            if not (target / COMPLETE_MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
