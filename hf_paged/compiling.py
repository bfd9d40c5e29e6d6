"""Helpers shared by hf_paged's compiled forwards (the Engine's steps, `generate`'s decode): the errors that mean
"no compiler works here", a one-line description of them, per-caller code objects, Dynamo's graph counter, and the
check that every layer of a model attends through the step attention."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import types

import torch

logger = logging.getLogger(__name__)

COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError)
# what the first, eager step of a compiled forward may raise for a model the step attention cannot serve
FIRST_STEP_ERRORS = (RuntimeError, NotImplementedError, TypeError)


def cpp_compiler_unavailable() -> str | None:
    """Why inductor cannot build CPU kernels here (its own search finds no C++ compiler), or `None` when it can."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as error:  # InvalidCxxCompiler, or a broken toolchain setting
        return f"inductor finds no C++ compiler ({describe_error(error)})"
    return None


def describe_error(error: BaseException) -> str:
    """`error` and the errors that caused it, each as `Type: first line of its message`, outermost first."""
    parts = []
    while error is not None and len(parts) < 4:
        lines = str(error).strip().splitlines()
        parts.append(f"{type(error).__name__}: {lines[0][:200] if lines else ''}".rstrip(": "))
        error = error.__cause__ or getattr(error, "inner_exception", None)  # BackendCompilerFailed keeps it there
    return " <- ".join(parts)


def fresh_function(function):
    """A copy of `function` with a code object of its own: Dynamo keeps compiled graphs (and its recompile limit)
    per code object, so each caller's graphs stay its own however many models or engines a process builds."""
    return types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__, function.__defaults__
    )


def unique_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def counting_graphs(owner, what: str):
    """Around a compiled call of `owner` (which has `graphs` and `compile_s`): the graphs it compiled are added to
    `owner.graphs`, the call's seconds to `owner.compile_s` when it compiled any, in one INFO line naming `what`.

    Python's cyclic garbage collector is off during the call: Dynamo traces the model's forward hooks and then builds
    guards that look each of them up again, and a collection in between could run a finalizer that removes hooks (an
    `AdapterSet` of an engine dropped in a reference cycle), failing the call (`IndexError` in guard building)."""
    graphs, start = unique_graphs(), time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
    new = unique_graphs() - graphs
    if new:
        elapsed = time.perf_counter() - start
        owner.graphs += new
        owner.compile_s += elapsed
        logger.info("hf_paged: compiled %s in %.1f s (graph %d)", what, elapsed, owner.graphs)


def unattended_layers(model, calls: list[int], num_layers: int) -> str | None:
    """Why a compiled step cannot serve `model`, whose layers attended `calls` (layer indices, in a step run eagerly
    under the step attention): `None` when each of its `num_layers` layers attended exactly once (a layer that did
    not would have stored nothing)."""
    if sorted(calls) == list(range(num_layers)):
        return None
    return (
        f"{type(model).__name__}'s attention ran for layers {sorted(calls)} instead of each of its {num_layers} layers "
        "once (it does not route every layer through the registered attention)"
    )
