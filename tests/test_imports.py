"""The import graph of ``chunkmem``, ``placement`` and ``hooks``: no cycles, and no DCP at import.

The graph is read from the source with ``ast``, not from ``sys.modules``: every ``import`` and
``from ... import`` counts, at module level, inside functions (a lazy import hides a cycle from
Python, not from this test) and under ``if TYPE_CHECKING:`` (a type-only import never runs, but a
circle closed through one is still two modules that need each other to be read). A
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

import pytest
from child_env import child_env

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


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``, at any depth, ``if TYPE_CHECKING:`` bodies included."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


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
    assert found == {"typing", "p.q.b", "p.q.c", "p.q.d", "p.e", "x.y"}
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


@pytest.mark.slow  # a fresh interpreter (what an import loads is what is tested): 6-12 s
def test_importing_chunkmem_does_not_load_dcp_or_trainer_libraries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.distributed.checkpoint`` loads with the first sharded save or load, not at import;
    the trainer libraries (optional extras) only with their integration's own module. The child
    gets this checkout's chunkmem and keeps the caller's ``PYTHONPATH``: a dependency found only
    there (pydantic under /tmp/site on the GPU machine) must still import."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "only_on_the_callers_path.py").write_text("")
    callers = (str(tmp_path / "site"), os.environ.get("PYTHONPATH"))  # what it held stays after it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(entry for entry in callers if entry))
    lazy = ("torch.distributed.checkpoint", "transformers", "accelerate", "lightning", "pytorch_lightning")
    code = (
        "import sys, only_on_the_callers_path, chunkmem, chunkmem.integrations; "
        f"print(chunkmem.__file__); print([name for name in {lazy!r} if name in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    where, loaded = result.stdout.strip().splitlines()
    assert Path(where).is_relative_to(ROOT), f"the child imported chunkmem from {where}, not from {ROOT}"
    assert loaded == "[]", f"importing chunkmem loaded {loaded}"


# The optimizer side's layers, lowest first: a module of ``chunkmem.optim`` imports only modules of
# lower layers (type-only imports included), so the package reads bottom-up without a circle.
OPTIM_LAYERS = (
    ("piece", "places", "probe", "loss_scale", "step_config", "host_kernels"),
    ("runs",),
    ("early_steps", "disk_sides", "stepper", "state_ledger", "state_dict"),
    ("scaling",),
    ("optimizer",),
)
# The training front: the only modules outside ``chunkmem.optim`` that import it, and which it
# never imports (it sits on the chunks, the runtime and the tiers, below the front).
FRONT = ("chunkmem", "chunkmem.booster", "chunkmem.plugin", "chunkmem.planning.planner", "chunkmem.checkpoint")
FRONT_PACKAGES = ("chunkmem.checkpoint.", "chunkmem.integrations.")


def _in_front(module: str) -> bool:
    return module in FRONT or module.startswith(FRONT_PACKAGES)


def test_the_optimizer_package_imports_in_layers() -> None:
    graph = import_graph()
    package = "chunkmem.optim"
    inside = {m for m in graph if m.startswith(package + ".")}
    layer = {f"{package}.{name}": depth for depth, names in enumerate(OPTIM_LAYERS) for name in names}
    assert inside == set(layer), f"modules of {package} missing from OPTIM_LAYERS: {sorted(inside - set(layer))}"
    for module in sorted(inside):
        upward = sorted(t for t in graph[module] if t in layer and layer[t] >= layer[module])
        assert not upward, f"{module} imports {upward}, not in a lower layer of OPTIM_LAYERS"
        front = sorted(t for t in graph[module] if _in_front(t) or t == package)
        assert not front, f"{module} imports the training front {front}"
    importers = sorted(
        m
        for m, targets in graph.items()
        if m != package and m not in inside and any(t == package or t in inside for t in targets)
    )
    below = [m for m in importers if not _in_front(m)]
    assert not below, f"modules below the training front import {package}: {below}"
