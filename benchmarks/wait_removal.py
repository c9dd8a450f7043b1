"""Every wait of the library removed alone, and what the simulated device says of each run.

The waits are those the AST scan of ``tests/support/simulated_waits.py`` finds (every call of a
wait-like method in ``chunkmem`` outside the device layer, each call site apart). For each one that
``tests/support/simulated_device_helpers.py`` says a scenario needs (``CATCHES``), the function
holding it is compiled again without that one call, and the scenario runs on the simulated asynchronous device
``--runs`` times (at one rank or two, as the scenario is). A run counts as caught only when the
happens-before checker raised (``SimulatedDeviceError``): numbers that differ from the synchronous
run's, or another exception, are not the checker's verdict and count as missed. The waits the scan
finds that order nothing (``NOT_ORDERING``) are listed with why.

    python benchmarks/wait_removal.py                       # every wait, five runs each
    python benchmarks/wait_removal.py --runs 1 --only ranks/comm.py

Exits 1 when some removal was not caught by the checker in every run. Writes
``wait_removal.json`` (the table, each run's verdict per rank) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("CHUNKMEM_CHECK_PLANS", "1")

from benchmarks.common import RESULTS, begin_run, write_json  # noqa: E402

_CHECKER = "checker: "
_PREFIX = "simulated device: "


def _verdict(found: list[str | None]) -> str | None:
    """The checker's message on the first rank it raised on (``None``: no rank's checker raised)."""
    for said in found:
        if said is not None and said.startswith(_CHECKER):
            return said.removeprefix(_CHECKER).removeprefix(_PREFIX)
    return None


def _markdown(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each removal (default 5)")
    parser.add_argument("--only", default="", help="only the waits whose label contains this text")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where wait_removal.json goes")
    args = parser.parse_args(argv)
    record = begin_run(__file__, argv)

    import torch

    torch.set_num_threads(1)
    from support.simulated import SCENARIOS, caught_on_every_rank
    from support.simulated_device_helpers import CATCHES, NOT_ORDERING, sites

    entries: list[dict[str, Any]] = []
    rows: list[list[Any]] = []
    for label, name in CATCHES.items():
        if args.only not in label:
            continue
        site = sites()[label]
        began = time.perf_counter()
        runs = [caught_on_every_rank(site, name) for _ in range(args.runs)]
        seconds = time.perf_counter() - began
        verdicts = [_verdict(found) for found in runs]
        caught = sum(v is not None for v in verdicts)
        message = next((v for v in verdicts if v is not None), None)
        world_size = SCENARIOS[name].world_size
        entries.append(
            {
                "label": label,
                "file": site.path,
                "line": site.line,
                "function": site.function,
                "call": site.text,
                "scenario": name,
                "world_size": world_size,
                "caught_by_checker": caught,
                "runs": args.runs,
                "seconds": round(seconds, 1),
                "message": message,
                "each_run": runs,
            }
        )
        rows.append(
            [
                f"`{site.text}`",
                f"`{site.path}:{site.line}` {site.function}",
                f"{name} (W={world_size})",
                f"{caught}/{args.runs}",
                message if message is not None else f"missed: {runs[0]}",
            ]
        )
        record.sample()
        print(f"{caught}/{args.runs}  {label}  [{name}, {seconds:.0f} s]", flush=True)

    headers = ["wait", "where", "scenario", "caught by the checker", "the checker's message (first run caught)"]
    note = (
        f"Each wait the AST scan of the library finds, removed alone (its call compiled out of its function), "
        f"and the simulated scenario that needs it, run {args.runs} times: a run counts only when the "
        f"happens-before checker raised, not when numbers differed. {len(NOT_ORDERING)} more calls the scan "
        "finds order nothing a run's data needs (timing, accounting, a failure's report, no caller); "
        "tests/support/simulated_device_helpers.py says why for each."
    )
    write_json(
        "wait_removal",
        {
            "runs": args.runs,
            "waits": entries,
            "not_ordering": NOT_ORDERING if not args.only else {},
            "summary_table": {"headers": headers, "rows": rows, "note": note},
        },
        args.out_dir,
    )
    print()
    print(_markdown(headers, rows))
    missed = [e["label"] for e in entries if e["caught_by_checker"] < e["runs"]]
    if missed:
        print("\nnot caught by the checker in every run:\n  " + "\n  ".join(missed), file=sys.stderr)
    return 1 if missed or not entries else 0


if __name__ == "__main__":
    sys.exit(main())
