"""TRL's ``SFTTrainer`` with a PEFT LoRA adapter under chunkmem: ``class ChunkSFTTrainer(
ChunkTrainerMixin, SFTTrainer)`` on a tiny LLaMA under a device budget below the model (chunks move
every step; SFTConfig's gradient checkpointing recomputes inside backward). Against plain
``SFTTrainer`` with the same ``SFTConfig``, at one rank and at two (plain: DDP over gloo): the same
losses and learning rates bit for bit (no clipping acting), the logged norm within 1e-6 (see
``test_hf_trainer``), the same adapter weights; ``save_model`` writes the adapter, which PEFT loads
onto a fresh base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.hf_trainer_helpers import assert_same_training, dataset, logged, plugin, training_args
from support.models import VOCAB, llama
from support.trl_helpers import torchrun_rank

# SFTConfig turns on gradient checkpointing: recomputation needs more room than one op.
BUDGET = 600_000


def sft_parts(out: Path, name: str, **overrides: Any) -> dict[str, Any]:
    """SFTTrainer's arguments but the model: a word-level tokenizer over the test vocabulary,
    token rows, a LoRA config on q and v, and ``test_hf_trainer``'s arguments as an SFTConfig."""
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t0", unk_token="t1")
    rows = Dataset.from_dict({"input_ids": [row["input_ids"].tolist() for row in dataset(n=32)]})
    # fp32 (SFTConfig defaults to bf16); no clipping acting: the same arithmetic as plain TRL.
    args = training_args(out / name, cls=SFTConfig, max_grad_norm=0.0, bf16=False, **overrides)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    return {"args": args, "train_dataset": rows, "processing_class": tokenizer, "peft_config": lora}


def train_both(out: Path, **overrides: Any) -> dict[str, Any]:
    """Plain SFTTrainer, then chunkmem's, on the same arguments; what each logged and trained.
    Every rank calls it (``save_model`` of the adapter too)."""
    from trl import SFTTrainer

    from chunkmem.integrations.hf import ChunkTrainerMixin

    class ChunkSFTTrainer(ChunkTrainerMixin, SFTTrainer):
        pass

    plain = SFTTrainer(model=llama(), **sft_parts(out, "plain", **overrides))
    plain.train()
    chunked = ChunkSFTTrainer(model=llama(), plugin=plugin(BUDGET), **sft_parts(out, "chunked", **overrides))
    chunked.train()
    chunked.save_model(str(out / "adapter"))
    stats = chunked.model.stats()
    state = chunked.model.state_dict()
    expected = plain.model.state_dict()  # the PEFT model, unwrapped from DDP
    adapter = sorted(name for name in state if "lora_" in name)
    return {
        "world_size": plain.args.world_size,
        "plain": logged(plain),
        "chunked": logged(chunked),
        "adapter_names": adapter,
        "same_adapter": [name for name in adapter if not torch.equal(state[name], expected[name].cpu())],
        "peak_device_bytes": stats.peak_device_bytes,
        "evictions": stats.evictions,
        "adapter": {name: state[name] for name in adapter},
    }


def assert_trained_like_plain_trl(result: dict[str, Any], out: Path) -> None:
    from peft import PeftModel

    assert_same_training(result["chunked"], result["plain"], exact=True)
    assert result["adapter_names"], "the adapter has parameters"
    assert result["same_adapter"] == [], "adapter weights differ from plain TRL's"
    assert result["peak_device_bytes"] <= BUDGET
    assert result["evictions"] > 0, "the budget must move chunks"
    adapted = dict(PeftModel.from_pretrained(llama(), out / "adapter").named_parameters())
    for name, value in result["adapter"].items():
        assert torch.equal(adapted[name], value), name


@pytest.mark.slow  # the fast tier's case: the Trainer's losses, gradient-checkpointing-label-smoothing-exact
def test_sft_trainer_with_lora_same_losses(tmp_path: Path) -> None:
    result = train_both(tmp_path)
    assert result["world_size"] == 1
    assert_trained_like_plain_trl(result, tmp_path)


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    with torchrun_rank(rank, world_size):
        return train_both(Path(root), ddp_backend="gloo")


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.multirank
def test_sft_trainer_with_lora_at_two_ranks_same_losses_as_plain_trl_with_ddp(tmp_path: Path) -> None:
    """Each rank trains on its half of each batch; plain TRL adds the ranks' gradients with DDP."""
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path),))
    for result in results:
        assert result["world_size"] == 2, "the trainers must see both ranks"
        assert_trained_like_plain_trl(result, tmp_path)
