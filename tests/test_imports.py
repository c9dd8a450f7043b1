"""The import graph of ``chunkmem``, ``placement`` and ``hooks``: no cycles, and no DCP at import.

The graph is read from the source with ``ast``, not from ``sys.modules``: every ``import`` and
``from ... import`` counts, at module level and inside functions (a lazy import hides a cycle from
Python, not from this test), except those under ``if TYPE_CHECKING:``, which never run. A
``from pkg import name`` imports the module ``pkg.name`` when there is one, else ``pkg``; a
package's ``__init__`` is a module. Importing ``a.b.c`` from outside the package ``a.b`` also runs
``a/b/__init__``, so it counts as importing ``a.b`` too (from inside, the package is already being
imported: a sibling import does not run it again).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chunkmem", "placement", "hooks")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the packages: dotted name -> (file, is a package's ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join(parts)] = (path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``, at any depth, skipping ``if TYPE_CHECKING:`` bodies
    (their ``else`` branches run)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _imported(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The project modules one import statement in module ``name`` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.level:
        base = name.split(".")
        if not is_package:
            base.pop()
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    out = set()
    for alias in node.names:
        candidate = f"{source}.{alias.name}"
        out.add(candidate if candidate in known else source)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (see the module docstring)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        own_package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _imported(name, is_package, node, known):
                parts = target.split(".")
                for depth in range(1, len(parts) + 1):
                    ancestor = ".".join(parts[:depth])
                    inside = own_package == ancestor or own_package.startswith(ancestor + ".")
                    if ancestor in known and ancestor != name and (depth == len(parts) or not inside):
                        edges.add(ancestor)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first repeated at the end), or ``None``."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_reader_sees_lazy_relative_and_package_imports() -> None:
    """The graph reader itself, on a module written here (not on the project's own code)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .c import thing\n"
        "if TYPE_CHECKING:\n"
        "    from .d import T\n"
        "def f():\n"
        "    from ..e import g\n"
        "    import x.y\n"
    )
    known = {"p.q", "p.q.a", "p.q.b", "p.q.c", "p.q.d", "p", "p.e"}
    found = set()
    for node in _imports(ast.parse(source)):
        found |= _imported("p.q.a", False, node, known)
    assert found == {"typing", "p.q.b", "p.q.c", "p.e", "x.y"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_packages_import_each_other_without_cycles() -> None:
    graph = import_graph()
    assert {"chunkmem", "chunkmem.checkpoint", "placement", "hooks"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    for package in ("placement", "hooks"):  # the arrows point one way (DESIGN.md)
        outward = {t for m, ts in graph.items() if m.split(".")[0] == package for t in ts if t.startswith("chunkmem")}
        assert not outward, f"{package} imports chunkmem: {sorted(outward)}"


def test_importing_chunkmem_does_not_load_dcp_or_trainer_libraries() -> None:
    """``torch.distributed.checkpoint`` loads with the first sharded save or load, not at import;
    ``transformers`` and ``accelerate`` only with ``chunkmem.integrations.hf`` (the ``hf`` extra)."""
    lazy = ("torch.distributed.checkpoint", "transformers", "accelerate")
    code = f"import sys, chunkmem; print([name for name in {lazy!r} if name in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing chunkmem loaded {result.stdout.strip()}"
