"""RL fine-tuning with TRL's ``GRPOTrainer`` under chunkmem, beside plain ``GRPOTrainer`` with the same
``GRPOConfig``: a small LLaMA policy, its frozen reference (the KL term, ``beta > 0``) and a reward
model, all three under one device budget below their chunk data, and a reward function.

    pip install -e ".[hf]" trl
    python examples/trl_grpo.py                  # seconds on a CPU
    python examples/trl_grpo.py --steps 4 --budget 300KiB

chunkmem's door is the same as for SFT: ``class ChunkGRPOTrainer(ChunkTrainerMixin, GRPOTrainer)``
and ``plugin=ChunkPlugin(...)``. TRL builds the reference from the policy's ``name_or_path`` (so
the policy is saved once and loaded from there, as a real run loads it from the hub), and chunkmem
boosts it and the reward model beside the policy: one budget and one trace for the three models.
Completions are sampled by the boosted policy's ``generate`` (its chunks gathered under the budget).

The prompts are short sentences; the reward function pays a completion for each word it shares with
its prompt, and the reward model is a small sequence classifier built from a config (a real run
loads a trained one). The tokenizer is the word-level one of ``examples/trl_sft_lora.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from chunkmem import ChunkPlugin, StaticPlacementConfig
from chunkmem.integrations.hf import ChunkTrainerMixin

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the SFT example beside this one, run from anywhere
from trl_sft_lora import model as policy_model
from trl_sft_lora import sentences, word_tokenizer


class ChunkGRPOTrainer(ChunkTrainerMixin, GRPOTrainer):
    """TRL's GRPOTrainer, boosted by chunkmem."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--budget", default="200KiB", help="device budget (chunk bytes of all three models)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain GRPOTrainer comparison")
    return parser.parse_args(argv)


def shared_words(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A reward function: how many of the prompt's words the completion repeats."""
    return [float(len(set(p.split()) & set(c.split()))) for p, c in zip(prompts, completions, strict=True)]


def reward_model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=1,
    )
    return LlamaForSequenceClassification(config)


def grpo_config(output_dir: str, steps: int) -> GRPOConfig:
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_generations=2,  # completions per prompt: their rewards' spread is the advantage
        max_completion_length=4,
        beta=0.1,  # a KL term to the reference: TRL builds one from the policy's name_or_path
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32 on a CPU: the runs compare exactly
        seed=0,
        disable_tqdm=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: more threads cost more than they save
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    texts = sentences(16)
    tokenizer = word_tokenizer(texts)
    root = tempfile.mkdtemp(prefix="chunkmem-grpo-example-")
    try:
        train_both(args, texts, tokenizer, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def train_both(args: argparse.Namespace, texts: list[str], tokenizer: Any, root: str) -> None:
    """chunkmem's GRPOTrainer, then plain GRPOTrainer, from the same saved policy; the table."""
    policy_path = os.path.join(root, "policy")
    policy_model(len(tokenizer)).save_pretrained(policy_path)  # where the reference is built from
    prompts = Dataset.from_dict({"prompt": [" ".join(t.split()[:3]) for t in texts]})

    def parts(name: str) -> dict[str, Any]:
        return {
            "args": grpo_config(os.path.join(root, name), args.steps),
            "train_dataset": prompts,
            "processing_class": tokenizer,
            "reward_funcs": [shared_words, reward_model(len(tokenizer))],
            "reward_processing_classes": [None, tokenizer],
        }

    placement = StaticPlacementConfig(
        offload_param_frac=1.0, offload_optim_frac=1.0, device_budget=args.budget, max_prefetch=1
    )
    plugin = ChunkPlugin(placement=placement, chunk_size=8192)  # chunkmem
    trainer = ChunkGRPOTrainer(model=LlamaForCausalLM.from_pretrained(policy_path), plugin=plugin, **parts("chunkmem"))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    stats = trainer.model.stats()
    ours = [(line["loss"], line["reward"]) for line in trainer.state.log_history if "loss" in line]
    theirs = None
    if not args.no_plain:
        plain = GRPOTrainer(model=LlamaForCausalLM.from_pretrained(policy_path), **parts("plain"))
        plain.remove_callback(PrinterCallback)
        plain.train()
        theirs = [(line["loss"], line["reward"]) for line in plain.state.log_history if "loss" in line]
    if trainer.is_world_process_zero():
        models = [trainer.model, *trainer.model.frozen_models]
        chunk_bytes = sum(chunk.layout.gathered_bytes for m in models for chunk in m.chunks)
        named = "policy, reference, reward model"
        print(f"{len(models)} models boosted together ({named}): {chunk_bytes:,} bytes of chunks")
        print("step  plain loss, reward      ChunkGRPOTrainer loss, reward")
        for step, (loss, reward) in enumerate(ours, start=1):
            reference = f"{theirs[step - 1][0]:10.6f} {theirs[step - 1][1]:8.4f}" if theirs else "         -        -"
            print(f"{step:>4}  {reference}      {loss:10.6f} {reward:8.4f}")
        if theirs:
            same = ours == theirs
            print(f"losses and rewards equal plain GRPOTrainer's: {'yes' if same else 'no'}")
        print(
            f"peak device bytes {stats.peak_device_bytes} <= budget {int(plugin.placement.device_budget)}; "
            f"{stats.evictions} evictions"
        )


if __name__ == "__main__":
    main()
