"""No import cycles between hf_paged's modules, lazy imports inside functions included (imports under
`if TYPE_CHECKING:` never run and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_paged

PACKAGE = Path(hf_paged.__file__).parent


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(root: Path, path: Path) -> set[str]:
    """Every module name `path` imports (and `module.attribute` for `from module import attribute`, which may name
    a submodule), at any depth of the file."""
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    type_checking_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_checking_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    imports = {module_name(root, path): imported_names(root, path) for path in root.rglob("*.py")}
    return {module: {m for m in names if m in imports and m != module} for module, names in imports.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_hf_paged_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert "hf_paged.cache" in graph and "hf_paged.engine.engine" in graph  # the walk found the modules
    assert import_cycles(graph) == []


def test_the_engine_does_not_import_the_generate_glue():
    graph = import_graph(PACKAGE)
    reachable, frontier = set(), ["hf_paged.engine.engine"]
    while frontier:
        for target in graph[frontier.pop()] - reachable:
            reachable.add(target)
            frontier.append(target)
    assert "hf_paged.generation" not in reachable


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    """Negative control: a synthetic package whose cycle closes through an import inside a function, beside one
    that only type checkers see."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("def thing():\n    from .sub import c\n    return c\n")
    (package / "sub" / "c.py").write_text("from ..a import x\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import y\n")
    (package / "e.py").write_text("from .d import z\n")
    assert import_cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_the_public_surface_is_what_users_call():
    """`hf_paged.__all__`: the cache, the pool and its allocator, the options, the Engine, the errors, pictures, the
    switch and the compiled decode's counters; plumbing stays in its module."""
    assert sorted(hf_paged.__all__) == sorted(
        [
            *("PagedCache", "CacheStats", "PagedCacheConfig"),
            *("BlockPool", "get_pool", "release_pool", "live_pools", "BlockAllocator", "BlockTable", "AllocatorStats"),
            *("Engine", "EngineStats", "RequestOutput", "SamplingParams"),
            *("PoolExhaustedError", "RequestTooLargeError", "InvariantError"),
            *("render_pool_text", "plot_pool"),
            *("enable", "disable", "is_enabled"),
            "compiled_decode_of",  # the counters of compiled paged generate
        ]
    )
    assert all(hasattr(hf_paged, name) for name in hf_paged.__all__)
    assert not hasattr(hf_paged, "KVStorage") and not hasattr(hf_paged, "bind_paged_cache")
