"""How large a base a LoRA fine-tune trains on this host: chunkmem with the base on disk, against
chunkmem with the base in host memory and against plain PEFT.

Each system fine-tunes a LLaMA-shaped model (transformers) with a PEFT LoRA adapter (``--rank``,
on ``q_proj`` and ``v_proj``; AdamW over the adapter) for a few steps at each ``--sizes`` point,
in a fresh process whose peak resident set is read from the kernel (forked from a server that only
imported torch, transformers and chunkmem). Plain PEFT builds the base on the CPU in bf16 (2 bytes a
base parameter) and trains in bf16 with PEFT's fp32 adapter; chunkmem builds it on the meta device
(``get_peft_model`` inside the meta block: the base's initialisation is replayed chunk by chunk
while boosting), in bf16 too, and computes in bf16 from its chunks; its frozen chunks hold only
those bf16 values (no fp32 master), either in host memory (``chunkmem-ram``) or on disk
(``chunkmem-disk``: in ``--disk-dir``, each gather reads its shard). The two smallest points give
each system's host bytes per base parameter (the slope of peak RSS, and of the bytes chunkmem's
ledger counts) and its working set (the intercept); the largest base per system is what fits in
``--ram`` at that rate and, with the base on disk, what fits on the scratch disk at the bytes a
base parameter takes there (the slope of the scratch bytes: the adapter's chunks are the intercept).

Per step: wall time, tokens per second, the disk bytes read and written (of which the 16-bit
parameter shards), and what those bytes cost at the disk's sequential read bandwidth measured by
``dd`` (direct I/O) in the same run. With ``--verify HIDDENxLAYERS`` chunkmem trains that size with
the base on disk (a base larger than RAM), reporting the same per step, its peak resident set
against the host budget. Prints tables, writes JSON and a plot to ``--out-dir``; the scratch files
are removed after each run.

    python benchmarks/lora.py                                  # two small sizes a system
    python benchmarks/lora.py --systems chunkmem-disk --sizes 2048x16,4096x16 --seq 32
    python benchmarks/lora.py --systems chunkmem-disk --sizes 1024x4,1024x8 --verify 8192x40 \\
        --disk-dir /work/lora_scratch --host-budget 4GiB --device-budget 4GiB --timeout 36000
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import begin_run, fmt_bytes, machine, peak_rss, print_table, pyplot, write_json
from benchmarks.disk_tier import _dd, _fit, _size, add_run_arguments
from benchmarks.workers import run_in_fresh_process

SYSTEMS = ("chunkmem-disk", "chunkmem-ram", "peft")
TARGETS = ["q_proj", "v_proj"]


def config(hidden: int, layers: int, vocab: int) -> Any:
    """LLaMA's shape: MLP 8/3 of the width (a multiple of 64), heads of 128, a quarter as many
    key-value heads (grouped-query attention), untied embeddings."""
    from transformers import LlamaConfig

    heads = max(1, hidden // 128)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=max(64, hidden * 8 // 3 // 64 * 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=max(256, 2 * hidden),
        tie_word_embeddings=False,
    )


def _lora(model: Any, rank: int) -> Any:
    import peft

    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def _base_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def _trial(spec: dict[str, Any]) -> dict[str, Any]:
    """One system at one size, in this (fresh) process."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(spec["threads"])
    cfg = config(spec["hidden"], spec["layers"], spec["vocab"])
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1))
    baseline = peak_rss()
    torch.manual_seed(0)
    began = time.perf_counter()
    steps: list[dict[str, Any]] = []
    if spec["system"] == "peft":
        model = _lora(LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16), spec["rank"])
        base = _base_parameters(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        built = time.perf_counter() - began
        for _ in range(spec["train_steps"]):
            begin = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"seconds": time.perf_counter() - begin})
        return _result(spec, base, baseline, built, steps)
    from chunkmem import Booster, ChunkPlugin
    from chunkmem.placement import StaticPlacementConfig

    with torch.device("meta"):  # the base in bf16, as plain PEFT's: frozen chunks then hold only its values
        model = _lora(LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16), spec["rank"])
    base = _base_parameters(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    on_disk = spec["system"] == "chunkmem-disk"
    placement = StaticPlacementConfig(
        offload_optim_frac=1.0,
        offload_param_frac=1.0,
        offload_disk_frac=1.0 if on_disk else 0.0,
        offload_param_disk_frac=1.0 if on_disk else 0.0,
        device_budget=spec["device_budget"],
        host_budget=spec["host_budget"] if on_disk else None,
        max_prefetch=1,
    )
    plugin = ChunkPlugin(
        placement=placement,
        precision="bf16",
        chunk_size=spec["chunk_size"],
        disk_dir=spec["disk_dir"] if on_disk else None,
    )
    booster = Booster(plugin)
    chunked, optimizer, *_ = booster.boost(model, optimizer)
    built = time.perf_counter() - began
    for _ in range(spec["train_steps"]):
        before = chunked.stats()
        begin = time.perf_counter()
        booster.backward(chunked(input_ids=ids, labels=ids).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        after = chunked.stats()
        steps.append(
            {
                "seconds": time.perf_counter() - begin,
                **{
                    name: getattr(after, name) - getattr(before, name)
                    for name in (
                        "disk_read_bytes",
                        "disk_write_bytes",
                        "disk_param_read_bytes",
                        "disk_param_write_bytes",
                        "disk_read_seconds",
                    )
                },
                "peak_host_bytes": after.peak_host_bytes,
                "disk_bytes": after.disk_bytes,
            }
        )
    return _result(spec, base, baseline, built, steps)


def _result(
    spec: dict[str, Any], base: int, baseline: int, built: float, steps: list[dict[str, Any]]
) -> dict[str, Any]:
    tokens = spec["batch"] * spec["seq"]
    for step in steps:
        step["tokens_per_second"] = tokens / step["seconds"]
    return {
        **spec,
        "base_parameters": base,
        "base_bf16_bytes": 2 * base,
        "baseline_rss": baseline,
        "peak_rss": peak_rss(),
        "build_seconds": built,
        "steps": steps,
    }


def _run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    scratch = Path(spec["disk_dir"]) / f"{spec['system']}-{spec['hidden']}x{spec['layers']}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        state, value = run_in_fresh_process(_trial, {**spec, "disk_dir": str(scratch)}, timeout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if state != "ok":
        return {**spec, "state": f"failed: {value[:200]}"}
    return {**value, "state": "ok"}


def _fit_base(runs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Host bytes per base parameter and working set, from the two smallest points' peak RSS."""
    return _fit([{**r, "parameters": r.get("base_parameters", 0)} for r in runs])


def _fit_accounted(runs: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """Bytes per base parameter and the fixed rest (the adapter's chunks), from the two smallest
    points' accounted ``key`` (a ``stats()`` figure) after the last step."""
    ok = [r for r in runs if r["state"] == "ok" and r["steps"] and key in r["steps"][-1]]  # not plain PEFT
    if len(ok) < 2:
        return None
    return _fit([{**r, "parameters": r["base_parameters"], "peak_rss": r["steps"][-1][key]} for r in ok])


def _row(run: dict[str, Any], read_bps: float | None) -> list[str]:
    steady = run.get("steps", [])[1:] or run.get("steps", [])
    last = steady[-1] if steady else {}
    read = last.get("disk_read_bytes")
    at_dd = "-" if read is None or not read_bps else f"{read / read_bps:.1f} s"
    return [
        run["system"],
        f"{run['hidden']}x{run['layers']}",
        f"{run.get('base_parameters', 0) / 1e6:.1f} M",
        fmt_bytes(run.get("base_bf16_bytes")),
        f"{run['build_seconds']:.1f} s" if "build_seconds" in run else "-",
        f"{last['seconds']:.2f} s" if last else "-",
        f"{last['tokens_per_second']:.1f}" if last else "-",
        fmt_bytes(read) if read is not None else "-",
        fmt_bytes(last.get("disk_write_bytes")) if read is not None else "-",
        at_dd,
        fmt_bytes(run.get("peak_rss")),
        run["state"],
    ]


HEADERS = [
    "system",
    "size",
    "base",
    "base bf16",
    "build",
    "step",
    "tokens/s",
    "disk read/step",
    "disk write/step",
    "read at dd",
    "peak RSS",
    "state",
]


def trial_base(args: argparse.Namespace) -> dict[str, Any]:
    """What every trial's spec shares: the command line's shape, budgets and scratch directory."""
    base = {
        k: getattr(args, k)
        for k in ("vocab", "seq", "batch", "rank", "threads", "host_budget", "device_budget", "chunk_size")
    }
    return {**base, "train_steps": args.steps, "disk_dir": str(args.disk_dir)}


def run_trials(
    args: argparse.Namespace,
    base: dict[str, Any],
    run_trial: Callable[[dict[str, Any], float], dict[str, Any]],
    after_each: Callable[[], None] = lambda: None,
) -> dict[str, list[dict[str, Any]]]:
    """Each system of ``args.systems`` at each size of ``args.sizes`` (``run_trial``: one trial in a
    process of its own), the trials of a system in order of size."""
    trials: dict[str, list[dict[str, Any]]] = {}
    for system in args.systems.split(","):
        for hidden, layers in (_size(s) for s in args.sizes.split(",")):
            spec = {**base, "system": system, "hidden": hidden, "layers": layers}
            trials.setdefault(system, []).append(run_trial(spec, args.timeout))
            print(f"{system} {hidden}x{layers}: {trials[system][-1]['state']}", flush=True)
            after_each()
    return trials


def main(argv: list[str] | None = None) -> dict[str, Any]:
    begin_run(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--sizes", default="256x2,256x4", help="model sizes, HIDDENxLAYERS,... (two or more)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--verify", type=_size, default=None, help="train this size with the base on disk")
    add_run_arguments(parser, "lora_scratch")
    args = parser.parse_args(argv)
    import psutil

    ram = args.ram or psutil.virtual_memory().total
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    dd = _dd(args.disk_dir, args.dd_mib)
    read_bps = dd.get("read_bytes_per_second")
    base = trial_base(args)
    trials = run_trials(args, base, _run_trial)
    free_disk = shutil.disk_usage(args.disk_dir).free
    rows, summary = [], {}
    for system, runs in trials.items():
        fit = _fit_base(runs)
        largest = None if fit is None or fit[0] <= 0 else int((ram - fit[1]) / fit[0])
        entry: dict[str, Any] = {
            "host_bytes_per_base_parameter": None if fit is None else fit[0],
            "working_set_bytes": None if fit is None else fit[1],
            "largest_base_parameters_in_ram": largest,
        }
        accounted = _fit_accounted(runs, "peak_host_bytes")
        if accounted is not None:  # what chunkmem's ledger counts, beside the process's RSS
            entry["accounted_host_bytes_per_base_parameter"] = accounted[0]
        on_disk = _fit_accounted(runs, "disk_bytes") if system == "chunkmem-disk" else None
        if on_disk is not None and on_disk[0] > 0:
            entry["disk_bytes_per_base_parameter"] = on_disk[0]
            entry["largest_base_parameters_on_disk"] = int((free_disk - on_disk[1]) / on_disk[0])
        summary[system] = entry
        rows += [_row(run, read_bps) for run in runs]
    print_table(HEADERS, rows)
    for system, entry in summary.items():
        slope, largest = entry["host_bytes_per_base_parameter"], entry["largest_base_parameters_in_ram"]
        if slope is not None:
            fits = f"{largest / 1e9:.2f} B base parameters fit in {fmt_bytes(ram)}" if largest else "no RAM limit"
            working = fmt_bytes(entry["working_set_bytes"])
            print(f"{system}: {slope:.2f} host bytes a base parameter, working set {working}: {fits}")
        if "accounted_host_bytes_per_base_parameter" in entry:
            accounted = entry["accounted_host_bytes_per_base_parameter"]
            print(f"{system}: {accounted:.2f} accounted host bytes a base parameter (the ledger's peak)")
        if "largest_base_parameters_on_disk" in entry:
            print(
                f"{system}: {entry['disk_bytes_per_base_parameter']:.2f} disk bytes a base parameter: "
                f"{entry['largest_base_parameters_on_disk'] / 1e9:.2f} B fit in the {fmt_bytes(free_disk)} free"
            )
    print("dd: " + ", ".join(f"{k} {fmt_bytes(v)}/s" for k, v in dd.items()))
    payload: dict[str, Any] = {
        "machine": machine(),
        "ram": ram,
        "free_disk": free_disk,
        "dd": dd,
        "trials": trials,
        "summary": summary,
    }
    if args.verify is not None:
        hidden, layers = args.verify
        run = _run_trial({**base, "system": "chunkmem-disk", "hidden": hidden, "layers": layers}, args.timeout)
        payload["verify"] = run
        print(f"\nchunkmem, base on disk, {hidden}x{layers}: {run['state']}")
        print_table(HEADERS, [_row(run, read_bps)])
        if run["state"] == "ok":
            budget = args.host_budget
            print(
                f"peak RSS {fmt_bytes(run['peak_rss'])} ({fmt_bytes(run['peak_rss'] - run['baseline_rss'])} over the "
                f"process before building), host budget {fmt_bytes(budget) if budget else 'none'}, base "
                f"{fmt_bytes(run['base_bf16_bytes'])} in bf16 ({run['base_bf16_bytes'] / ram:.2f}x RAM)"
            )
    write_json("lora", payload, args.out_dir)
    _plot(trials, read_bps, args.out_dir)
    return payload


def _plot(trials: dict[str, list[dict[str, Any]]], read_bps: float | None, out_dir: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for system, runs in trials.items():
        ok = sorted((t for t in runs if t.get("state") == "ok"), key=lambda t: t["base_parameters"])
        sizes = [t["base_bf16_bytes"] / 2**30 for t in ok]
        left.plot(sizes, [t["peak_rss"] / 2**30 for t in ok], marker="o", label=system)
        right.plot(sizes, [t["steps"][-1]["seconds"] for t in ok], marker="o", label=system)
        if system == "chunkmem-disk" and read_bps:
            reads = [t["steps"][-1]["disk_read_bytes"] / read_bps for t in ok]
            right.plot(sizes, reads, linestyle="--", label="its disk reads at dd's bandwidth")
    left.set_xlabel("base in bf16 (GiB)")
    left.set_ylabel("peak RSS (GiB)")
    left.set_ylim(bottom=0)
    left.legend()
    right.set_xlabel("base in bf16 (GiB)")
    right.set_ylabel("step time (s)")
    right.set_ylim(bottom=0)
    right.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "lora.png", dpi=120)


if __name__ == "__main__":
    main()
