"""The map from chunkmem's modules to the tests that import them by name, written into the
development page at build time: where to look for a module's tests (and which modules have none
that names them, being tested only through the front door)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def library_modules(package: Path = ROOT / "chunkmem") -> list[str]:
    """Every module of chunkmem, dotted (a package by its ``__init__``)."""
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The chunkmem modules that ``source`` imports by name: ``import chunkmem.a.b``, ``from
    chunkmem.a.b import c`` and ``from chunkmem.a import b`` where ``b`` is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            found.add(node.module)
            found.update(name for alias in node.names if (name := f"{node.module}.{alias.name}") in modules)
    found.discard("chunkmem")  # the front door: every test reaches it
    return found


def render(tests: Path = ROOT / "tests") -> str:
    modules = library_modules()
    wanted = set(modules)
    users: dict[str, list[str]] = {module: [] for module in modules}
    for path in sorted(tests.rglob("test_*.py")):
        for module in imported_modules(path.read_text(), wanted):
            users[module].append(path.relative_to(tests.parent).as_posix())
    named = [m for m in modules if m != "chunkmem" and users[m]]
    unnamed = [m for m in modules if m != "chunkmem" and not users[m]]
    out = [
        f"{len(named)} of {len(modules) - 1} modules are imported by name in a test module; the others "
        "are tested through what imports them (the front door, `chunkmem`, is left out: every test uses it).",
        "",
        "| module | tests that import it |",
        "|---|---|",
    ]
    out += [f"| `{m}` | {', '.join(f'`{t}`' for t in users[m])} |" for m in named]
    out += ["", "Imported by no test by name:", ""]
    out += [", ".join(f"`{m}`" for m in unnamed) or "none", ""]
    return "\n".join(out)
