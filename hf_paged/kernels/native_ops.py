"""The CPU kernel as the CPU implementation of the ops `hf_paged::paged_attention`, `write_kv`,
`paged_attention_quantized` and `write_kv_quantized`.

`kernels.ops` implements every op in Python: on the CPU, `paged_attention` fills the kernel's parameters and calls
it through ctypes, ~30 µs of Python a call around a kernel that takes ~10 µs for a short decode row, and the
quantized ops add ~50-85 µs of Python and torch calls each. A compiled step calls an attention and a write once per
layer, so at batch 1 that Python is several percent of the step. `load()` builds `csrc/paged_ops_cpu.cpp` (the same
kernel source with torch's headers, at first use, cached like every kernel: `kernels.build`) and registers it with
torch's dispatcher as the ops' CPU implementation: a compiled graph's call then reaches the kernel without Python
(inductor's C++ host code calls the dispatcher directly). The calls the kernel does not take (another backend
named, a dtype it does not read, `"auto"` with a row of more queries than `AUTO_CPU_MAX_QUERIES`) go on to the
op's Python implementation (`hf_paged::paged_attention_any`, ...); where it computes, it runs the Python
implementation's torch operations in the same order and the same kernel with the same parameters, so results are
bit-equal either way. Where it cannot be built, the Python implementation stays (one log line says why).

Example:

```python
>>> from hf_paged.kernels import native_ops
>>> native_ops.load()   # builds at first use (20-30 s), then loads the cached build
True
>>> native_ops.loaded()
True

```
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from pathlib import Path

import torch

from . import cpu, ops  # noqa: F401  (ops: the schemas the library implements must be defined first)
from .build import KernelBuildError, build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_ops_cpu.cpp"
DISABLE_VARIABLE = "HF_PAGED_NATIVE_OPS"

_lock = threading.Lock()
_state: bool | str | None = None  # True: loaded; a string: why not; None: not tried


def _torch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compiler's and the linker's flags for a library against this torch's headers and libraries."""
    from torch.utils import cpp_extension

    includes = tuple(f"-I{path}" for path in cpp_extension.include_paths())
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = (
        "-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
    )  # fmt: skip
    libraries = cpp_extension.library_paths()
    link = (*(f"-L{path}" for path in libraries), "-lc10", "-ltorch_cpu", *(f"-Wl,-rpath,{p}" for p in libraries))
    return flags, link


def load() -> bool:
    """Build (at first use) and register the CPU implementations; whether they are registered. Idempotent and
    thread-safe; a failure is logged once and remembered (the Python implementation stays). `HF_PAGED_NATIVE_OPS=0`
    in the environment keeps the Python implementation."""
    global _state
    if _state is not None:  # decided (every compiled step asks)
        return _state is True
    with _lock:
        if _state is None:
            if os.environ.get(DISABLE_VARIABLE, "1") == "0":
                _state = f"{DISABLE_VARIABLE}=0"
                logger.info("hf_paged: compiled steps call the CPU kernel through Python (%s)", _state)
            else:
                _state = _load()
                if _state is not True:
                    logger.warning("hf_paged: compiled steps call the CPU kernel through Python: %s", _state)
    return _state is True


def loaded() -> bool:
    """Whether the CPU implementations are registered in this process."""
    return _state is True


def _load() -> bool | str:
    try:
        cpu.library()  # the kernel itself builds here (the same source): nothing to register where it cannot
        flags, link = _torch_flags()
        depends = (cpu.SOURCE.read_bytes(), torch.__version__.encode(), str(torch.version.git_version).encode())
        path = build(SOURCE, flags, depends, link)
        torch.ops.load_library(str(path))
    except (KernelBuildError, OSError, RuntimeError) as error:
        return f"the CPU kernel's torch ops could not be built or loaded ({error})"
    return True


@contextlib.contextmanager
def python_implementation():
    """Within the block, the ops' CPU implementation is the Python one (the C++ one, loaded first where it builds,
    is restored after): to compare the two in one process (benchmarks, tests). Not thread-safe: no other thread
    should run the ops meanwhile."""
    if not load():
        yield
        return
    library = torch.library.Library("hf_paged", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        for name in ("paged_attention", "write_kv", "paged_attention_quantized", "write_kv_quantized"):
            library.impl(name, ops.PYTHON_IMPLEMENTATIONS[name], "CPU")
    try:
        yield
    finally:
        library._destroy()  # the C++ kernels registered before are the CPU ones again
