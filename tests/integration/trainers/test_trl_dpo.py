"""TRL's ``DPOTrainer`` under chunkmem (issue 44): ``class ChunkDPOTrainer(ChunkTrainerMixin,
DPOTrainer)`` with an explicit ``ref_model`` boosts the reference beside the policy under the same
device budget (the trainer's ``ref_model`` becomes the boosted frozen model); with a PEFT LoRA policy
and no ``ref_model`` the reference is the policy with its adapter off, as in plain TRL, no second
copy. Against plain ``DPOTrainer`` on the same arguments: the same losses and learning rates bit for
bit (no clipping acting), the same trained weights; the reference's values never change and the
budget holds with both models' chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_trainer_helpers import assert_same_training, logged, training_args
from support.models import VOCAB, llama
from support.trl_dpo_helpers import word_tokenizer

from chunkmem import ChunkedModel, ChunkPlugin
from chunkmem.placement import StaticPlacementConfig

# Below either model's ~300 KiB of fp32 chunks (every chunk at rest on the host): the chunks of both
# move every step. DPOConfig checkpoints activations: recomputation needs more than one op's room.
BUDGET = 200_000


def plugin() -> ChunkPlugin:
    placement = StaticPlacementConfig(device_budget=BUDGET, offload_param_frac=1.0, offload_optim_frac=1.0)
    return ChunkPlugin(placement, chunk_size=8192, precision="fp32")


def dpo_parts(out: Path, name: str, **overrides: Any) -> dict[str, Any]:
    """DPOTrainer's arguments but the models: a word-level tokenizer (``word_tokenizer``), text
    preference rows, ``test_hf_trainer``'s arguments as a DPOConfig (fp32, no clipping acting)."""
    from datasets import Dataset
    from trl import DPOConfig

    g = torch.Generator().manual_seed(3)

    def text(n: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=g))

    rows = [{"prompt": text(4) + " ", "chosen": text(5) + " t0", "rejected": text(3) + " t0"} for _ in range(16)]
    settings = {"max_steps": 2, **overrides}
    args = training_args(out / name, cls=DPOConfig, max_grad_norm=0.0, bf16=False, **settings)
    return {"args": args, "train_dataset": Dataset.from_list(rows), "processing_class": word_tokenizer()}


def reference_model() -> torch.nn.Module:
    return llama(seed=5)  # values of its own: a reference mixed up with the policy would show


def chunk_dpo_trainer() -> type:
    from trl import DPOTrainer

    from chunkmem.integrations.hf import ChunkTrainerMixin

    class ChunkDPOTrainer(ChunkTrainerMixin, DPOTrainer):
        pass

    return ChunkDPOTrainer


@pytest.mark.slow
def test_dpo_trainer_with_reference_model_same_losses_as_plain_trl(tmp_path: Path) -> None:
    from trl import DPOTrainer

    plain = DPOTrainer(model=llama(), ref_model=reference_model(), **dpo_parts(tmp_path, "plain"))
    plain.train()
    initial_reference = reference_model().state_dict()
    chunked = chunk_dpo_trainer()(
        model=llama(), ref_model=reference_model(), plugin=plugin(), **dpo_parts(tmp_path, "chunked")
    )
    reference = chunked.ref_model
    assert isinstance(reference, ChunkedModel) and reference.is_frozen, "the reference is boosted beside the policy"
    assert reference in chunked.model.frozen_models
    chunked.train()
    assert_same_training(logged(chunked), logged(plain), exact=True)
    state, expected = chunked.model.state_dict(), plain.model.state_dict()
    assert [n for n in expected if not torch.equal(state[n], expected[n].cpu())] == [], "policy weights differ"
    reference_state = reference.state_dict()
    assert [n for n, v in initial_reference.items() if not torch.equal(reference_state[n], v)] == [], "changed"
    stats = chunked.model.stats()
    assert stats.peak_device_bytes <= BUDGET, "the budget covers the policy and its reference"
    both = sum(c.layout.gathered_bytes for c in (*chunked.model.chunks, *reference.chunks))
    assert both > BUDGET and stats.evictions > 0, "both models' chunks could not stay on the device"


@pytest.mark.slow
def test_dpo_trainer_with_lora_reference_is_the_base_with_the_adapter_off(tmp_path: Path) -> None:
    from peft import LoraConfig
    from trl import DPOTrainer

    def lora() -> LoraConfig:
        targets = ["q_proj", "v_proj"]
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")

    once = {"gradient_accumulation_steps": 1}  # the accumulating case is the explicit reference's
    plain = DPOTrainer(model=llama(), peft_config=lora(), **dpo_parts(tmp_path, "plain", **once))
    plain.train()
    chunked = chunk_dpo_trainer()(
        model=llama(), peft_config=lora(), plugin=plugin(), **dpo_parts(tmp_path, "chunked", **once)
    )
    assert not chunked.model.frozen_models, "no second copy: the reference is the policy with its adapter off"
    chunked.train()
    assert_same_training(logged(chunked), logged(plain), exact=True)
    state, expected = chunked.model.state_dict(), plain.model.state_dict()
    adapter = [n for n in expected if "lora_" in n]
    assert adapter and [n for n in adapter if not torch.equal(state[n], expected[n].cpu())] == []
