"""Every wait in the library, found by reading its code, and a way to remove one.

``wait_sites()`` parses each module of ``chunkmem`` (the device layer aside: it is what waits) and
lists every call of a method named as a wait (``WAITS``), and every such method handed on as a
callable (``self.guard(work.wait)``), each apart: a site is its file, the function it is in
(``Class.method``), which occurrence of that name it is there, and its line.

``without(site)`` makes the function holding the site run with that one call removed: the call
becomes ``None`` (its receiver still evaluated: ``read(x).result()`` still reads), a callable
handed on becomes one that does nothing. The function is compiled again from its source with the
one change and its code object swapped in place (every reference to the function, its methods'
closures included, runs the new code) for the block.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from support.paths import ROOT

LIBRARY = ROOT / "chunkmem"

WAITS = frozenset(
    {
        # a stream, an event, the host
        "wait_stream",
        "wait_event",
        "synchronize",
        "record_stream",
        # the copy protocol's guards and the calls that reach them
        "before_host_read",
        "before_host_write",
        "prepare_host_write",
        "prepare_master_writes",
        # collectives, gathers, futures, threads
        "wait",
        "result",
        "exception",
        "join",
        "shutdown",
        # what waits for work in flight and accounts for it
        "settle",
        "settle_param",
    }
)
"""Method names that wait for (or order after) work in flight."""

# Receivers whose ``join`` / ``exception`` are no waits: strings and paths, loggers.
_NOT_WAITING_RECEIVERS = ("os.path", "log", "logger", "logging")


@dataclass(frozen=True, order=True)
class Site:
    """One call of a wait in the library."""

    path: str  # relative to the library
    function: str  # Class.method, or function, the outermost definition holding the call
    name: str  # the wait's name
    occurrence: int  # 1 for the first call of ``name`` in ``function``, 2 for the second, ...
    line: int
    column: int
    called: bool  # a call (``x.wait()``); else the method handed on (``guard(x.wait)``)
    text: str  # the call as written

    @property
    def label(self) -> str:
        return f"{self.path}: {self.function}: {self.text} #{self.occurrence}"


def _waits_in(node: ast.AST) -> list[tuple[ast.Attribute, bool, ast.AST]]:
    """The wait attributes under ``node``: (attribute, whether it is called, the node to remove)."""
    called: set[int] = set()
    found: list[tuple[ast.Attribute, bool, ast.AST]] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in WAITS:
            called.add(id(sub.func))
            found.append((sub.func, True, sub))
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Attribute)
            and sub.attr in WAITS
            and id(sub) not in called
            and isinstance(sub.ctx, ast.Load)
        ):
            found.append((sub, False, sub))
    return [item for item in found if _waits(item[0])]


def _waits(attribute: ast.Attribute) -> bool:
    receiver = attribute.value
    if isinstance(receiver, ast.Constant):  # "".join(...)
        return False
    text = ast.unparse(receiver)
    return text not in _NOT_WAITING_RECEIVERS


def _definitions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, str | None]]:
    """Module-level functions and methods of module-level classes: (qualified name, node, class)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node, None
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item, node.name


def wait_sites() -> list[Site]:
    """Every wait in the library outside the device layer (see the module docstring)."""
    sites = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = path.relative_to(LIBRARY)
        if relative.parts[0] == "device":
            continue
        tree = ast.parse(path.read_text())
        for qualified, node, _ in _definitions(tree):
            found = sorted(_waits_in(node), key=lambda item: (item[0].lineno, item[0].col_offset))
            counts: dict[str, int] = {}
            for attribute, called, removed in found:
                counts[attribute.attr] = counts.get(attribute.attr, 0) + 1
                sites.append(
                    Site(
                        str(relative),
                        qualified,
                        attribute.attr,
                        counts[attribute.attr],
                        attribute.lineno,
                        attribute.col_offset,
                        called,
                        ast.unparse(removed),
                    )
                )
    return sites


class _Remove(ast.NodeTransformer):
    """Removes the one wait at ``site`` from a copy of its function's definition."""

    def __init__(self, site: Site) -> None:
        self._site = site
        self.done = False

    def _is_site(self, attribute: ast.AST) -> bool:
        return (
            isinstance(attribute, ast.Attribute)
            and attribute.attr == self._site.name
            and attribute.lineno == self._site.line
            and attribute.col_offset == self._site.column
        )

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if self._site.called and self._is_site(node.func):
            self.done = True
            assert isinstance(node.func, ast.Attribute)
            receiver = self.visit(node.func.value)
            # (receiver, None)[1]: the receiver is still evaluated, the wait is not called.
            kept = ast.Subscript(ast.Tuple([receiver, ast.Constant(None)], ast.Load()), ast.Constant(1), ast.Load())
            return ast.copy_location(kept, node)
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if not self._site.called and self._is_site(node):
            self.done = True
            nothing = ast.Lambda(
                ast.arguments([], [], ast.arg("args"), [], [], ast.arg("kwargs"), []), ast.Constant(None)
            )
            return ast.copy_location(nothing, node)
        return self.generic_visit(node)


def _unwrap(value: Any) -> Any:
    """The plain function behind a method, property, static/class method or decorated function."""
    if isinstance(value, property):
        value = value.fget
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    while hasattr(value, "__wrapped__"):
        value = value.__wrapped__
    return value


def _module_of(site: Site) -> Any:
    name = "chunkmem." + site.path.removesuffix(".py").replace("/", ".")
    return importlib.import_module(name.removesuffix(".__init__"))


@functools.cache
def _compiled_without(site: Site) -> tuple[Any, Any]:
    """(the live function holding ``site``, the code of it without the wait)."""
    module = _module_of(site)
    path = LIBRARY / site.path
    tree = ast.parse(path.read_text())
    found = next((d for d in _definitions(tree) if d[0] == site.function), None)
    if found is None:
        raise LookupError(f"{site.label}: no {site.function} in {site.path}")
    _, node, owner = found
    changed = copy.deepcopy(node)
    changed.decorator_list = []
    remover = _Remove(site)
    changed = remover.visit(changed)
    if not remover.done:
        raise LookupError(f"{site.label}: the call is not at line {site.line}")
    body: list[ast.stmt] = [changed]
    if owner is not None:  # compiled inside a class, so that zero-argument super() has its cell
        body = [ast.ClassDef(owner, [], [], body, [])]
    tree_without = ast.fix_missing_locations(ast.Module(body, []))
    namespace: dict[str, Any] = {}
    exec(compile(tree_without, str(path), "exec"), module.__dict__.copy(), namespace)
    made = namespace[owner] if owner is not None else None
    new = _unwrap(made.__dict__[node.name] if made is not None else namespace[node.name])
    live = _unwrap(module.__dict__[owner].__dict__[node.name] if owner is not None else module.__dict__[node.name])
    if live.__code__.co_freevars != new.__code__.co_freevars:
        raise LookupError(f"{site.label}: the function's closure differs once compiled again")
    return live, new.__code__


@contextmanager
def without(site: Site) -> Iterator[None]:
    """The wait at ``site`` does nothing there (everywhere else it waits)."""
    live, code = _compiled_without(site)
    original = live.__code__
    live.__code__ = code
    try:
        yield
    finally:
        live.__code__ = original


def source_line(site: Site) -> str:
    return textwrap.dedent((LIBRARY / site.path).read_text().splitlines()[site.line - 1]).strip()
