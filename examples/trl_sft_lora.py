"""Supervised fine-tuning with TRL's ``SFTTrainer`` and a LoRA adapter (PEFT) under chunkmem, beside
plain ``SFTTrainer`` with the same ``SFTConfig``: a small LLaMA built from a config, on text, with a
device budget below the model's chunk data.

    pip install -e ".[hf]" trl peft
    python examples/trl_sft_lora.py                  # seconds on a CPU
    python examples/trl_sft_lora.py --steps 8 --budget 600KiB
    torchrun --nproc-per-node 2 examples/trl_sft_lora.py     # two ranks (gloo on a CPU)

chunkmem's door into a trainer is ``ChunkTrainerMixin``: put it before the trainer class,
``class ChunkSFTTrainer(ChunkTrainerMixin, SFTTrainer)``, and pass ``plugin=ChunkPlugin(...)``;
everything else is TRL's own.

**A tokenizer without a download.** ``SFTTrainer`` tokenizes text with the model's tokenizer, and a
model built from a config has none. This example builds one in memory with the ``tokenizers``
library (which transformers installs): a word-level vocabulary over the words of the data, split on
whitespace, wrapped in ``PreTrainedTokenizerFast`` with its pad, end-of-sequence and unknown tokens.
A real run would load the tokenizer that belongs to its model (``AutoTokenizer.from_pretrained``).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile

import datasets
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer

from chunkmem import ChunkPlugin, StaticPlacementConfig
from chunkmem.integrations.hf import ChunkTrainerMixin

SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our neighbour", "a bird"]
VERBS = ["sees", "likes", "follows", "finds", "draws", "greets"]
OBJECTS = ["the ball", "a tree", "the river", "a small house", "the red door", "an old boat"]
SPECIAL = ["<pad>", "<eos>", "<unk>"]


class ChunkSFTTrainer(ChunkTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer, boosted by chunkmem."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--budget", default="400KiB", help="device budget per rank (chunk bytes on the device)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain SFTTrainer comparison")
    return parser.parse_args(argv)


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ." for _ in range(n)]


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of ``texts``, built in memory (nothing downloaded)."""
    words = sorted({word for text in texts for word in text.split()})
    vocab = {token: index for index, token in enumerate([*SPECIAL, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights for both trainers and on every rank
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def sft_config(output_dir: str, steps: int) -> SFTConfig:
    return SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_length=32,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32 on a CPU: the runs compare exactly
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: more threads cost more than they save
    datasets.disable_progress_bars()
    texts = sentences(64)
    tokenizer = word_tokenizer(texts)
    data = Dataset.from_dict({"text": texts})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))  # one directory for every rank
    root = os.path.join(tempfile.gettempdir(), f"chunkmem-trl-example-{run}")
    parts = {"train_dataset": data, "processing_class": tokenizer, "peft_config": lora}

    # Every chunk's parameters and optimizer side in host memory between uses, gathered to the device
    # for each op under the budget (SFTConfig's gradient checkpointing recomputes the forward inside
    # the backward, so two ops' chunks are on the device at once).
    placement = StaticPlacementConfig(
        offload_param_frac=1.0, offload_optim_frac=1.0, device_budget=args.budget, max_prefetch=1
    )
    plugin = ChunkPlugin(placement=placement, chunk_size=8192)  # chunkmem
    trainer = ChunkSFTTrainer(
        model=model(len(tokenizer)), args=sft_config(f"{root}/chunkmem", args.steps), plugin=plugin, **parts
    )
    trainer.remove_callback(PrinterCallback)  # the table below says what the log lines would
    trainer.train()
    stats = trainer.model.stats()
    ours = [line["loss"] for line in trainer.state.log_history if "loss" in line]
    theirs = None
    if not args.no_plain:
        plain = SFTTrainer(model=model(len(tokenizer)), args=sft_config(f"{root}/plain", args.steps), **parts)
        plain.remove_callback(PrinterCallback)
        plain.train()
        theirs = [line["loss"] for line in plain.state.log_history if "loss" in line]
    if trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(f"LoRA r=4 on q_proj, v_proj: {trainable:,} trainable parameters; tokenizer of {len(tokenizer)} words")
        print("step  plain SFTTrainer  ChunkSFTTrainer")
        for step, loss in enumerate(ours, start=1):
            reference = f"{theirs[step - 1]:16.6f}" if theirs else "               -"
            print(f"{step:>4}  {reference}  {loss:15.6f}")
        if theirs:
            worst = max(abs(a - b) for a, b in zip(theirs, ours, strict=True))
            print(f"largest loss difference from plain SFTTrainer: {worst:.2e}")
        print(
            f"peak device bytes {stats.peak_device_bytes} <= budget {int(plugin.placement.device_budget)}; "
            f"{stats.evictions} evictions (rank 0)"
        )


if __name__ == "__main__":
    main()
