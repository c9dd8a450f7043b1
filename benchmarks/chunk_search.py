"""Padding waste of the chunk-size search on real ``transformers`` configurations (built on the
meta device: no memory, no download), for several world sizes.

    python benchmarks/chunk_search.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, begin_run, print_table, write_json
from chunkmem.chunks.search import default_search_range, search_chunk_size


def configs() -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    return {
        "GPT-2 small": (GPT2LMHeadModel, GPT2Config()),
        "GPT-2 medium": (GPT2LMHeadModel, GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        "GPT-2 XL": (GPT2LMHeadModel, GPT2Config(n_embd=1600, n_layer=48, n_head=25)),
        "LLaMA 1B-like": (
            LlamaForCausalLM,
            LlamaConfig(
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=22,
                num_attention_heads=32,
                num_key_value_heads=4,
                vocab_size=32000,
            ),
        ),
        "LLaMA 7B": (
            LlamaForCausalLM,
            LlamaConfig(
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=32,
                num_attention_heads=32,
                vocab_size=32000,
            ),
        ),
    }


def main() -> None:
    begin_run(__file__)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="1,2,8")
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows, payload = [], []
    for name, (cls, config) in configs().items():
        with torch.device("meta"):
            params = list(cls(config).parameters())
        total = sum(p.numel() for p in params)
        low, high = default_search_range(total, args.granularity)
        for world in (int(w) for w in args.world_sizes.split(",")):
            start = time.perf_counter()
            result = search_chunk_size(params, low, high, args.granularity, world, element_size=2)
            seconds = time.perf_counter() - start
            rows.append(
                [
                    name,
                    f"{total / 1e6:.0f}M",
                    world,
                    f"[{low}, {high}]",
                    result.chunk_size,
                    result.num_chunks,
                    f"{result.waste_bytes / 2**20:.2f} MiB",
                    f"{result.waste_percent:.2f}%",
                    f"{seconds:.2f}",
                ]
            )
            payload.append(
                {
                    "model": name,
                    "params": total,
                    "world_size": world,
                    "range": [low, high],
                    "chunk_size": result.chunk_size,
                    "chunks": result.num_chunks,
                    "waste_bytes_bf16": result.waste_bytes,
                    "waste_percent": result.waste_percent,
                }
            )
    print_table(["model", "params", "W", "search range", "chunk size", "chunks", "waste (bf16)", "waste", "s"], rows)
    print(f"wrote {write_json('chunk_search', {'rows': payload}, args.out_dir)}")


if __name__ == "__main__":
    main()
