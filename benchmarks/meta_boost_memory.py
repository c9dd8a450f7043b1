"""Host memory a rank needs to build and boost a model: built on the CPU then boosted, against built
on the meta device and boosted with its own initialisation replayed, or with its weights streamed
from a safetensors checkpoint (``booster.boost(model, optimizer, weights=directory)``).

A Llama-shaped transformers model (``--layers`` x ``--width``) is built and boosted with AdamW in
fresh local gloo processes, one set per way; each rank reports the peak growth of its resident set
over building and boosting (the kernel's own high-water mark, reset first), the fp32 master shard it
ends with, and the wall time. A first tiny boost in each process takes the one-time costs (imports,
process-group buffers) out of the figures.

    python benchmarks/meta_boost_memory.py [--world-size 2] [--layers 8] [--width 1024]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt_bytes, print_table

WAYS = ("cpu", "meta-init", "meta-weights")


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=int(args.width * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 64),
        num_key_value_heads=max(1, args.width // 128),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _run(rank: int, world_size: int, port: int, way: str, args: argparse.Namespace, weights: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if world_size > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(minutes=20),
        )  # fmt: skip
    from transformers import LlamaForCausalLM

    from chunkmem import Booster, ChunkPlugin

    tiny = torch.nn.Linear(8, 8)
    Booster(ChunkPlugin(precision="fp32")).boost(tiny, torch.optim.AdamW(tiny.parameters()))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak RSS (VmHWM) restarts from the current RSS
    start, began = _status("VmRSS"), time.perf_counter()
    torch.manual_seed(0)
    if way == "cpu":
        model = LlamaForCausalLM(_config(args))
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(_config(args))
    full = sum(p.numel() * 4 for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    booster = Booster(plugin=ChunkPlugin(precision="fp32"))
    chunked, *_ = booster.boost(model, optimizer, weights=weights if way == "meta-weights" else None)
    seconds = time.perf_counter() - began
    masters = sum(c.store.master.numel() * c.store.master.element_size() for c in chunked.manager.chunks)
    out.put((rank, {"growth": _status("VmHWM") - start, "masters": masters, "full": full, "seconds": seconds}))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux: the peak RSS is read from /proc/self/status after resetting it")
    from transformers import LlamaForCausalLM

    ctx = mp.get_context("spawn")
    table = []
    with tempfile.TemporaryDirectory() as directory:
        with torch.device("meta"):
            empty = LlamaForCausalLM(_config(args))
        # The values do not matter for memory: uninitialised weights are written as they are.
        empty.to_empty(device="cpu").save_pretrained(directory, max_shard_size="200MB")
        del empty
        for way in WAYS:
            queue = ctx.Queue()
            port = 29500 + (os.getpid() + WAYS.index(way)) % 1000
            procs = [
                ctx.Process(target=_run, args=(rank, args.world_size, port, way, args, directory, queue))
                for rank in range(args.world_size)
            ]
            for p in procs:
                p.start()
            results = sorted(queue.get(timeout=1800) for _ in procs)
            for p in procs:
                p.join()
            for rank, row in results:
                ratio = row["growth"] / row["full"]
                table.append(
                    [way, str(rank), fmt_bytes(row["growth"]), f"{ratio:.2f}", fmt_bytes(row["masters"]),
                     f"{row['seconds']:.1f}"]
                )  # fmt: skip
    full = results[0][1]["full"]
    print(f"Llama {args.layers}x{args.width}, {fmt_bytes(full)} of fp32 parameters, world size {args.world_size}")
    print_table(["way", "rank", "peak RSS growth", "x model", "master shard", "seconds"], table)


if __name__ == "__main__":
    main()
