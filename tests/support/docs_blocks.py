"""The code blocks of README.md and docs/*.md, and what each page says about running them.

Every fenced code block is one of:

- a ``python`` block: run. The blocks of one page run in order in one process and one namespace
  (a page reads as a session: a later block uses what an earlier one built), in a scratch
  directory of their own;
- a block right after ``<!-- file: NAME -->``: written to ``NAME`` in that directory before the
  python blocks after it run (a config file the page then loads);
- a block right after ``<!-- not-run: REASON -->``: not run, for the reason given (a launch on
  several ranks, a GPU, an install, a program's output);
- README's block after ``<!-- test-command -->``: the test command ``.ci/run`` runs.

Anything else is an error: a block in another language that says nothing, a marker without a
reason. A page may hold setup that readers do not need to see, in an HTML comment that starts
with ``<!-- setup`` (python, run before the blocks after it), and ``<!-- snippets: slow -->``
leaves its blocks to the full suite. Directive fences (```` ```{directive} ````) are Sphinx's, not
code blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from support.paths import ROOT

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
MARKER = re.compile(r"^\s*<!--\s*(not-run|file|test-command)\s*(?::\s*(.*?))?\s*-->\s*$")
SLOW = "<!-- snippets: slow -->"
SETUP = "<!-- setup"

__all__ = ["FRONT_DOOR", "ROOT", "Block", "Page", "doc_pages", "error_classes", "read_page"]

# What the user guide may import from ``chunkmem`` (with the error classes: ``error_classes``).
FRONT_DOOR = frozenset(
    {
        *["Booster", "ChunkPlugin", "ChunkedModel", "ChunkOptimizer", "StaticPlacementConfig", "AutoPlacementConfig"],
        *["PlacementConfig", "load_placement_config", "ActivationPlacement", "BlockPlacement", "LossScaleConfig"],
        "CompileBlocks",
        *["StepAfterBackward", "StepDuringBackward", "Stats", "plan", "Plan", "StepCounters", "checkpoint"],
        "__version__",
    }
)


def error_classes() -> list[type]:
    """Every exception class ``chunkmem.errors`` defines: ``ChunkmemError`` and its subclasses."""
    import chunkmem.errors as errors

    found = [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, Exception)]
    return [cls for cls in found if cls.__module__ == errors.__name__ and issubclass(cls, errors.ChunkmemError)]


@dataclass(frozen=True)
class Block:
    """One code block: ``kind`` is ``run``, ``setup``, ``file``, ``not-run`` or ``test-command``."""

    path: Path
    line: int  # of the block's first line of code, 1-based
    language: str
    text: str
    kind: str
    note: str  # the reason of a not-run block, the name of a file block

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Page:
    path: Path
    blocks: tuple[Block, ...]
    slow: bool
    problems: tuple[str, ...]  # blocks that are neither run nor marked, markers without a reason

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def doc_pages() -> list[Path]:
    """README.md and every Markdown page of the manual (not the build's output or generated pages)."""
    docs = ROOT / "docs"
    pages = [p for p in sorted(docs.rglob("*.md")) if not {"_build", "_generated"} & set(p.relative_to(docs).parts)]
    return [ROOT / "README.md", *pages]


def _marker_before(lines: list[str], index: int) -> str | None:
    """The line right before line ``index`` (blank lines skipped), if it is an HTML comment."""
    j = index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j >= 0 and lines[j].strip().startswith("<!--") and lines[j].strip().endswith("-->"):
        return lines[j]
    return None


def read_page(path: Path) -> Page:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith(SETUP) and not line.strip().endswith("-->"):
            end = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "-->")
            blocks.append(Block(path, i + 2, "python", "\n".join(lines[i + 1 : end]), "setup", ""))
            i = end + 1
            continue
        fence = FENCE.match(line)
        if not fence:
            i += 1
            continue
        indent, ticks, language = fence.groups()
        end = next(k for k in range(i + 1, len(lines)) if lines[k].strip().startswith(ticks[0] * len(ticks)))
        body = "\n".join(text[len(indent) :] if text.startswith(indent) else text for text in lines[i + 1 : end])
        where = f"{path.relative_to(ROOT)}:{i + 2}"
        if language.startswith("{"):  # a Sphinx directive, not a code block
            i = end + 1
            continue
        marker = _marker_before(lines, i)
        found = MARKER.match(marker) if marker else None
        if found:
            kind, note = found.group(1), (found.group(2) or "").strip()
            if kind in ("not-run", "file") and len(note) < 3:
                problems.append(f"{where}: `<!-- {kind}: ... -->` needs a {'reason' if kind == 'not-run' else 'name'}")
            if kind == "test-command" and path.name != "README.md":
                problems.append(f"{where}: only README.md has the test command")
            blocks.append(Block(path, i + 2, language, body, kind, note))
        elif language == "python":
            blocks.append(Block(path, i + 2, language, body, "run", ""))
        else:
            problems.append(
                f"{where}: a ```{language or '(no language)'} block that is neither run nor marked "
                "(`<!-- not-run: why -->` or `<!-- file: name -->` before it)"
            )
        i = end + 1
    return Page(path, tuple(blocks), SLOW in "\n".join(lines), tuple(problems))
