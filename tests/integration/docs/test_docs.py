"""The manual's promises that a reader relies on: every error class is explained on the
troubleshooting page and documented in the API reference, the front door is documented, the
benchmarks page shows a figure only with its date, machine and command, and the README stays a
front door (short, every result dated, with its machine and command)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support.docs_blocks import FRONT_DOOR, ROOT, error_classes

sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import benchmark_tables
import chunkmem_docs
import test_map

DOCS = ROOT / "docs"


def _sections(page: Path, level: str = "###") -> dict[str, str]:
    """Each ``level`` heading of ``page`` and the text under it, up to the next heading."""
    out: dict[str, str] = {}
    name = None
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            name = line[len(level) :].strip() if line.startswith(level + " ") else None
            if name:
                out[name] = ""
        elif name:
            out[name] += line + "\n"
    return out


def test_every_error_class_is_explained_on_the_troubleshooting_page() -> None:
    classes = error_classes()
    assert len(classes) >= 20, [c.__name__ for c in classes]  # the hierarchy as it is, not an empty list
    sections = _sections(DOCS / "troubleshooting.md")
    missing = [c.__name__ for c in classes if c.__name__ not in sections]
    assert not missing, f"docs/troubleshooting.md has no '### Name' section for {missing}"
    for cls in classes:
        text = sections[cls.__name__]
        assert "**Means:**" in text and "**Do:**" in text, f"{cls.__name__}: say what it means and what to do"


def _documented() -> set[str]:
    """The ``chunkmem.NAME`` objects docs/api.md documents (autodoc directives and ``py:data``)."""
    text = (DOCS / "api.md").read_text()
    return set(re.findall(r"^\.\. (?:auto\w+|py:data):: chunkmem\.(\w+)\s*$", text, flags=re.MULTILINE))


def test_the_api_reference_documents_the_front_door_and_every_error() -> None:
    import chunkmem

    documented = _documented()
    wanted = (FRONT_DOOR - {"__version__"}) | {c.__name__ for c in error_classes()}
    assert wanted <= documented, f"docs/api.md does not document {sorted(wanted - documented)}"
    assert all(hasattr(chunkmem, name) for name in documented), sorted(
        n for n in documented if not hasattr(chunkmem, n)
    )


def _payload(**overrides: object) -> dict[str, object]:
    payload: dict[str, object] = {
        "meta": {
            "date": "2026-11-30T10:00:00+00:00",
            "command": "python benchmarks/memory_budget.py --steps 4",
            "machine": {"cpu": "x86_64", "cpu_count": 2, "host_memory_bytes": 24 * 2**30, "torch": "2.13.0"},
            "load": {"before": [0.5, 0.25, 0.125], "after": [1.5, 1.0, 0.5]},
        },
        "summary_table": {
            "headers": ["policy", "step (s)"],
            "rows": [["auto", 0.25], ["static", None]],
            "note": "Random tokens.",
        },
    }
    payload.update(overrides)
    return payload


def test_a_benchmark_table_carries_its_date_machine_load_and_command(tmp_path: Path) -> None:
    (tmp_path / "memory_budget.json").write_text(json.dumps(_payload()))
    out = benchmark_tables.render(tmp_path)
    assert "| policy | step (s) |" in out and "| auto | 0.25 |" in out and "| static | - |" in out
    assert "2026-11-30T10:00:00+00:00" in out
    assert "2 CPU cores (x86_64), 24.0 GiB of RAM, torch 2.13.0" in out
    assert "before 0.50 / 0.25 / 0.12; after 1.50 / 1.00 / 0.50" in out
    assert "`python benchmarks/memory_budget.py --steps 4`" in out
    assert "Random tokens." in out and "Not published" not in out


@pytest.mark.parametrize(
    ("payload", "missing"),
    [
        ({"summary_table": _payload()["summary_table"]}, "no `meta` block"),
        (_payload(meta={"date": "2026-11-30", "machine": {"cpu_count": 2}}), "its `meta` lacks `command`"),
        (_payload(summary_table={"rows": []}), "no `summary_table`"),
    ],
)
def test_a_benchmark_file_without_date_machine_or_command_is_not_published(
    tmp_path: Path, payload: dict[str, object], missing: str
) -> None:
    (tmp_path / "peers.json").write_text(json.dumps(payload))
    (tmp_path / "overhead.json").write_text(json.dumps(_payload()))
    out = benchmark_tables.render(tmp_path)
    assert "`benchmarks/results/peers.json`: " + missing in out
    assert out.count("- **Command:**") == 1  # only the complete file's table is shown
    published = out.split("### Not published")[0]
    assert "peers.json" not in published


def test_no_committed_results_says_so(tmp_path: Path) -> None:
    assert benchmark_tables.render(tmp_path) == benchmark_tables.NO_RESULTS + "\n"


def test_the_examples_page_shows_every_example() -> None:
    text = chunkmem_docs.examples_markdown()
    scripts = sorted((ROOT / "examples").glob("*.py"))
    assert scripts, "examples/ has scripts"
    for script in scripts:
        assert f"{{literalinclude}} ../examples/{script.name}" in text, script.name


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines: move detail into docs/"
    start = lines.index("## Results")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    rows = [line for line in lines[start:end] if line.startswith("| ") and not line.startswith("| result")]
    assert rows, "the README has a results table"
    for row in rows:
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", row) and "`python " in row, f"a result without date or command: {row}"


def test_the_test_map_finds_each_way_of_importing_a_module_by_name(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(
        "import chunkmem\nimport chunkmem.tiers.owned_dir\nfrom chunkmem.placement import auto\n"
    )
    (tmp_path / "test_b.py").write_text(
        "def test_x():\n    from chunkmem.usage.saved import KeptTensor\n    from chunkmem import Booster\n"
    )
    (tmp_path / "helper.py").write_text("import chunkmem.ranks.where\n")  # not a test module
    rows = {
        line.split(" | ")[0].strip("| `"): line.split(" | ")[1]
        for line in test_map.render(tmp_path).splitlines()
        if line.startswith("| `")
    }
    assert set(rows) == {
        "chunkmem.tiers.owned_dir",
        "chunkmem.placement",
        "chunkmem.placement.auto",
        "chunkmem.usage.saved",
    }
    folder = tmp_path.name
    assert rows["chunkmem.placement.auto"] == f"`{folder}/test_a.py` |", rows
    assert rows["chunkmem.usage.saved"] == f"`{folder}/test_b.py` |", rows
