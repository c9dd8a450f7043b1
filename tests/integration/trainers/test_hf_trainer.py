"""``transformers.Trainer`` under chunkmem (``chunkmem.integrations.hf.ChunkTrainer``).

The reference is plain ``Trainer`` with the same ``TrainingArguments`` on the same model and data.
Where the arithmetic is the same, the logged losses and learning rates of every step are equal bit
for bit: chunkmem's fp32 masters step with the same AdamW, micro-batch gradients are added as
``.grad`` adds them, and at two ranks DDP's halved gradients summed equal chunkmem's sum halved.
The gradient norm is computed another way (chunkmem takes each shard's norm over rows of 4096
values and adds them in float64, torch stacks per-tensor norms in fp32), so the logged norm is
compared within 1e-6 relative. It is the same arithmetic while the norm is below
``max_grad_norm`` (``max_grad_norm=0`` computes it without clipping): the factor is then exactly
1. Once clipping acts, the factor ``max_norm / (norm + 1e-6)`` inherits the norm's last-bit
difference, and AdamW's update, invariant to a gradient's scale but for its ``eps``, passes
some of it on: losses then agree within 1e-6 relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from support.distributed import run_ranks
from support.hf_trainer_helpers import BUDGET, RTOL, assert_same_training, dataset, logged, plugin, training_args
from support.models import gpt2, llama, tolerance

import chunkmem.plugin
from chunkmem import ChunkPlugin, NotSupportedError
from chunkmem.placement import AutoPlacementConfig
from chunkmem.ranks.comm import Communicator

# transformers' Trainer (and chunkmem.integrations.hf, which imports it) is imported by the tests
# that use it: it imports accelerate and datasets, seconds in every pytest-xdist worker collecting
# this module, and test_trl imports this module's helpers.
if TYPE_CHECKING:
    pass


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny models on a shared 2-core machine: several threads per op cost 10x more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


def gpt2_with_dropout() -> torch.nn.Module:
    return gpt2(**DROPOUT)


def lora_llama_with_dropout() -> torch.nn.Module:
    """A PEFT model, as a user hands it to Trainer: Trainer looks through ``PeftModel`` to the base
    model's class wherever it decides by the model's class."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, task_type="CAUSAL_LM")
    return get_peft_model(llama(attention_dropout=0.1), lora)


@pytest.mark.parametrize(
    "model, overrides, budget, exact",
    [
        pytest.param(gpt2, {}, BUDGET, False, id="accumulate-clip-schedule", marks=pytest.mark.slow),
        # Recomputation runs forward ops inside backward ones: both need their chunks at once.
        # No clipping: the same arithmetic, so the same losses bit for bit. Dropout on: the same
        # masks, in the recomputation too. Label smoothing: Trainer shifts a causal LM's labels
        # when the model it unwraps is one by its class name (unshifted, the loss trains each
        # position to predict itself).
        pytest.param(
            gpt2_with_dropout,
            {"gradient_checkpointing": True, "max_grad_norm": 0.0, "label_smoothing_factor": 0.1},
            300_000,
            True,
            id="gradient-checkpointing-label-smoothing-exact",
        ),
        # A PeftModel: Trainer looks through it to LlamaForCausalLM for the shift, and to the base
        # model's input embeddings for NEFTune's noise; dropout in the adapter and the attention.
        pytest.param(
            lora_llama_with_dropout,
            {"max_grad_norm": 0.0, "label_smoothing_factor": 0.1, "neftune_noise_alpha": 5.0},
            600_000,
            True,
            id="peft-label-smoothing-neftune-exact",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_same_losses_as_plain_trainer(
    tmp_path: Path, model: Callable[[], torch.nn.Module], overrides: dict[str, Any], budget: int, exact: bool
) -> None:
    from transformers import Trainer

    from chunkmem.integrations.hf import ChunkTrainer

    data, held_out = dataset(), dataset(n=4, seed=2)
    overrides = {"eval_strategy": "steps", "eval_steps": 2, **overrides}
    plain = Trainer(
        model=model(), args=training_args(tmp_path / "plain", **overrides), train_dataset=data, eval_dataset=held_out
    )
    plain.train()
    chunked = ChunkTrainer(
        model=model(),
        args=training_args(tmp_path / "chunked", **overrides),
        train_dataset=data,
        eval_dataset=held_out,
        plugin=plugin(budget),
    )
    result = chunked.train()

    assert_same_training(logged(chunked), logged(plain), exact)
    evaluated = [line["eval_loss"] for line in chunked.state.log_history if "eval_loss" in line]
    reference = [line["eval_loss"] for line in plain.state.log_history if "eval_loss" in line]
    assert len(evaluated) == len(reference) >= 1
    for got, want in zip(evaluated, reference, strict=True):
        assert math.isclose(got, want, rel_tol=0 if exact else RTOL), (evaluated, reference)
    assert math.isclose(result.training_loss, plain.state.log_history[-1]["train_loss"], rel_tol=0 if exact else RTOL)
    if exact:
        trained, expected = chunked.model.state_dict(), plain.model.state_dict()
        assert sorted(trained) == sorted(expected)
        assert [name for name in expected if not torch.equal(trained[name], expected[name])] == []
    stats = chunked.model.stats()
    assert stats.optimizer_steps == 3
    assert stats.peak_device_bytes <= budget
    assert stats.evictions > 0, "the budget must be tight enough to move chunks"


def test_computes_where_training_arguments_say_not_on_the_machines_accelerator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``use_cpu=True`` on a GPU machine: Trainer puts the model, each batch and its loss
    accumulator on the CPU, so ChunkTrainer computes there too, not on the GPU the plugin would pick
    by itself, and in the CPU's default precision (fp32) where the plugin's is left unset, not the
    GPU's (bf16). The machine's own choice is made a device nothing can compute on (``meta``), as a
    GPU is to this CPU run: training takes it only if ChunkTrainer ignores TrainingArguments."""
    from transformers import Trainer

    from chunkmem.integrations.hf import ChunkTrainer

    monkeypatch.setattr(chunkmem.plugin, "compute_device", lambda: torch.device("meta"))
    with monkeypatch.context() as gpu_machine:  # one with bf16, while the plugin is built
        gpu_machine.setattr(torch.cuda, "is_available", lambda: True)
        gpu_machine.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        default_precision = ChunkPlugin(placement=AutoPlacementConfig(device_budget=BUDGET), chunk_size=8192)
    assert default_precision.precision == "bf16", "the default for the GPU the plugin would pick"
    data = dataset(n=4)
    overrides = {"max_steps": 1, "gradient_accumulation_steps": 1}
    plain = Trainer(model=gpt2(n_layer=1), args=training_args(tmp_path / "plain", **overrides), train_dataset=data)
    plain.train()
    chunked = ChunkTrainer(
        model=gpt2(n_layer=1),
        args=training_args(tmp_path / "chunked", **overrides),
        train_dataset=data,
        plugin=default_precision,
    )
    assert chunked.model.compute_device == chunked.args.device == torch.device("cpu")
    assert all(chunk.layout.compute_dtype == torch.float32 for chunk in chunked.model.manager.chunks)
    chunked.train()
    assert_same_training(logged(chunked), logged(plain), exact=True)


@pytest.mark.cuda
def test_on_a_gpu_computes_on_the_gpu_like_plain_trainer(tmp_path: Path) -> None:
    """Without ``use_cpu`` Trainer computes on the GPU, and so does ChunkTrainer: the same losses,
    learning rates and norms as plain Trainer there, under a budget that moves chunks."""
    from transformers import Trainer

    from chunkmem.integrations.hf import ChunkTrainer

    if torch.cuda.device_count() > 1:
        pytest.skip("plain Trainer would run torch.nn.DataParallel over several GPUs (refused under chunkmem)")
    data = dataset()
    plain = Trainer(model=gpt2(), args=training_args(tmp_path / "plain", use_cpu=False), train_dataset=data)
    plain.train()
    chunked = ChunkTrainer(
        model=gpt2(), args=training_args(tmp_path / "chunked", use_cpu=False), train_dataset=data, plugin=plugin()
    )
    assert plain.args.device.type == "cuda"
    assert chunked.model.compute_device == chunked.args.device == plain.args.device
    chunked.train()
    # RTOL for what differs by design (module docstring), widened where chunkmem's AdamW steps
    # masters on the host while plain Trainer's steps on the GPU (DEVICE_TOLERANCE).
    assert_same_training(logged(chunked), logged(plain), exact=False, rtol=tolerance(chunked.model, rtol=RTOL).rtol)
    stats = chunked.model.stats()
    assert stats.peak_device_bytes <= BUDGET
    assert stats.evictions > 0, "the budget must be tight enough to move chunks"


def test_a_communicator_on_another_device_than_training_arguments_is_refused(tmp_path: Path) -> None:
    """A plugin whose Communicator already chose a device other than Trainer's cannot follow
    TrainingArguments: refused before boosting, naming both devices."""
    from chunkmem.integrations.hf import ChunkTrainer

    model = gpt2(n_layer=1, n_embd=32)
    elsewhere = ChunkPlugin(
        placement=AutoPlacementConfig(device_budget=BUDGET),
        chunk_size=8192,
        precision="fp32",
        process_group=Communicator(None, torch.device("meta")),
    )
    with pytest.raises(NotSupportedError, match=r"Communicator computes on meta, but the trainer computes on cpu"):
        ChunkTrainer(model=model, args=training_args(tmp_path), train_dataset=dataset(4), plugin=elsewhere)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters()), "refused before boosting"


@pytest.mark.slow  # the fast tier's case: the Trainer's losses, gradient-checkpointing-label-smoothing-exact
def test_checkpoint_resume_and_save_model(tmp_path: Path) -> None:
    """``save_steps`` writes chunkmem's checkpoint in checkpoint-N; resuming there gives the
    uninterrupted run's later steps exactly; ``save_total_limit`` removes the older checkpoints;
    ``save_model``, and ``save_pretrained`` on what the accelerator unwraps, write what
    ``from_pretrained`` loads."""
    from transformers import GPT2LMHeadModel

    from chunkmem.integrations.hf import CHECKPOINT_DIR, ChunkTrainer

    data = dataset()
    full = ChunkTrainer(
        model=gpt2(),
        args=training_args(tmp_path / "full", max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=data,
        plugin=plugin(),
    )
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    for name in ("model.pt", "optimizer.pt", "scheduler.pt"):
        assert (checkpoint / CHECKPOINT_DIR / name).is_file(), name
    assert (checkpoint / "trainer_state.json").is_file()

    # Other initial weights: everything the later steps depend on must come from the checkpoint.
    resumed = ChunkTrainer(
        model=gpt2(seed=7),
        args=training_args(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1),
        train_dataset=data,
        plugin=plugin(),
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    expected = logged(full, after=2)
    assert len(expected) == 2
    assert [line["loss"] for line in logged(resumed, after=2)] == [line["loss"] for line in expected]
    assert logged(resumed, after=2) == expected  # the same arithmetic from the same state: norms too
    assert [p.name for p in (tmp_path / "resumed").glob("checkpoint-*")] == ["checkpoint-4"]
    assert (tmp_path / "resumed" / "checkpoint-4" / CHECKPOINT_DIR / "model.pt").is_file()

    # Trainer's save_model, and Accelerate's way after training: save_pretrained on what
    # unwrap_model gives (the boosted model, which gathers the chunks, as DDP gives the module).
    state = full.model.state_dict()
    for export in (tmp_path / "export", tmp_path / "unwrapped"):
        if export.name == "export":
            full.save_model(str(export))
        else:
            full.accelerator.unwrap_model(full.model).save_pretrained(export)
        loaded = GPT2LMHeadModel.from_pretrained(export)
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, state[name]), name
        assert set(state) <= set(loaded.state_dict())


REFUSED = [
    ({"torch_compile": True}, "torch_compile"),
    ({"fsdp": "full_shard"}, "fsdp"),
    ({"fp16": True}, "fp16"),
    ({"bf16": True}, "bf16"),
    ({"bf16_full_eval": True}, "bf16_full_eval"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}, "load_best_model_at_end"),
    ({"save_on_each_node": True}, "save_on_each_node"),
    ({"optim": "adafactor"}, "optim"),
]


@pytest.mark.parametrize("overrides, field", REFUSED, ids=[field for _, field in REFUSED])
def test_refused_at_start(tmp_path: Path, overrides: dict[str, Any], field: str) -> None:
    from chunkmem.integrations.hf import ChunkTrainer

    model = gpt2(n_layer=1, n_embd=32)
    with pytest.raises(NotSupportedError, match=rf"TrainingArguments\.{field}=") as error:
        ChunkTrainer(model=model, args=training_args(tmp_path, **overrides), train_dataset=dataset(4), plugin=plugin())
    assert "not supported under chunkmem" in str(error.value)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters()), "refused before boosting"


def test_refused_deepspeed_and_model_init(tmp_path: Path) -> None:
    from chunkmem.integrations.hf import ChunkTrainer

    args = training_args(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 3}}  # building it so needs deepspeed installed
    with pytest.raises(NotSupportedError, match=r"TrainingArguments\.deepspeed="):
        ChunkTrainer(model=gpt2(n_layer=1, n_embd=32), args=args, train_dataset=dataset(4), plugin=plugin())
    with pytest.raises(NotSupportedError, match=r"model_init=\.\.\.\) is not supported"):
        ChunkTrainer(
            model_init=lambda: gpt2(n_layer=1, n_embd=32),
            args=training_args(tmp_path),
            train_dataset=dataset(4),
            plugin=plugin(),
        )


def test_resuming_from_a_checkpoint_chunkmem_did_not_write_is_refused(tmp_path: Path) -> None:
    """A checkpoint-N directory without chunkmem's checkpoint (plain Trainer's, say) is refused at
    resume, naming both layouts looked for, before anything is loaded."""
    from chunkmem.integrations.hf import CHECKPOINT_DIR, ChunkTrainer

    plain_checkpoint = tmp_path / "checkpoint-2"
    plain_checkpoint.mkdir()
    (plain_checkpoint / "model.safetensors").write_bytes(b"")
    trainer = ChunkTrainer(
        model=gpt2(n_layer=1, n_embd=32),
        args=training_args(tmp_path / "out"),
        train_dataset=dataset(4),
        plugin=plugin(),
    )
    with pytest.raises(NotSupportedError, match="holds no chunkmem checkpoint") as refused:
        trainer.train(resume_from_checkpoint=str(plain_checkpoint))
    saved = plain_checkpoint / CHECKPOINT_DIR
    assert f"{saved / 'model.pt'}, which one rank writes" in str(refused.value)
    assert f"{saved / 'model'}, which several ranks write" in str(refused.value)
    assert trainer.state.global_step == 0


# Resuming at another world size: each step trains on the same 8 rows at one rank as at two (the
# sampler's order is seeded by TrainingArguments.seed; each rank takes every other batch of 2), and
# Trainer skips the same 16 rows of the two steps already taken. No clipping (the norm is still
# computed over both ranks and logged): the same arithmetic as plain Trainer.
SAVING = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "max_grad_norm": 0.0}
ONE_RANK = {**SAVING, "per_device_train_batch_size": 4}
TWO_RANKS = {**SAVING, "per_device_train_batch_size": 2, "ddp_backend": "gloo"}


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """On each rank: plain Trainer (DDP over gloo), ChunkTrainer for four steps saving at step
    2 (sharded), a ChunkTrainer resumed from that checkpoint, and one resumed from the checkpoint
    one rank saved (``root/one``)."""
    import os

    from accelerate.state import AcceleratorState
    from transformers import Trainer

    from chunkmem.integrations.hf import CHECKPOINT_DIR, ChunkTrainer

    torch.set_num_threads(1)
    # What torchrun sets; Trainer (through Accelerate) joins the process group that exists.
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": "2"}
    )
    out = Path(root)
    data = dataset(n=32)
    try:
        plain = Trainer(model=gpt2(), args=training_args(out / "plain", **TWO_RANKS), train_dataset=data)
        plain.train()
        full = ChunkTrainer(
            model=gpt2(), args=training_args(out / "full", **TWO_RANKS), train_dataset=data, plugin=plugin()
        )
        full.train()
        stats = full.model.stats()
        trained = full.model.state_dict()
        resumed = {}
        for name, checkpoint in (
            ("resumed", out / "full" / "checkpoint-2"),
            ("from_one", out / "one" / "checkpoint-2"),
        ):
            # Other initial weights: what the later steps depend on must come from the checkpoint.
            trainer = ChunkTrainer(
                model=gpt2(seed=7), args=training_args(out / name, **TWO_RANKS), train_dataset=data, plugin=plugin()
            )
            trainer.train(resume_from_checkpoint=str(checkpoint))
            resumed[name] = (logged(trainer, after=2), trainer.model.state_dict())
        return {
            "world_size": plain.args.world_size,
            "plain": logged(plain),
            "full": logged(full),
            "full_state": trained if rank == 0 else None,
            "resumed": resumed["resumed"][0],
            "from_one": resumed["from_one"][0],
            "from_one_state": resumed["from_one"][1] if rank == 0 else None,
            "checkpoint": sorted(os.listdir(out / "full" / "checkpoint-2" / CHECKPOINT_DIR)),
            "reduce_scatter_bytes": stats.reduce_scatter_bytes,
            "optimizer_steps": stats.optimizer_steps,
            "peak_device_bytes": stats.peak_device_bytes,
            "chunk_bytes": sum(chunk.layout.capacity for chunk in full.model.manager.chunks) * 4,
        }
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# One world size against the other: the same gradients, summed in another order (a micro-batch of
# 4 rows at one rank; two of 2, reduce-scattered, at two). Measured on this test: the losses one
# fp32 ulp apart (9e-8 relative), the final weights within 6.2e-7 between the two uninterrupted runs
# and 2.5e-7 between a resumed run and the uninterrupted one. A resume at one rank that left
# AdamW's moments out fails it by 3e-4 in the next loss.
CROSS_WORLD_WEIGHTS = 5e-6


def assert_close_training(
    actual: list[dict[str, float]],
    actual_state: dict[str, torch.Tensor],
    expected: list[dict[str, float]],
    expected_state: dict[str, torch.Tensor],
) -> None:
    """The same learning rates; the losses within ``RTOL`` and the final weights within
    ``CROSS_WORLD_WEIGHTS`` (absolute) of a run at the other world size."""
    assert len(actual) == len(expected) > 0
    assert [line["learning_rate"] for line in actual] == [line["learning_rate"] for line in expected]
    for got, want in zip(actual, expected, strict=True):
        assert math.isclose(got["loss"], want["loss"], rel_tol=RTOL), (got, want)
    assert sorted(actual_state) == sorted(expected_state)
    for name, value in expected_state.items():
        torch.testing.assert_close(actual_state[name], value, rtol=0, atol=CROSS_WORLD_WEIGHTS, msg=name)


@pytest.mark.long
@pytest.mark.multirank
def test_two_ranks_same_losses_as_ddp_trainer_and_resume_at_either_world_size(tmp_path: Path) -> None:
    """W=2 (gloo): ChunkTrainer's losses equal plain Trainer's with DDP bit for bit (DDP adds the
    ranks' gradients halved, chunkmem halves their sum: both exact for a power of two); micro-batches
    accumulate under no_sync (each chunk reduced once per optimizer step, as DDP's no_sync
    all-reduces once); the sharded checkpoint of step 2 resumes to the same steps 3 and 4. A
    checkpoint saved at one world size resumes at the other: one rank's files at two ranks, the two
    ranks' sharded directories at one."""
    from chunkmem.integrations.hf import ChunkTrainer

    data = dataset(n=32)
    one = ChunkTrainer(
        model=gpt2(), args=training_args(tmp_path / "one", **ONE_RANK), train_dataset=data, plugin=plugin()
    )
    one.train()
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path),))
    from_two = ChunkTrainer(
        model=gpt2(seed=7), args=training_args(tmp_path / "from_two", **ONE_RANK), train_dataset=data, plugin=plugin()
    )
    from_two.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))

    for rank, result in enumerate(results):
        assert result["world_size"] == 2, "Trainer must see both ranks"
        assert_same_training(result["full"], result["plain"], exact=True)
        assert result["resumed"] == result["full"][2:]
        assert result["checkpoint"] == ["model", "optimizer", "scheduler.pt", "scheduler.pt.chunkmem.json"]
        assert result["optimizer_steps"] == 4
        assert result["reduce_scatter_bytes"] == 4 * result["chunk_bytes"], (
            f"rank {rank}: reduced more than once a step"
        )
        assert result["peak_device_bytes"] <= BUDGET
    # Each world size's uninterrupted run against the other's: the bound is what the world size changes.
    two = results[0]
    assert_close_training(logged(one), one.model.state_dict(), two["full"], two["full_state"])
    # Two ranks' sharded checkpoint resumed at one rank, one rank's files at two: the later steps of the
    # uninterrupted run at the world size that saved it, within the same bound.
    assert_close_training(logged(from_two, after=2), from_two.model.state_dict(), two["full"][2:], two["full_state"])
    assert_close_training(two["from_one"], two["from_one_state"], logged(one)[2:], one.model.state_dict())
    assert results[1]["from_one"] == two["from_one"], "the ranks log the same losses"


def test_a_trainers_own_accelerator_class_keeps_its_methods() -> None:
    """A trainer whose Accelerator is a subclass gets chunkmem's routing on top of that subclass."""
    from accelerate import Accelerator

    from chunkmem.integrations.hf_accelerator import ChunkAccelerator, routed_to_chunkmem

    class Own(Accelerator):
        def gather_for_metrics(self, *args: Any, **kwargs: Any) -> str:
            return "own"

    routed = routed_to_chunkmem(Own)
    assert issubclass(routed, ChunkAccelerator) and issubclass(routed, Own)
    assert routed.gather_for_metrics is Own.gather_for_metrics
    assert routed.clip_grad_norm_ is ChunkAccelerator.clip_grad_norm_
    assert routed_to_chunkmem(Accelerator) is ChunkAccelerator
    assert routed_to_chunkmem(routed) is routed
