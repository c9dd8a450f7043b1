"""Sphinx extension: the pages generated from the repository when the docs are built.

- ``_generated/benchmark-results.md``: the tables of ``benchmarks/results/*.json``
  (``benchmark_tables.render``), included by ``benchmarks.md``;
- ``_generated/examples.md``: every ``examples/*.py``, its docstring and its code, included by
  ``examples.md``.

Both are written before Sphinx reads the sources, and only when their text changes (so an
incremental build does not read every page again).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import benchmark_tables

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"


def _write(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def examples_markdown(examples: Path = ROOT / "examples") -> str:
    """A section per example script: its docstring's first paragraph, how to run it, and its code."""
    scripts = sorted(examples.glob("*.py"))
    if not scripts:
        return "No example scripts are in `examples/`.\n"
    out = []
    for script in scripts:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        relative = script.relative_to(ROOT).as_posix()
        out += [f"## `{relative}`", ""]
        if doc:
            out += [doc.split("\n\n")[0].replace("\n", " "), ""]
        out += [f"Run `python {relative} --help` for its options.", ""]
        out += [f"```{{literalinclude}} ../{relative}", ":language: python", "```", ""]
    return "\n".join(out)


def generate(app: Any = None) -> None:
    _write(GENERATED / "benchmark-results.md", benchmark_tables.render())
    _write(GENERATED / "examples.md", examples_markdown())


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
