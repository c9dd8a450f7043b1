"""The benchmarks page's tables, generated from the committed ``benchmarks/results/*.json``.

Every benchmark script writes its JSON through ``benchmarks.common.write_json``, with a ``meta``
block (when it ran, the command, the machine and its load average before and after) and a
``summary_table`` (headers, rows and a note). This module turns each such file into a section of
Markdown: the table, and under it the date, the machine, the load and the command. A file without
them is listed as not published, saying what it lacks: a figure without its date, machine and
command is not shown.

    python docs/_ext/benchmark_tables.py [RESULTS_DIR]    # prints the Markdown

The docs build (``chunkmem_docs``) writes it to ``docs/_generated/benchmark-results.md``, which
``docs/benchmarks.md`` includes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# A heading per known script; others are titled by their file name.
TITLES = {
    "memory_budget": "The main job: GPT-2 under shrinking device budgets",
    "peers": "Step time against DDP, FSDP2 and DeepSpeed ZeRO-3",
    "overhead": "Overhead against plain PyTorch at one rank",
    "offload": "The offloaded step, phase by phase",
    "disk_tier": "How large a model trains on one host: the disk tier",
    "lora": "LoRA over a base on disk",
    "activations": "The longest sequence per activation placement",
    "meta_boost_memory": "Host memory while building and boosting",
    "collectives": "Collectives alone",
    "chunk_search": "The chunk-size search",
    "wait_removal": "Every wait removed alone, on the simulated device",
    "walks": "How far an op, a gradient and a load travel through the code",
    "compile_w1": "torch.compile per block at one rank",
    "compile_w2": "torch.compile per block at two ranks, against FSDP2",
    "qlora": "QLoRA: a 4-bit base on disk",
    "dpo": "DPO: a policy and its reference under one budget",
    "before_after": "Two versions in one run: speed before and after a change",
}

NO_RESULTS = (
    "No benchmark results are committed yet. Each script in `benchmarks/` writes its JSON to "
    "`benchmarks/results/` (`python benchmarks/memory_budget.py` writes `memory_budget.json`); "
    "committed there, it appears on this page at the next docs build."
)


@dataclass(frozen=True)
class Section:
    """One results file: its Markdown, or why it is not published."""

    name: str
    markdown: str | None
    missing: str | None


def _cell(value: Any) -> str:
    text = "-" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: Sequence[Any], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = list(row) + [None] * (len(headers) - len(row))
        lines.append("| " + " | ".join(_cell(c) for c in cells[: len(headers)]) + " |")
    return "\n".join(lines)


def _gib(value: Any) -> str:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, int | float) else "?"


def describe_machine(machine: Mapping[str, Any]) -> str:
    """``machine()``'s dict (benchmarks/common.py) in one line."""
    parts = []
    if machine.get("gpu"):
        count = machine.get("gpu_count") or 1
        parts.append(f"{count} x {machine['gpu']}")
    cpu = machine.get("cpu") or "CPU"
    if machine.get("cpu_count"):
        parts.append(f"{machine['cpu_count']} CPU cores ({cpu})")
    else:
        parts.append(str(cpu))
    if machine.get("host_memory_bytes"):
        parts.append(f"{_gib(machine['host_memory_bytes'])} of RAM")
    if machine.get("threads"):
        parts.append(f"{machine['threads']} torch threads")
    versions = [f"{k} {machine[k]}" for k in ("torch", "python") if machine.get(k)]
    return ", ".join(parts + versions)


def _load(load: Any) -> str | None:
    if not isinstance(load, Mapping):
        return None
    said = []
    for when in ("before", "after"):
        values = load.get(when)
        if isinstance(values, Sequence) and len(values) == 3:
            said.append(f"{when} {' / '.join(f'{v:.2f}' for v in values)}")
    return "; ".join(said) or None


def what_is_missing(payload: Mapping[str, Any]) -> str | None:
    """Why a results file cannot be published (``None``: it can)."""
    meta = payload.get("meta")
    if not isinstance(meta, Mapping):
        return "no `meta` block (date, command, machine)"
    lacks = [key for key in ("date", "command", "machine") if not meta.get(key)]
    if lacks:
        return "its `meta` lacks " + ", ".join(f"`{key}`" for key in lacks)
    table = payload.get("summary_table")
    if not isinstance(table, Mapping) or not table.get("headers") or not isinstance(table.get("rows"), list):
        return "no `summary_table` (headers and rows)"
    return None


def section(name: str, payload: Mapping[str, Any]) -> Section:
    """The Markdown for results file ``name`` (its stem)."""
    missing = what_is_missing(payload)
    if missing is not None:
        return Section(name, None, missing)
    meta, table = payload["meta"], payload["summary_table"]
    lines = [f"### {TITLES.get(name, name)}", "", _table(table["headers"], table["rows"]), ""]
    if table.get("note"):
        lines += [str(table["note"]), ""]
    lines.append(f"- **Date:** {meta['date']}")
    lines.append(f"- **Machine:** {describe_machine(meta['machine'])}")
    load = _load(meta.get("load"))
    if load:
        lines.append(f"- **Load average** (1, 5, 15 min): {load}")
    lines.append(f"- **Command:** `{meta['command']}`")
    lines.append(f"- **File:** `benchmarks/results/{name}.json`")
    return Section(name, "\n".join(lines) + "\n", None)


def render(results: Path = RESULTS) -> str:
    """The Markdown of every results file in ``results``, then those not published."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    if not files:
        return NO_RESULTS + "\n"
    sections = []
    for path in files:
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            sections.append(Section(path.stem, None, f"unreadable ({error})"))
            continue
        if not isinstance(payload, Mapping):
            sections.append(Section(path.stem, None, "not a JSON object"))
            continue
        sections.append(section(path.stem, payload))
    out = [s.markdown for s in sections if s.markdown]
    if not out:
        out.append(
            NO_RESULTS.replace("No benchmark results are committed yet", "No committed result is publishable yet")
        )
    unpublished = [s for s in sections if s.markdown is None]
    if unpublished:
        out.append("### Not published\n\nThese files lack what a published figure needs:\n")
        out.append("\n".join(f"- `benchmarks/results/{s.name}.json`: {s.missing}" for s in unpublished) + "\n")
    return "\n".join(out)


def render_one(name: str, results: Path = RESULTS) -> str:
    """The Markdown of results file ``name`` alone (for a page that shows one table), or why it is
    not shown."""
    path = results / f"{name}.json"
    if not path.is_file():
        return f"`benchmarks/results/{name}.json` is not committed yet: run `python benchmarks/{name}.py`.\n"
    shown = section(name, json.loads(path.read_text()))
    return shown.markdown or f"`benchmarks/results/{name}.json` is not published: {shown.missing}.\n"


if __name__ == "__main__":
    print(render(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS), end="")
