"""LoRA over a base read from its files (issue 32): ``get_peft_model`` over a LLaMA built on the
meta device, boosted with ``weights=`` the directory the base's ``save_pretrained`` wrote, trains
as plain PEFT over ``from_pretrained`` + ``get_peft_model`` with the same seed, losses and adapter
bit for bit: base parameters found under their base-model names, the adapter initialised by PEFT's
init replayed (the draws it makes after ``from_pretrained``). A bf16 base computed in bf16 with its
shard on disk is read in place (the disk tier writes none of it). A base parameter missing from the
files is refused naming both names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.distributed import run_ranks
from support.models import batches, llama
from support.param_disk_helpers import ON_DISK
from support.peft_helpers import DTYPES, adamw, plain_peft, train

from chunkmem import Booster, ChunkPlugin, MaterializeError
from chunkmem.usage.accounting import Location, MemoryKind

SEED = 7
STEPS = 2


def _lora(model: torch.nn.Module, precision: str = "bf16") -> Any:
    import peft

    # The fp32 runs also train a full copy of the head (``modules_to_save``): its frozen original and
    # its trainable copy both start as the base's ``lm_head.weight``.
    save = ["lm_head"] if precision == "fp32" else None
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, modules_to_save=save
    )
    return peft.get_peft_model(model, config)


def _save_base(directory: Path, precision: str) -> Path:
    llama(seed=3).to(DTYPES[precision]).save_pretrained(directory, safe_serialization=True)
    return directory


def _plain(directory: str, precision: str) -> Any:
    import transformers

    torch.manual_seed(SEED)
    return _lora(transformers.AutoModelForCausalLM.from_pretrained(directory), precision)


def _meta(directory: str, precision: str) -> Any:
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        return _lora(transformers.AutoModelForCausalLM.from_config(config), precision)


def _boosted(rank: int, world_size: int, directory: str, precision: str, steps: int = STEPS) -> dict[str, Any]:
    model = _meta(directory, precision)
    disk_dir = Path(directory) / f"disk-rank{rank}"
    disk_dir.mkdir(exist_ok=True)
    placement = {"placement": ON_DISK, "disk_dir": disk_dir} if precision == "bf16" else {}
    booster = Booster(ChunkPlugin(precision=precision, **placement))
    chunked, optimizer, *_ = booster.boost(model, adamw(model), weights=directory)
    boost_writes = chunked.stats().disk_param_write_bytes
    losses = train(chunked, optimizer, booster, batches(steps), rank, world_size)
    chunks = chunked.manager.chunks
    return {
        "losses": losses,
        "state": chunked.state_dict(),
        "frozen": sum(not c.layout.trainable for c in chunks),
        "in_place": sum(c.store.reads_in_place for c in chunks if not c.layout.trainable),
        "trainable_copy": 2 * sum(c.layout.shard_numel for c in chunks if c.layout.trainable),
        "boost_writes": boost_writes,
        "disk_copies": chunked.manager.ledger.bytes(Location.DISK, MemoryKind.SHARD_COPY),
    }


def _check(results: list[dict[str, Any]], directory: str, precision: str, steps: int = STEPS) -> None:
    expected, reference = plain_peft(
        precision, batches(steps), torch.device("cpu"), len(results), build=lambda: _plain(directory, precision)
    )
    assert any("lora_A" in name for name in reference.state_dict())
    if precision == "fp32":
        assert "base_model.model.lm_head.modules_to_save.default.weight" in reference.state_dict()
    for rank, result in enumerate(results):
        assert result["losses"] == [step[rank] for step in expected], rank
        assert result["state"].keys() == reference.state_dict().keys()
        for name, value in reference.state_dict().items():
            assert torch.equal(result["state"][name].to(value.dtype), value), (rank, name)
        if precision == "bf16":  # the base is read in place: the disk tier writes only the adapter's copies
            assert result["frozen"] > 0 and result["in_place"] == result["frozen"], result
            assert result["boost_writes"] == result["disk_copies"] == result["trainable_copy"], result


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_over_a_base_from_its_files_equals_plain_peft(precision: str, tmp_path: Path) -> None:
    directory = str(_save_base(tmp_path, precision))
    _check([_boosted(0, 1, directory, precision)], directory, precision)


@pytest.mark.slow  # 4 s with the rank pool warm
@pytest.mark.multirank
def test_lora_over_a_base_from_its_files_at_two_ranks(tmp_path: Path) -> None:
    # One step: LoRA B starts at zero, so the step's update of B shows A's initial values, and the adapter after it
    # shows each rank's gradient reduction; two steps are what the W=1 tests train.
    directory = str(_save_base(tmp_path, "bf16"))
    _check(run_ranks(_boosted, 2, args=(directory, "bf16", 1)), directory, "bf16", 1)


def test_a_base_parameter_missing_from_the_files_is_refused_naming_both_names(tmp_path: Path) -> None:
    directory = _save_base(tmp_path, "fp32")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model = _meta(str(directory), "bf16")
    with pytest.raises(MaterializeError) as caught:
        Booster(ChunkPlugin()).boost(model, adamw(model), weights=directory)
    message = str(caught.value)
    assert "'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight'" in message
    assert "'model.layers.0.self_attn.q_proj.weight'" in message
    assert all(p.is_meta for p in model.parameters())  # nothing was changed


def test_a_bf16_base_built_on_meta_gets_the_adapter_peft_gives_on_the_cpu() -> None:
    """Without weights= too: PEFT casts a new adapter to its base layer's dtype on the CPU (a bf16
    base's LoRA A is rounded to bf16, then upcast to fp32) but skips that on the meta device; the
    replay rounds as the CPU build did."""
    import transformers

    torch.manual_seed(SEED)
    cpu = _lora(llama(seed=SEED).to(torch.bfloat16))
    torch.manual_seed(SEED)
    with torch.device("meta"):
        meta = _lora(transformers.LlamaForCausalLM._from_config(cpu.base_model.model.config, dtype=torch.bfloat16))
    chunked, *_ = Booster(ChunkPlugin(precision="bf16")).boost(meta, adamw(meta))
    state = chunked.state_dict()
    expected = cpu.state_dict()
    assert any(n.endswith("lora_A.default.weight") and v.dtype == torch.float32 for n, v in expected.items())
    for name, value in expected.items():
        assert torch.equal(state[name].to(value.dtype), value), name
