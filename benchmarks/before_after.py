"""Two versions of chunkmem in one run: ``peers.py`` (chunkmem against FSDP2 at two ranks) and
``overhead.py`` (chunkmem against plain PyTorch at one rank), each version's own scripts run from
its own checkout with its own ``chunkmem`` first on the path (checked), the versions alternating
round by round.

A change that should not touch speed (a refactor) is measured by this: each round runs both
versions back to back, the order rotating, so slow spells of a noisy machine fall on both. The
figures compared are the ratios each run measured against its own peer (FSDP2's step, plain
PyTorch's step in the same process), so the machine's drift between runs cancels as well; the
medians over rounds and their spread (lowest to highest) are printed, and the after/before ratio of
the medians.

    git worktree add --detach ../before <commit>   # the version before the change
    python benchmarks/before_after.py --before ../before --after . --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, median, print_table, rotated, write_json

# What each benchmark's run is asked, and which of its figures is compared.
_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "peers": ("peers.py", "--systems", "fsdp2,chunkmem", "--world-size", "2", "--rounds", "1"),
    "overhead": ("overhead.py",),
}


def _figures(benchmark: str, out_dir: Path) -> dict[str, float]:
    """The figures one run of ``benchmark`` wrote to ``out_dir``: chunkmem's step time and its ratio
    to the peer measured in the same run."""
    if benchmark == "peers":
        results = {r["system"]: r for r in json.loads((out_dir / "peers_w2.json").read_text())["results"]}
        chunked = results["chunkmem"]
        if chunked["state"] != "ok" or results["fsdp2"]["state"] != "ok":
            raise RuntimeError(f"peers.py: a system did not finish: {chunked['state']}, {results['fsdp2']['state']}")
        return {"step_s": chunked["median_s"], "ratio": chunked["vs"]["fsdp2"]}
    payload = json.loads((out_dir / "overhead.json").read_text())
    return {"step_s": payload["median_ms"]["static"] / 1000, "ratio": payload["ratio_to_plain"]["static"]}


def _chunkmem_of(tree: Path) -> str:
    """Where ``import chunkmem`` resolves with ``tree`` first on the path (checked, so that an
    installed chunkmem cannot stand in for the version asked)."""
    done = subprocess.run(
        [sys.executable, "-c", "import chunkmem; print(chunkmem.__file__)"],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    found = Path(done.stdout.strip()).resolve()
    if not found.is_relative_to(tree):
        raise SystemExit(f"{tree}: `import chunkmem` resolves to {found}, not this tree's; is it a chunkmem checkout?")
    return str(found)


def _commit_of(tree: Path) -> str | None:
    """The commit ``tree`` has checked out (None where it is not a git checkout)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _run_once(tree: Path, benchmark: str, extra: list[str]) -> dict[str, float]:
    script, *args = _BENCHMARKS[benchmark]
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(tree / "benchmarks" / script), *args, *extra, "--out-dir", out]
        done = subprocess.run(
            command, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"{shlex.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        return _figures(benchmark, Path(out))


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def summarize(runs: dict[str, dict[str, list[dict[str, float]]]], rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The table (headers, rows, note) and the medians of ``runs``: per benchmark, each version's
    figures over its rounds."""
    peer = {"peers": "FSDP2 (W=2)", "overhead": "plain (W=1)"}
    rows: list[list[Any]] = []
    summary: dict[str, Any] = {}
    for benchmark, by_version in runs.items():
        ratios = {name: [r["ratio"] for r in by_version[name]] for name in by_version}
        steps = {name: [r["step_s"] for r in by_version[name]] for name in by_version}
        change = median(ratios["after"]) / median(ratios["before"])
        summary[benchmark] = {"after_over_before": change}
        for name in by_version:
            summary[benchmark][name] = {"ratio_median": median(ratios[name]), "step_s_median": median(steps[name])}
            rows.append(
                [
                    benchmark,
                    name,
                    f"{median(steps[name]):.3f}",
                    _spread(steps[name]),
                    f"{median(ratios[name]):.3f}x",
                    _spread(ratios[name]),
                    peer[benchmark],
                    f"{change:.3f}" if name == "after" else "",
                ]
            )
    headers = ["benchmark", "version", "chunkmem step s", "spread", "vs peer", "spread", "peer", "after/before"]
    note = (
        f"{rounds} rounds, the two versions alternating (order rotating); medians over rounds, spread lowest to "
        "highest; 'vs peer' is chunkmem's step against the peer's measured in the same run, 'after/before' the "
        "ratio of those medians. Each script's own defaults but for the arguments the command passes it."
    )
    return {"headers": headers, "rows": rows, "note": note}, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the version before")
    parser.add_argument("--after", type=Path, required=True, help="a checkout of the version after")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--benchmarks", default="peers,overhead", help="comma separated: peers, overhead")
    parser.add_argument("--peers-args", default="--steps 6", help="passed to each peers.py run")
    parser.add_argument("--overhead-args", default="--steps 10", help="passed to each overhead.py run")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    begin_run(__file__, argv)
    benchmarks = [b for b in args.benchmarks.split(",") if b]
    unknown = sorted(set(benchmarks) - set(_BENCHMARKS))
    if unknown or not benchmarks:
        parser.error(f"--benchmarks: {unknown or 'none'}; choose from {sorted(_BENCHMARKS)}")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    where = {name: _chunkmem_of(tree) for name, tree in trees.items()}
    extra = {"peers": shlex.split(args.peers_args), "overhead": shlex.split(args.overhead_args)}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {b: {"before": [], "after": []} for b in benchmarks}
    for i in range(args.rounds):
        for name in rotated(list(trees), i):
            for benchmark in benchmarks:
                runs[benchmark][name].append(_run_once(trees[name], benchmark, extra[benchmark]))
        print(f"  round {i + 1}/{args.rounds} done", flush=True)

    table, summary = summarize(runs, args.rounds)
    print(f"{args.rounds} rounds, versions alternating; before: {trees['before']}, after: {trees['after']}")
    print_table(table["headers"], table["rows"])
    path = write_json(
        "before_after",
        {
            "trees": {n: str(t) for n, t in trees.items()},
            "chunkmem": where,
            "commits": {n: _commit_of(t) for n, t in trees.items()},
            "runs": runs,
            "summary": summary,
            "summary_table": table,
        },
        args.out_dir,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
