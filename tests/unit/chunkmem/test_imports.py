"""The import graph of ``chunkmem``: no cycles, layers that point down, and no DCP at import.

The graph is read from the source with ``ast``, not from ``sys.modules``: every ``import`` and
``from ... import`` counts, at module level, inside functions (a lazy import hides a cycle from
Python, not from this test) and under ``if TYPE_CHECKING:`` (a type-only import never runs, but a
circle closed through one is still two modules that need each other to be read). A
``from pkg import name`` imports the module ``pkg.name`` when there is one, else ``pkg``; a
package's ``__init__`` is a module. Importing ``a.b.c`` from outside the package ``a.b`` also runs
``a/b/__init__``, so it counts as importing ``a.b`` too (from inside, the package is already being
imported: a sibling import does not run it again).

The layers, lowest first (``LAYERS``; README.md "Layout" draws the same): a package imports only
packages of lower layers, never one of its own layer or above, type-only imports included.

 0. ``chunkmem.compat``: other libraries' internals, named in one place (``test_compat``); nothing of
    chunkmem
 1. ``chunkmem.placement`` (decisions), ``chunkmem.hooks`` (parameter-op hooks): nothing else of chunkmem
    but ``chunkmem.compat``
 2. ``chunkmem.errors`` (the exceptions), ``chunkmem.device`` (the accelerator layer)
 3. ``chunkmem.usage``: the byte ledger, the counters, memory probes
 4. ``chunkmem.ranks``: collectives and cross-rank checks; ``chunkmem.tiers``: host transfers, disk
    files, owned directories
 5. ``chunkmem.chunks``: chunks, their state, this rank's shard in every tier, the manager
 6. ``chunkmem.execution``: the runtime and the executor; ``chunkmem.activations``;
    ``chunkmem.materialize``; ``chunkmem.quantized`` (4-bit bases)
 7. ``chunkmem.boosted``: ``ChunkedModel`` and what it carries
 8. ``chunkmem.optim``: the optimizer side
 9. ``chunkmem.checkpoint``
10. ``chunkmem.plugin``
11. ``chunkmem.booster``; ``chunkmem.planning``
12. ``chunkmem.integrations``; ``chunkmem.plan_command`` (the planner's command line)
13. ``chunkmem`` (its ``__init__``: the public API)
14. ``chunkmem.env`` (the environment report: it reports the public API's ``__version__``)

Every module of chunkmem lives in one of these subpackages; only the public entry points
(``ENTRY_POINTS``) sit at its top level.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.child_env import child_env
from support.paths import ROOT

PACKAGES = ("chunkmem",)


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
    """Module -> the project modules it imports (see the module docstring). A copy of one reading
    of the sources: three tests check the same graph, and parsing every module takes most of each."""
    return {module: set(targets) for module, targets in _read_import_graph().items()}


@functools.cache
def _read_import_graph() -> dict[str, set[str]]:
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
    assert {"chunkmem", "chunkmem.checkpoint", "chunkmem.placement", "chunkmem.hooks"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    for package in ("chunkmem.placement", "chunkmem.hooks"):  # the arrows point one way (layer 1 of LAYERS)
        inside = [m for m in graph if m == package or m.startswith(package + ".")]
        outward = {
            t
            for m in inside
            for t in graph[m]
            if t.startswith("chunkmem") and not t.startswith((package, "chunkmem.compat"))
        }
        assert not outward, f"{package} imports the rest of chunkmem: {sorted(outward)}"


# The layers of the module docstring, lowest first. An entry is a package (all its modules) or a
# module at the top of chunkmem; ``chunkmem`` itself names its ``__init__`` only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("chunkmem.compat",),
    ("chunkmem.placement", "chunkmem.hooks"),
    ("chunkmem.errors", "chunkmem.device"),
    ("chunkmem.usage",),
    ("chunkmem.ranks", "chunkmem.tiers"),
    ("chunkmem.chunks",),
    ("chunkmem.execution", "chunkmem.activations", "chunkmem.materialize", "chunkmem.quantized"),
    ("chunkmem.boosted",),
    ("chunkmem.optim",),
    ("chunkmem.checkpoint",),
    ("chunkmem.plugin",),
    ("chunkmem.booster", "chunkmem.planning"),
    ("chunkmem.integrations", "chunkmem.plan_command"),
    ("chunkmem",),
    ("chunkmem.env",),
)
# The modules at the top of chunkmem: what users import or run; everything else is in a subpackage.
ENTRY_POINTS = {
    "chunkmem",
    "chunkmem.errors",
    "chunkmem.plugin",
    "chunkmem.booster",
    "chunkmem.plan_command",
    "chunkmem.env",
}


def unit_of(module: str, layers: tuple[tuple[str, ...], ...]) -> str | None:
    """The entry of ``layers`` that ``module`` belongs to (the longest that holds it), or ``None``."""
    entries = sorted((entry for layer in layers for entry in layer), key=len, reverse=True)
    for entry in entries:
        # A top-level package's own name stands for its ``__init__`` alone, so that a new module at
        # the top of chunkmem belongs to no layer until it is placed in one.
        if module == entry or (module.startswith(entry + ".") and entry != "chunkmem"):
            return entry
    return None


def layer_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import of ``graph`` that does not point to a lower layer of ``layers`` (within one
    entry, anything goes: a package's modules read each other), and every module in no layer."""
    depth = {entry: index for index, layer in enumerate(layers) for entry in layer}
    out = []
    for module in sorted(graph):
        unit = unit_of(module, layers)
        if unit is None:
            out.append(f"{module} is in no layer: move it into the subpackage of its concern (LAYERS)")
            continue
        for target in sorted(graph[module]):
            target_unit = unit_of(target, layers)
            if target_unit is None or target_unit == unit or depth[target_unit] < depth[unit]:
                continue
            out.append(
                f"{module} (layer {depth[unit]}, {unit}) imports {target} (layer {depth[target_unit]}, "
                f"{target_unit}): a package imports only lower layers"
            )
    return out


def test_the_layer_checker_sees_upward_sideways_and_unplaced_modules() -> None:
    """The checker itself, on a graph written here (not on the project's own code)."""
    layers = (("low",), ("mid.a", "mid.b"), ("top",))
    fine = {"low.x": set(), "mid.a.y": {"low.x", "mid.a"}, "mid.a": set(), "top": {"mid.a.y", "mid.b.z"}}
    assert layer_violations(fine, layers) == []
    upward = {"low.x": {"mid.a.y"}, "mid.a.y": set()}
    sideways = {"mid.a.y": {"mid.b.z"}, "mid.b.z": set()}
    stray = {"elsewhere": set()}
    assert len(layer_violations(upward, layers)) == 1
    assert len(layer_violations(sideways, layers)) == 1
    assert layer_violations(stray, layers) == [
        "elsewhere is in no layer: move it into the subpackage of its concern (LAYERS)"
    ]
    assert unit_of("chunkmem.stray", (("chunkmem",),)) is None


def test_the_packages_import_in_layers() -> None:
    """The layout as drawn in the module docstring: every module in a layer, every import downward."""
    graph = import_graph()
    top = {"chunkmem"} | {
        m
        for m, (_, is_package) in _modules().items()
        if m.startswith("chunkmem.") and m.count(".") == 1 and not is_package
    }
    assert top == ENTRY_POINTS, (
        f"modules at the top of chunkmem that are not entry points: {sorted(top - ENTRY_POINTS)}"
    )
    violations = layer_violations(graph, LAYERS)
    assert not violations, "\n".join(violations)


@pytest.mark.slow  # a fresh interpreter (what an import loads is what is tested): 6-12 s
def test_importing_chunkmem_does_not_load_dcp_or_trainer_libraries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.distributed.checkpoint`` loads with the first sharded save or load, not at import;
    Dynamo (``torch._dynamo``, about two seconds) with the first boost or compile;
    the trainer libraries (optional extras) only with their integration's own module. The child
    gets this checkout's chunkmem and keeps the caller's ``PYTHONPATH``: a dependency found only
    there (pydantic under /tmp/site on the GPU machine) must still import."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "only_on_the_callers_path.py").write_text("")
    callers = (str(tmp_path / "site"), os.environ.get("PYTHONPATH"))  # what it held stays after it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(entry for entry in callers if entry))
    lazy = (
        "torch.distributed.checkpoint",
        "torch._dynamo",
        "transformers",
        "accelerate",
        "lightning",
        "pytorch_lightning",
    )
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
    ("piece", "places", "probe", "loss_scale", "step_config", "host_kernels", "optimizer_state"),
    ("runs",),
    ("stepper",),
    ("early_steps", "disk_sides", "state_ledger", "state_dict"),
    ("scaling",),
    ("optimizer",),
)


def test_the_optimizer_package_imports_in_layers() -> None:
    graph = import_graph()
    package = "chunkmem.optim"
    inside = {m for m in graph if m.startswith(package + ".")}
    layer = {f"{package}.{name}": depth for depth, names in enumerate(OPTIM_LAYERS) for name in names}
    assert inside == set(layer), f"modules of {package} missing from OPTIM_LAYERS: {sorted(inside - set(layer))}"
    for module in sorted(inside):
        upward = sorted(t for t in graph[module] if t in layer and layer[t] >= layer[module])
        assert not upward, f"{module} imports {upward}, not in a lower layer of OPTIM_LAYERS"
        assert package not in graph[module], f"{module} imports its own package's __init__"
    # Which packages may import the optimizer side, and which it may import: LAYERS
    # (test_the_packages_import_in_layers).


@pytest.mark.slow  # a fresh interpreter: what a user's own folder puts first on sys.path is what is tested
def test_a_users_hooks_and_placement_modules_do_not_shadow_chunkmem(tmp_path: Path) -> None:
    """chunkmem installs one top-level name: a ``hooks.py`` and a ``placement/`` package beside the
    user's script (first on ``sys.path``) are the user's, and ``import chunkmem`` does not read them."""
    (tmp_path / "hooks.py").write_text("raise ImportError('the user hooks.py was imported')\n")
    (tmp_path / "placement").mkdir()
    (tmp_path / "placement" / "__init__.py").write_text("raise ImportError('the user placement/ was imported')\n")
    script = tmp_path / "train.py"
    script.write_text("import chunkmem\nfrom chunkmem import AutoPlacementConfig, Booster, ChunkPlugin\nimport hooks\n")
    run = [sys.executable, str(script)]
    result = subprocess.run(run, cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    # chunkmem imported whole; the user's own hooks.py is then the one `import hooks` finds
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "ImportError: the user hooks.py was imported", result.stderr
    assert 'train.py", line 3' in result.stderr, result.stderr
