"""How large a model trains on this host: chunkmem with its disk tier, against chunkmem with
everything in host memory and FSDP2 with ``CPUOffloadPolicy``.

Each system trains a LLaMA-shaped model (transformers, fp32, ``AdamW(amsgrad=True)``: 12 bytes of
optimizer state a parameter) for a few steps at two sizes, each in a fresh process whose peak
resident set is read from the kernel (forked from a server that only imported torch, transformers
and chunkmem: it starts in under a second, and its peak is its own, where a subprocess's
``ru_maxrss`` starts at its parent's size, as fork comes before exec). The two points give each
system's host bytes per parameter (the slope) and its working set (the intercept); the largest
model per system is what fits in ``--ram`` at that rate. With ``--verify HIDDENxLAYERS`` chunkmem's
disk tier then trains that size for real (a model larger than RAM allows otherwise), reporting each
step's disk traffic, the achieved bandwidth and the peak resident set, beside the disk's sequential
bandwidth measured by ``dd`` in the same run.

    python benchmarks/disk_tier.py                                   # two small sizes a system
    python benchmarks/disk_tier.py --verify 3072x29 --host-budget 15GiB --chunk-size 18883840

The disk tier keeps in host memory only what gathers read (here the fp32 master: fp32 compute,
as this CPU's bf16 matrix products are two orders of magnitude slower); optimizer states and
gradient shards live in ``--disk-dir``. Prints a table, writes JSON and a plot to
``benchmarks/results/``. In the verify table, "over the step" is the step's disk bytes over its wall
time; "a thread" is bytes over the seconds the I/O threads spent in reads or writes (writes land in
the page cache first, so they can exceed ``dd``'s direct-I/O figure).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, fmt_bytes, machine, parse_bytes, print_table, pyplot, write_json
from benchmarks.workers import run_in_fresh_process

SYSTEMS = ("chunkmem-disk", "chunkmem-ram", "fsdp2-offload")


def _config(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=max(64, hidden * 8 // 3 // 64 * 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
    )


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _trial(spec: dict[str, Any]) -> dict[str, Any]:
    """One system at one size, in this (fresh) process."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(spec["threads"])
    config = _config(spec["hidden"], spec["layers"], spec["vocab"])
    ids = torch.randint(0, spec["vocab"], (1, spec["seq"]), generator=torch.Generator().manual_seed(1))
    baseline = _rss()
    torch.manual_seed(0)
    steps: list[dict[str, Any]] = []
    if spec["system"] == "fsdp2-offload":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = LlamaForCausalLM(config)
        policy = CPUOffloadPolicy(pin_memory=False)  # no accelerator to pin for
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, amsgrad=True)
        parameters = sum(p.numel() for p in model.parameters())
        for _ in range(spec["steps"]):
            begin = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"seconds": time.perf_counter() - begin})
        dist.destroy_process_group()
    else:
        from chunkmem import Booster, ChunkPlugin
        from chunkmem.placement import StaticPlacementConfig

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        parameters = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, amsgrad=True)
        on_disk = spec["system"] == "chunkmem-disk"
        placement = StaticPlacementConfig(
            offload_optim_frac=1.0,
            offload_param_frac=1.0,
            offload_disk_frac=1.0 if on_disk else 0.0,
            device_budget=spec["device_budget"],
            host_budget=spec["host_budget"] if on_disk else None,
            max_prefetch=1,
        )
        plugin = ChunkPlugin(
            placement=placement,
            precision="fp32",
            chunk_size=spec["chunk_size"],
            disk_dir=spec["disk_dir"] if on_disk else None,
        )
        booster = Booster(plugin)
        chunked, optimizer, *_ = booster.boost(model, optimizer)
        for _ in range(spec["steps"]):
            before = chunked.stats()
            begin = time.perf_counter()
            booster.backward(chunked(input_ids=ids, labels=ids).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            after = chunked.stats()
            steps.append(
                {
                    "seconds": time.perf_counter() - begin,
                    "disk_read_bytes": after.disk_read_bytes - before.disk_read_bytes,
                    "disk_write_bytes": after.disk_write_bytes - before.disk_write_bytes,
                    "disk_read_seconds": after.disk_read_seconds - before.disk_read_seconds,
                    "disk_write_seconds": after.disk_write_seconds - before.disk_write_seconds,
                    "peak_host_bytes": after.peak_host_bytes,
                    "disk_bytes": after.disk_bytes,
                }
            )
    return {**spec, "parameters": parameters, "baseline_rss": baseline, "peak_rss": _rss(), "steps": steps}


def _run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    state, value = run_in_fresh_process(_trial, spec, timeout)
    if state != "ok":
        return {**spec, "state": f"failed: {value[:160]}"}
    return {**value, "state": "ok"}


def _dd(disk_dir: Path, mib: int) -> dict[str, float]:
    """Sequential write and read bandwidth of ``disk_dir`` (direct I/O, bypassing the page cache)."""
    path = disk_dir / ".disk_tier_dd"
    out: dict[str, float] = {}
    try:
        for name, args in (
            ("write", ["if=/dev/zero", f"of={path}", "oflag=direct"]),
            ("read", [f"if={path}", "of=/dev/null", "iflag=direct"]),
        ):
            done = subprocess.run(
                ["dd", *args, "bs=1M", f"count={mib}"], capture_output=True, text=True, check=False, timeout=600
            )
            match = re.search(r"copied, ([0-9.]+) s", done.stderr)
            if match:
                out[f"{name}_bytes_per_second"] = mib * 2**20 / float(match.group(1))
    finally:
        path.unlink(missing_ok=True)
    return out


def _fit(trials: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Host bytes per parameter and working set, from two sizes' peak resident sets."""
    ok = [t for t in trials if t.get("state") == "ok"]
    if len(ok) < 2:
        return None
    (a, b) = sorted(ok, key=lambda t: t["parameters"])[:2]
    slope = (b["peak_rss"] - a["peak_rss"]) / (b["parameters"] - a["parameters"])
    return slope, a["peak_rss"] - slope * a["parameters"]


def _size(text: str) -> tuple[int, int]:
    hidden, layers = text.lower().split("x")
    return int(hidden), int(layers)


def add_run_arguments(parser: argparse.ArgumentParser, scratch: str) -> None:
    """The options a benchmark of bases on the disk tier shares (this one and ``lora.py``):
    threads, the scratch directory (default ``benchmarks/results/<scratch>``), budgets, chunk size,
    the RAM to fit, the ``dd`` size, a trial's timeout and where results go."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--disk-dir", type=Path, default=Path("benchmarks/results") / scratch)
    parser.add_argument("--host-budget", type=parse_bytes, default=None)
    parser.add_argument("--device-budget", type=parse_bytes, default=None)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--ram", type=parse_bytes, default=None, help="host memory to fit (default: this machine's)")
    parser.add_argument("--dd-mib", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    begin_run(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--sizes", default="512x4,768x8", help="two model sizes, HIDDENxLAYERS,HIDDENxLAYERS")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--verify", type=_size, default=None, help="train this size with the disk tier, for real")
    add_run_arguments(parser, "disk_tier_scratch")
    args = parser.parse_args(argv)
    import psutil

    ram = args.ram or psutil.virtual_memory().total
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "vocab": args.vocab,
        "seq": args.seq,
        "steps": args.steps,
        "threads": args.threads,
        "disk_dir": str(args.disk_dir),
        "host_budget": args.host_budget,
        "device_budget": args.device_budget,
        "chunk_size": args.chunk_size,
        "port": 29611,
    }
    trials: dict[str, list[dict[str, Any]]] = {}
    for system in args.systems.split(","):
        for hidden, layers in (_size(s) for s in args.sizes.split(",")):
            spec = {**base, "system": system, "hidden": hidden, "layers": layers}
            trials.setdefault(system, []).append(_run_trial(spec, args.timeout))
            print(f"{system} {hidden}x{layers}: {trials[system][-1]['state']}", flush=True)
    rows, summary = [], {}
    for system, runs in trials.items():
        fit = _fit(runs)
        largest = None if fit is None else int((ram - fit[1]) / fit[0])
        summary[system] = {"bytes_per_parameter": None if fit is None else fit[0], "largest_parameters": largest}
        for run in runs:
            rows.append(
                [
                    system,
                    f"{run['hidden']}x{run['layers']}",
                    f"{run.get('parameters', 0) / 1e6:.1f} M",
                    fmt_bytes(run.get("peak_rss")),
                    "-" if fit is None else f"{fit[0]:.2f}",
                    "-" if largest is None else f"{largest / 1e9:.2f} B",
                    run["state"],
                ]
            )
    print_table(
        ["system", "size", "parameters", "peak RSS", "host B/param", f"largest in {fmt_bytes(ram)}", "state"], rows
    )
    reference = summary.get("fsdp2-offload", {}).get("largest_parameters")
    for system, entry in summary.items():
        if reference and entry["largest_parameters"]:
            entry["vs_fsdp2"] = entry["largest_parameters"] / reference
            print(f"{system}: the largest model is {entry['vs_fsdp2']:.2f}x FSDP2 + CPUOffloadPolicy's")
    payload: dict[str, Any] = {"machine": machine(), "ram": ram, "trials": trials, "summary": summary}
    payload["dd"] = _dd(args.disk_dir, args.dd_mib)
    if args.verify is not None:
        hidden, layers = args.verify
        run = _run_trial({**base, "system": "chunkmem-disk", "hidden": hidden, "layers": layers}, args.timeout)
        payload["verify"] = run
        steady = run.get("steps", [])[1:]
        vrows = [
            [
                step,
                f"{s['seconds']:.1f} s",
                fmt_bytes(s["disk_read_bytes"]),
                fmt_bytes(s["disk_write_bytes"]),
                fmt_bytes((s["disk_read_bytes"] + s["disk_write_bytes"]) / s["seconds"]) + "/s",
                fmt_bytes(s["disk_read_bytes"] / max(s["disk_read_seconds"], 1e-9)) + "/s",
                fmt_bytes(s["disk_write_bytes"] / max(s["disk_write_seconds"], 1e-9)) + "/s",
                fmt_bytes(s["peak_host_bytes"]),
            ]
            for step, s in enumerate(run.get("steps", []))
        ]
        billions = run.get("parameters", 0) / 1e9
        print(f"\nchunkmem disk tier, {hidden}x{layers}: {billions:.2f} B parameters, {run['state']}")
        headers = ["step", "time", "disk read", "disk written", "over the step", "read (a thread)", "write (a thread)"]
        print_table([*headers, "host (accounted)"], vrows)
        dd = ", ".join(f"{k} {fmt_bytes(v)}/s" for k, v in payload["dd"].items())
        print(f"peak RSS {fmt_bytes(run.get('peak_rss'))}; dd: {dd}")
        if steady:
            payload["verify_steady_disk_bytes"] = steady[-1]["disk_read_bytes"] + steady[-1]["disk_write_bytes"]
    write_json("disk_tier", payload, args.out_dir)
    _plot(summary, trials, ram, args.out_dir)
    return payload


def _plot(summary: dict[str, Any], trials: dict[str, list[dict[str, Any]]], ram: int, out_dir: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for system, runs in trials.items():
        ok = sorted((t for t in runs if t.get("state") == "ok"), key=lambda t: t["parameters"])
        left.plot([t["parameters"] / 1e6 for t in ok], [t["peak_rss"] / 2**30 for t in ok], marker="o", label=system)
    left.set_xlabel("parameters (M)")
    left.set_ylabel("peak RSS (GiB)")
    left.set_ylim(bottom=0)
    left.legend()
    names = [s for s, e in summary.items() if e["largest_parameters"]]
    right.bar(names, [summary[s]["largest_parameters"] / 1e9 for s in names])
    right.set_ylabel(f"largest model in {ram / 2**30:.0f} GiB (B parameters)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "disk_tier.png", dpi=120)


if __name__ == "__main__":
    main()
