"""Fine-tune a small LLaMA with ``transformers.Trainer`` under chunkmem, on the CPU.

    pip install -e ".[hf]"
    python examples/hf_trainer.py            # one process, seconds on a CPU
    python examples/hf_trainer.py --steps 16 --budget 256KiB
    torchrun --nproc-per-node 2 examples/hf_trainer.py   # two ranks (gloo on a CPU)

The ``TrainingArguments`` are what plain ``Trainer`` would take; the only change is
``ChunkTrainer(..., plugin=ChunkPlugin(...))``. The device budget is below the model's chunk data,
so chunks move to and from host memory every step; the log is the same as plain Trainer's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from chunkmem import AutoPlacementConfig, ChunkPlugin
from chunkmem.integrations.hf import ChunkTrainer


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=136,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config)


def data(n: int = 64, seq: int = 32) -> list[dict[str, torch.Tensor]]:
    """Token rows with a pattern to learn: each row counts up from a random start."""
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 512, (n, 1), generator=g)
    rows = (starts + torch.arange(seq)) % 512
    return [{"input_ids": row, "labels": row} for row in rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (a checkpoint every half)")
    parser.add_argument("--budget", default="512KiB", help="device budget per rank (chunk bytes on the device)")
    return parser.parse_args(argv)


def arguments(output_dir: str, steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=2,
        save_steps=max(1, steps // 2),
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,  # torchrun on a CPU
        disable_tqdm=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: more threads cost more than they save
    # Every rank must write to the same directories: one name per run (torchrun's id, else this process).
    run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    root = os.path.join(tempfile.gettempdir(), f"chunkmem-hf-example-{run}")
    start = time.perf_counter()
    plain = Trainer(model=model(), args=arguments(f"{root}/plain", args.steps), train_dataset=data())
    plain.train()
    plain_seconds = time.perf_counter() - start

    start = time.perf_counter()
    plugin = ChunkPlugin(placement=AutoPlacementConfig(device_budget=args.budget), chunk_size=16384)
    chunk_args = arguments(f"{root}/chunkmem", args.steps)
    trainer = ChunkTrainer(model=model(), args=chunk_args, train_dataset=data(), plugin=plugin)
    trainer.train()
    trainer.save_model(f"{root}/final")  # a save_pretrained directory (every rank calls it; rank 0 writes)
    chunk_seconds = time.perf_counter() - start

    stats = trainer.model.stats()
    if trainer.is_world_process_zero():
        reloaded = AutoModelForCausalLM.from_pretrained(f"{root}/final")
        print("step  plain Trainer loss  ChunkTrainer loss")
        logs = zip(plain.state.log_history, trainer.state.log_history, strict=True)
        for reference, ours in ((a, b) for a, b in logs if "loss" in a):
            print(f"{reference['step']:>4}  {reference['loss']:>18.6f}  {ours['loss']:>17.6f}")
        print(
            f"model {sum(p.numel() for p in reloaded.parameters()) * 4 / 1024:.0f} KiB fp32, "
            f"device budget {int(plugin.placement.device_budget) / 1024:.0f} KiB, "
            f"peak {stats.peak_device_bytes / 1024:.0f} KiB, "
            f"{stats.evictions} evictions, {stats.h2d_bytes / 2**20:.1f} MiB host-to-device (rank 0)"
        )
        print(f"checkpoints: {sorted(os.listdir(f'{root}/chunkmem'))}")
        print(f"plain Trainer {plain_seconds:.1f} s, ChunkTrainer {chunk_seconds:.1f} s (with its save)")
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
