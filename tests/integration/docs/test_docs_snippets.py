"""Every code block of README.md and docs/ runs, or says why it does not (``docs_blocks``).

The python blocks of a page run in order, in one process forked from the tests' server (torch,
transformers and chunkmem already imported, as a user's script would import them) with a scratch
directory as its working directory; a failure names the page and the line of the block. Pages
marked ``<!-- snippets: slow -->`` (trainer libraries, several steps) run in the full suite only.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import pytest
from support.docs_blocks import FRONT_DOOR, ROOT, Page, doc_pages, error_classes, read_page
from support.forked import run_script
from support.models import reference_device

PAGES = [read_page(path) for path in doc_pages()]
RUNNABLE = [p for p in PAGES if any(b.kind in ("run", "setup") for b in p.blocks)]

# Besides the front door, the user guide imports the integrations' modules and the errors' module.
INTEGRATIONS = {"chunkmem.integrations.hf", "chunkmem.integrations.lightning", "chunkmem.errors"}
# Used by the guide though not (yet) in the front door: the marker for a model's repeated layers.
BEYOND_THE_FRONT_DOOR = {"chunkmem.placement": {"RepeatedBlocks"}}
# Pages about chunkmem's insides, which may import anything.
INSIDE = {"docs/design.md", "docs/development.md"}

_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    blocks = json.loads(Path(sys.argv[1]).read_text())
    os.chdir(sys.argv[2])
    namespace = {"__name__": "__main__"}
    for kind, where, line, text in blocks:
        if kind == "file":
            Path(where).write_text(text + "\\n")
            continue
        page = where.rsplit(":", 1)[0]
        # The block's lines keep their numbers in the page, so a traceback names the page's line.
        exec(compile("\\n" * (line - 1) + text, page, "exec"), namespace)
    """
)


def test_every_block_is_run_or_says_why_not() -> None:
    problems = [problem for page in PAGES for problem in page.problems]
    assert not problems, "\n".join(problems)
    assert {p.name for p in PAGES} >= {"README.md", "docs/index.md", "docs/getting-started.md"}


def test_the_readme_keeps_the_test_command_ci_runs() -> None:
    readme = next(p for p in PAGES if p.name == "README.md")
    commands = [b for b in readme.blocks if b.kind == "test-command"]
    assert [b.text for b in commands] == ["python -m pytest -q -n 2"]
    # .ci/run reads the line two after the marker (the fence, then the command): keep them adjacent.
    lines = (ROOT / "README.md").read_text().splitlines()
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash" and lines[at + 2] == "python -m pytest -q -n 2"


def _imports(text: str) -> list[tuple[str, set[str]]]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, {a.name for a in node.names}))
        elif isinstance(node, ast.Import):
            found += [(a.name, set()) for a in node.names]
    return found


def test_the_guide_imports_only_the_front_door_and_the_integrations() -> None:
    import chunkmem

    front_door = FRONT_DOOR | {cls.__name__ for cls in error_classes()}
    wrong = []
    for page in PAGES:
        if page.name in INSIDE:
            continue
        for block in page.blocks:
            if block.language != "python":
                continue
            try:
                imports = _imports(block.text)
            except SyntaxError:
                continue  # a not-run fragment
            for module, names in imports:
                if module == "chunkmem":
                    wrong += [f"{block.where}: chunkmem.{n} is not in the front door" for n in names - front_door]
                    wrong += [f"{block.where}: chunkmem has no {n}" for n in names if not hasattr(chunkmem, n)]
                elif module.startswith("chunkmem.") and module not in INTEGRATIONS:
                    extra = names - BEYOND_THE_FRONT_DOOR.get(module, set())
                    if extra or not names:
                        wrong.append(f"{block.where}: imports {sorted(extra)} from {module}, an internal module")
    assert not wrong, "\n".join(wrong)


def test_the_readme_quickstart_imports_only_from_chunkmem() -> None:
    readme = next(p for p in PAGES if p.name == "README.md")
    (quickstart,) = [b for b in readme.blocks if b.kind == "run"]
    modules = {module for module, _ in _imports(quickstart.text)}
    assert {m for m in modules if m.startswith("chunkmem")} == {"chunkmem"}, modules
    assert modules <= {"chunkmem", "torch", "copy"}, modules


def _run_page(page: Page, tmp_path: Path) -> str:
    blocks = [
        [b.kind, b.note if b.kind == "file" else b.where, b.line, b.text]
        for b in page.blocks
        if b.kind in ("run", "setup", "file")
    ]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    done = run_script(_DRIVER, str(spec), str(work), timeout=240.0)
    assert done.returncode == 0, f"{page.name}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.mark.parametrize(
    "page", [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.slow else []) for p in RUNNABLE]
)
def test_the_page_runs(page: Page, tmp_path: Path) -> None:
    out = _run_page(page, tmp_path)
    if page.name == "README.md" and reference_device().type == "cpu":
        # The quick start's promise on a CPU: chunkmem's loss is plain PyTorch's, to the bit.
        steps = re.findall(r"^step \d+: chunkmem (\S+), plain PyTorch (\S+)$", out, flags=re.MULTILINE)
        assert len(steps) == 3 and all(ours == plain for ours, plain in steps), out


def test_python_blocks_not_run_are_still_python() -> None:
    """A block marked not-run (a multi-rank launch, a GPU) is still checked as far as it can be: it parses."""
    broken = []
    for page in PAGES:
        for block in page.blocks:
            if block.language == "python" and block.kind == "not-run":
                try:
                    ast.parse(block.text)
                except SyntaxError as error:
                    broken.append(f"{block.where}: {error}")
    assert not broken, "\n".join(broken)
