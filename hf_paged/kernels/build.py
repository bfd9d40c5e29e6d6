"""Build a kernel's C++ source into a shared library at first use, cached on disk.

Installing hf_paged needs no compiler: a kernel is compiled the first time it is used, with the machine's C++
compiler (`$HF_PAGED_CXX`, else `$CXX`, else `c++`), for this machine's CPU (`-march=native`), into
`$HF_PAGED_KERNEL_CACHE` (default `~/.cache/hf_paged/kernels`). The file name carries a digest of the source, the
flags, the compiler's version and the CPU's feature flags, so a changed source or another machine builds anew and a
cached build is reused at once. Where it cannot be built, `load_library` says why and the caller falls back.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | str] = {}  # source path -> library, or why it could not be built


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded on this machine."""


def cache_dir() -> Path:
    """Where built kernels are kept."""
    return Path(os.environ.get("HF_PAGED_KERNEL_CACHE") or Path.home() / ".cache" / "hf_paged" / "kernels")


def compiler() -> str:
    """The C++ compiler to build with (raises `KernelBuildError` when there is none)."""
    name = os.environ.get("HF_PAGED_CXX") or os.environ.get("CXX") or "c++"
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C++ compiler {name!r} on PATH (set HF_PAGED_CXX to one)")
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"{cxx} --version failed: {error}") from error


def library_path(source: Path, cxx: str, flags: tuple[str, ...] = CXX_FLAGS, depends: tuple[bytes, ...] = ()) -> Path:
    """The cached build of `source` with `flags` for this compiler and CPU (`depends`: whatever else the build
    reads, such as the sources it includes, as bytes)."""
    digest = hashlib.sha256()
    for part in (
        source.read_bytes(),
        *depends,
        " ".join(flags).encode(),
        _compiler_version(cxx).encode(),
        _cpu_flags().encode(),
    ):
        digest.update(part)
    return cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build(
    source: Path, flags: tuple[str, ...] = CXX_FLAGS, depends: tuple[bytes, ...] = (), link: tuple[str, ...] = ()
) -> Path:
    """Compile `source` with `flags` (and `link`, the linker's flags, after the source) unless its cached build
    exists; returns the library's path (raises `KernelBuildError`). `depends`: what else the build reads (included
    sources, the version of the headers), as bytes."""
    cxx = compiler()
    target = library_path(source, cxx, flags + link, depends)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        command = [cxx, *flags, str(source), "-o", str(partial), *link]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelBuildError(f"{' '.join(command)} failed: {error}") from error
        if result.returncode != 0:
            raise KernelBuildError(f"{' '.join(command)} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: concurrent builders leave one complete file
    logger.info("hf_paged: built %s in %.1f s (cached at %s)", source.name, time.perf_counter() - started, target)
    return target


def load_library(source: Path) -> ctypes.CDLL:
    """The library built from `source`, built at first use and loaded once per process (raises
    `KernelBuildError`, the same reason every time, when it cannot be built or loaded)."""
    key = str(source)
    with _lock:
        loaded = _loaded.get(key)
        if loaded is None:
            try:
                loaded = ctypes.CDLL(str(build(source)))
            except (KernelBuildError, OSError) as error:
                loaded = str(error)
            _loaded[key] = loaded
    if isinstance(loaded, str):
        raise KernelBuildError(loaded)
    return loaded


def forget_loaded() -> None:
    """Forget what this process loaded or failed to build (tests)."""
    with _lock:
        _loaded.clear()
