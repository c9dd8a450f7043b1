"""An offloaded training step, broken down: forward, backward, the host optimizer step, the host-device
copies and the device's idle time, for chunkmem with its optimizer side in host memory against
FSDP2 with ``CPUOffloadPolicy`` and DeepSpeed ZeRO-Offload (when installed), and against plain
PyTorch (everything on the device, ``AdamW(fused=True)`` where it has a fused kernel).

Every system trains the same model (``--model mlp``: blocks of ``Linear(width, width)``, the issue's
reference; or ``--model gpt2`` from a transformers config) on the same data with ``AdamW`` and its
defaults, each round in a fresh process, the systems alternating round by round; each reports the
median over rounds of its per-round median step, and chunkmem's host part (its
``optimizer.step()`` less the copies inside it) is set against plain PyTorch's fused AdamW step over
the same parameters, timed in the same run. Achieved copy bandwidth is set against the copy speed
measured in the same run (pinned host-device copies on CUDA; on a CPU, where "device" and host are
the same memory, a memcpy, and the device idle time is not defined).

    python benchmarks/offload.py                       # 12 x Linear(1024, 1024), one thread, ~1 min
    python benchmarks/offload.py --model gpt2 --layers 24 --width 1024 --seq 1024 --batch 8 --precision bf16

Prints a table, writes JSON and a plot (stacked bars per system) to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, machine, median, print_table, pyplot, rotated, write_json
from benchmarks.workers import run_in_fresh_process

SYSTEMS = ("plain", "chunkmem-after", "chunkmem-during", "fsdp2-offload", "deepspeed-offload")
PHASES = ("forward", "backward", "step")


def _model(spec: dict[str, Any]) -> Any:
    import torch

    torch.manual_seed(0)
    if spec["model"] == "mlp":
        return torch.nn.Sequential(*[torch.nn.Linear(spec["width"], spec["width"]) for _ in range(spec["layers"])])
    from benchmarks.common import gpt2_model

    return gpt2_model(spec["layers"], spec["width"], spec["vocab"], spec["seq"])


def _loss(model: Any, spec: dict[str, Any], step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(step)
    if spec["model"] == "mlp":
        x = torch.randn(spec["batch"], spec["width"], generator=g)
        return model(x.to(spec["device"])).float().square().mean()
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(spec["device"])
    return model(input_ids=ids, labels=ids).loss


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _copy_speed(device: str) -> dict[str, float]:
    """Bytes per second of a 256 MiB copy each way (pinned on CUDA; a memcpy on a CPU)."""
    import torch

    n = 64 * 2**20
    pin = device.startswith("cuda")
    host = torch.ones(n, pin_memory=pin)
    there = torch.empty(n, device=device)
    out = {}
    for name, (dst, src) in {"h2d": (there, host), "d2h": (host, there)}.items():
        dst.copy_(src, non_blocking=pin)
        _sync(device)
        begin = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=pin)
        _sync(device)
        out[name] = 3 * n * 4 / (time.perf_counter() - begin)
    return out


def _round(spec: dict[str, Any]) -> dict[str, Any]:
    """One system, one round, in this (fresh) process: per-step phase times and counters."""
    import torch

    torch.set_num_threads(spec["threads"])
    system, device = spec["system"], spec["device"]
    model = _model(spec)
    stats_of = None
    if system == "plain":
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        backward = lambda loss: loss.backward()  # noqa: E731
    elif system.startswith("chunkmem"):
        from chunkmem import Booster, ChunkPlugin, StepAfterBackward, StepDuringBackward
        from chunkmem.placement import StaticPlacementConfig

        host_step = StepDuringBackward() if system == "chunkmem-during" else StepAfterBackward()
        placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=2)
        plugin = ChunkPlugin(placement=placement, precision=spec["precision"], host_step=host_step)
        booster = Booster(plugin)
        # With a GPU, host runs whose kernel is left unset step fused; on a CPU compute device
        # chunkmem keeps PyTorch's CPU default there (plain PyTorch steps the same tensors), so
        # the benchmark asks for the kernel a GPU run gets.
        kernel = {"fused": True} if device == "cpu" else {}
        model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, **kernel))
        stats_of = model.stats
        backward = lambda loss: booster.backward(loss, optimizer)  # noqa: E731
    elif system == "fsdp2-offload":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
        model = model.to(device)
        policy = CPUOffloadPolicy(pin_memory=device != "cpu")
        blocks = list(model) if spec["model"] == "mlp" else list(model.transformer.h)
        for block in blocks:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        backward = lambda loss: loss.backward()  # noqa: E731
    else:  # deepspeed-offload
        import deepspeed

        from benchmarks.common import GPT2Shape
        from benchmarks.peer_systems import PeerSetup, deepspeed_config

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
        # Its own compiled CPU Adam (DeepSpeedCPUAdam), the ZeRO-Offload kernel; --ds-torch-adam
        # for torch's where it cannot be built.
        setup = PeerSetup(
            GPT2Shape(spec["layers"], spec["width"], spec["vocab"], spec["seq"]),
            spec["batch"],
            spec["precision"],
            weight_decay=0.01,
            ds_torch_adam=spec["ds_torch_adam"],
        )
        config = deepspeed_config(setup, offload=True, on_cuda=device != "cpu")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        model, optimizer = engine, engine
        backward = engine.backward
    steps = []
    for step in range(spec["steps"]):
        _sync(device)
        before = stats_of() if stats_of is not None else None
        t0 = time.perf_counter()
        loss = _loss(model, spec, step)
        _sync(device)
        t1 = time.perf_counter()
        backward(loss)
        _sync(device)
        t2 = time.perf_counter()
        middle = stats_of() if stats_of is not None else None
        optimizer.step()
        _sync(device)
        t3 = time.perf_counter()
        if hasattr(optimizer, "zero_grad"):  # outside the step phase: the bound times step() alone
            optimizer.zero_grad()
        row: dict[str, Any] = {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "loss": float(loss)}
        if before is not None and middle is not None:
            after = stats_of()
            in_step = (after.h2d_seconds - middle.h2d_seconds) + (after.d2h_seconds - middle.d2h_seconds)
            row.update(
                host_part=row["step"] - in_step,
                transfers=(after.h2d_seconds - before.h2d_seconds) + (after.d2h_seconds - before.d2h_seconds),
                h2d_bytes=after.h2d_bytes - before.h2d_bytes,
                d2h_bytes=after.d2h_bytes - before.d2h_bytes,
                host_step=after.host_step_seconds - before.host_step_seconds,
                early_steps=after.early_steps - before.early_steps,
                early_steps_in_backward=after.early_steps_in_backward - before.early_steps_in_backward,
                pageable_copies=after.pageable_copies - before.pageable_copies,
            )
        steps.append(row)
    result: dict[str, Any] = {"steps": steps}
    if system == "plain":  # the bound for chunkmem's host part: fused AdamW over the same parameters
        host = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
        bound = torch.optim.AdamW(host, lr=1e-3, fused=True)
        for p in host:
            p.grad = torch.full_like(p, 1e-3)
        times = []
        for _ in range(spec["steps"]):
            begin = time.perf_counter()
            bound.step()
            times.append(time.perf_counter() - begin)
        result["fused_host_step"] = median(times[2:] or times)
        result["copy_speed"] = _copy_speed(device)
    return result


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    state, value = run_in_fresh_process(_round, spec, spec["timeout"])
    if state != "ok":
        return {"state": f"failed: {value[:150]}"}
    return {**value, "state": "ok"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    begin_run(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ds-torch-adam", action="store_true", help="DeepSpeed with torch's AdamW, not its own")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    systems = [s for s in args.systems.split(",") if s != "deepspeed-offload" or importlib.util.find_spec("deepspeed")]
    skipped = sorted(set(args.systems.split(",")) - set(systems))
    spec = {k: getattr(args, k) for k in ("model", "layers", "width", "vocab", "seq", "batch", "precision", "steps")}
    spec.update(threads=args.threads, device=device, timeout=args.timeout, port=29631, ds_torch_adam=args.ds_torch_adam)
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for index in range(args.rounds):
        for system in rotated(systems, index):
            rounds[system].append(_run({**spec, "system": system}))
            print(f"round {index}: {system} {rounds[system][-1]['state']}", flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for system, results in rounds.items():
        ok = [r for r in results if r["state"] == "ok"]
        if not ok:
            summary[system] = {"state": results[-1]["state"] if results else "not run"}
            continue
        skip = min(2, len(ok[0]["steps"]) - 1)  # the first steps record the trace, build state
        entry: dict[str, Any] = {"state": "ok"}
        for key in (*PHASES, "host_part", "transfers", "host_step", "h2d_bytes", "d2h_bytes", "early_steps"):
            if key in ok[0]["steps"][0]:
                entry[key] = median([median([s[key] for s in r["steps"][skip:]]) for r in ok])
        entry["total"] = sum(entry[p] for p in PHASES)
        if "fused_host_step" in ok[0]:
            entry["fused_host_step"] = median([r["fused_host_step"] for r in ok])
            entry["copy_speed"] = ok[0]["copy_speed"]
        entry["first_loss"] = ok[0]["steps"][0]["loss"]
        summary[system] = entry
    plain = summary.get("plain", {})
    bound = plain.get("fused_host_step")
    rows = []
    for system, entry in summary.items():
        if entry["state"] != "ok":
            rows.append([system, *["-"] * 8, entry["state"]])
            continue
        host_part = entry.get("host_part")
        transfers = entry.get("transfers")
        speed = plain.get("copy_speed", {})
        achieved = "-"
        if transfers and speed:
            moved = entry.get("h2d_bytes", 0) + entry.get("d2h_bytes", 0)
            achieved = f"{moved / transfers / 1e9:.2f} GB/s ({moved / transfers / max(speed.values()):.0%})"
        rows.append(
            [
                system,
                f"{entry['forward'] * 1e3:.1f}",
                f"{entry['backward'] * 1e3:.1f}",
                f"{entry['step'] * 1e3:.1f}",
                "-" if host_part is None else f"{host_part * 1e3:.1f}",
                "-" if host_part is None or not bound else f"{host_part / bound:.2f}x",
                "-" if transfers is None else f"{transfers * 1e3:.1f}",
                achieved,
                f"{entry['total'] * 1e3:.1f}",
                "ok",
            ]
        )
    headers = ["system", "fwd ms", "bwd ms", "step ms", "host part ms", "vs fused", "copies ms", "copy bw", "total ms"]
    print_table([*headers, "state"], rows)
    if bound:
        print(f"plain AdamW(fused=True) over the same parameters on the host: {bound * 1e3:.1f} ms")
    if device == "cpu":
        print("device idle time: not defined on a CPU (the device and the host are the same cores)")
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}")
    payload = {"machine": machine(), "spec": spec, "rounds": rounds, "summary": summary, "skipped": skipped}
    write_json("offload", payload, args.out_dir)
    _plot(summary, args.out_dir)
    return payload


def _plot(summary: dict[str, dict[str, Any]], out_dir: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [s for s, e in summary.items() if e["state"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(names)
    for phase in PHASES:
        values = [summary[s][phase] * 1e3 for s in names]
        ax.bar(names, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms per step (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "offload.png", dpi=120)


if __name__ == "__main__":
    main()
