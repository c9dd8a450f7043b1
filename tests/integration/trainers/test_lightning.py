"""``ChunkStrategy`` (chunkmem.integrations.lightning) against plain Lightning on the CPU: the same
``LightningModule`` and data trained by ``Trainer(strategy="auto")`` and by
``Trainer(strategy=ChunkStrategy(...))`` under a device budget below what the model needs, with
gradient accumulation, an LR schedule, norm clipping, a checkpoint and a resume; and what the
strategy refuses at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from chunkmem import ChunkedModel, NotSupportedError

# ``lightning_models.Regressor`` has a ``validation_step`` for the tests that validate; the others pass no validation
# loader on purpose. Lightning's warning about it is of a class defined in lightning, which
# pytest-xdist's controller process would import (seconds, in a process that runs no test) to
# report it.
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


def chunked_of(run: Any) -> ChunkedModel:
    model = run.strategy.model
    assert isinstance(model, ChunkedModel)
    return model


def assert_tight(model: ChunkedModel) -> None:
    from support.lightning_models import BUDGET

    stats = model.stats()
    assert len(model.manager.chunks) >= 3
    assert stats.evictions > 0, "the budget evicted nothing: it is not tight"
    assert stats.peak_device_bytes <= BUDGET


def test_same_losses_as_plain_lightning_bit_for_bit_with_accumulation_and_schedule(tmp_path: Path) -> None:
    """fp32 at world size 1 is the same arithmetic on each side (the gradients land in chunk buffers
    and AdamW updates flat pieces of the same values, elementwise): every loss and every final
    weight is equal, bit for bit; so are the validation losses (the sanity check, every epoch's
    validation, and ``trainer.validate`` after fit, which uses the model fit boosted).
    ``ModelCheckpoint`` keeps the latest checkpoint: the first epoch's is written, then removed when
    the second is."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from support.lightning_models import STEPS_PER_EPOCH, chunk_strategy, fit, validation_loader

    reference, plain = fit("auto", validate=True, accumulate_grad_batches=2)
    module, run = fit(
        chunk_strategy(),
        validate=True,
        accumulate_grad_batches=2,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path)],
    )
    assert [p.name for p in tmp_path.iterdir()] == [f"epoch=1-step={STEPS_PER_EPOCH}.ckpt"]
    assert (tmp_path / f"epoch=1-step={STEPS_PER_EPOCH}.ckpt" / "trainer.ckpt").is_file()
    assert len(reference.losses) == 2 * STEPS_PER_EPOCH
    assert module.losses == reference.losses
    plain.validate(reference, validation_loader(), verbose=False)
    run.validate(module, validation_loader(), verbose=False)
    assert len(reference.val_losses) == 4 * 2  # sanity check, two epochs, validate
    assert module.val_losses == reference.val_losses
    assert run.global_step == plain.global_step == STEPS_PER_EPOCH  # optimizer steps: 16 micro-batches / 2
    assert run.lr_scheduler_configs[0].scheduler.get_last_lr() == plain.lr_scheduler_configs[0].scheduler.get_last_lr()
    chunked = chunked_of(run)
    expected = reference.state_dict()
    for name, value in chunked.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert_tight(chunked)


def test_norm_clipping_matches_plain_lightning_within_a_stated_bound() -> None:
    """With ``gradient_clip_val`` the clipping coefficient comes from a norm computed two ways:
    torch takes the fp32 norm of the per-parameter norms, chunkmem sums each chunk's squared norm in
    float64 over the rank's shards. They can differ in the last bit of fp32, and so can every clipped
    update after that: the losses agree to 1e-6 relative, the weights to 1e-6 absolute (they are of
    order 0.1-1). The clipped run differs from the unclipped one, so clipping did happen."""
    from support.lightning_models import chunk_strategy, fit

    unclipped, _ = fit("auto", epochs=1, accumulate_grad_batches=2)
    reference, _ = fit("auto", epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.3)
    module, run = fit(chunk_strategy(), epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.3)
    assert reference.losses != pytest.approx(unclipped.losses, rel=1e-3)
    assert module.losses == pytest.approx(reference.losses, rel=1e-6)
    expected = reference.state_dict()
    for name, value in chunked_of(run).state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow  # the fast tier's case: the README loop's resume (test_checkpoint.py)
def test_save_at_step_k_and_resume_gives_the_uninterrupted_losses(tmp_path: Path) -> None:
    """One epoch (k = 4 optimizer steps), ``trainer.save_checkpoint``, then a new module, Trainer and
    strategy resume with ``ckpt_path=`` for the second epoch: the losses are those of plain
    Lightning's uninterrupted two epochs, bit for bit (the previous test shows chunkmem's
    uninterrupted run is), so the weights, AdamW's states, the step count and the LR schedule all
    came back. A weights-only checkpoint of the result validates like plain Lightning's model."""
    from support.lightning_models import (
        STEPS_PER_EPOCH,
        Regressor,
        chunk_strategy,
        fit,
        trainer,
        validation_loader,
    )

    reference, _ = fit("auto", accumulate_grad_batches=2)
    first, run = fit(chunk_strategy(), epochs=1, accumulate_grad_batches=2)
    path = tmp_path / "k.ckpt"
    run.save_checkpoint(path)
    assert sorted(p.name for p in path.iterdir() if not p.name.endswith(".json")) == [
        "model",
        "optimizer",
        "trainer.ckpt",
    ]
    second, resumed = fit(chunk_strategy(), ckpt_path=path, accumulate_grad_batches=2)
    assert first.losses + second.losses == reference.losses
    assert resumed.global_step == STEPS_PER_EPOCH
    assert_tight(chunked_of(resumed))
    # A weights-only checkpoint holds no optimizer; a fresh module and strategy validate from it.
    weights = tmp_path / "weights.ckpt"
    resumed.save_checkpoint(weights, weights_only=True)
    assert sorted(p.name for p in weights.iterdir() if not p.name.endswith(".json")) == ["model", "trainer.ckpt"]
    fresh = Regressor()
    trainer(chunk_strategy(), 1).validate(fresh, validation_loader(), ckpt_path=weights, verbose=False)
    trainer("auto", 1).validate(reference, validation_loader(), verbose=False)
    assert fresh.val_losses == reference.val_losses


# --- refusals ----------------------------------------------------------------------------------
# The module's class (a name in ``lightning_models``), the Trainer's arguments, what the refusal names.
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "manual optimization": ("Manual", {}, "manual optimization"),
    "clip by value": ("Regressor", {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, "'value'"),
    "bf16-true": ("Regressor", {"precision": "bf16-true"}, "precision='bf16-true'"),
    "64-true": ("Regressor", {"precision": "64-true"}, "precision='64-true'"),
    "own backward": ("OwnBackward", {}, "OwnBackward.backward overridden"),
    "sync_batchnorm": ("Regressor", {"sync_batchnorm": True}, "sync_batchnorm=True"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_at_start_naming_the_setting(case: str) -> None:
    """Refused in setup, before any parameter moves into a chunk: the module is left as it was."""
    from support.lightning_models import CHUNK, loader, trainer

    from chunkmem.integrations.lightning import ChunkStrategy

    class_name, kwargs, named = REFUSED[case]
    from support import lightning_models

    module = getattr(lightning_models, class_name)()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    run = trainer(ChunkStrategy(chunk_size=CHUNK), 1, **kwargs)
    with pytest.raises(NotSupportedError, match="refused") as refused:
        run.fit(module, loader())
    assert named in str(refused.value)
    assert module.losses == []
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_a_loss_scale_without_fp16_is_refused_at_start() -> None:
    """``ChunkStrategy(loss_scale=...)`` under a precision with no loss scaling (fp32 here) would be
    a setting nothing reads: refused in setup, naming the Trainer's precision and the fix."""
    from support.lightning_models import CHUNK, Regressor, loader, trainer

    from chunkmem.integrations.lightning import ChunkStrategy

    module = Regressor()
    run = trainer(ChunkStrategy(chunk_size=CHUNK, loss_scale={"initial_scale": 1024}), 1)
    with pytest.raises(NotSupportedError, match=r"loss_scale=\.\.\.\) applies to fp16 only.*precision='32-true'"):
        run.fit(module, loader())
    assert module.losses == []
    with pytest.raises(pydantic.ValidationError, match="growth_factor"):
        ChunkStrategy(loss_scale={"growth_factor": 0.5})


def test_several_processes_without_a_launcher_are_refused() -> None:
    """``devices=2`` with no process group and no torchrun: the strategy launches nothing, so it
    would otherwise train one rank as if it were the whole job."""
    import lightning as L
    from support.lightning_models import CHUNK, Regressor, loader

    from chunkmem.integrations.lightning import ChunkStrategy

    run = L.Trainer(strategy=ChunkStrategy(chunk_size=CHUNK), accelerator="cpu", devices=2, max_epochs=1, logger=False)
    with pytest.raises(NotSupportedError, match=r"devices=2\) refused"):
        run.fit(Regressor(), loader())


# --- world size 2 -------------------------------------------------------------------------------
def _fit_on_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """On every rank of the pooled gloo group: plain DDP for two epochs; ChunkStrategy for one, a
    (sharded) checkpoint, and a resume for the second. Both take the ranks from the existing
    process group and shard the data with Lightning's DistributedSampler."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from support.lightning_models import Regressor, chunk_strategy, loader

    from chunkmem.integrations.lightning import ProcessGroupEnvironment

    def run(strategy: Any, epochs: int, ckpt_path: Path | None = None) -> tuple[Regressor, L.Trainer]:
        module = Regressor()
        run = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world_size,
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accumulate_grad_batches=2,
        )
        run.fit(module, loader(), ckpt_path=ckpt_path)
        return module, run

    ddp, _ = run(DDPStrategy(cluster_environment=ProcessGroupEnvironment()), 2)
    first, interrupted = run(chunk_strategy(), 1)
    path = Path(directory) / "k.ckpt"
    interrupted.save_checkpoint(path)
    second, resumed = run(chunk_strategy(), 2, path)
    chunked = chunked_of(resumed)
    assert_tight(chunked)
    return {
        "ddp": ddp.losses,
        "chunkmem": first.losses + second.losses,
        "ddp_state": ddp.state_dict(),
        "state": chunked.state_dict(),
        "sharded": (path / "model").is_dir() and (path / "optimizer").is_dir(),
        "steps": resumed.global_step,
    }


@pytest.mark.multirank
def test_two_ranks_match_plain_ddp_through_a_sharded_checkpoint(tmp_path: Path) -> None:
    """At W=2 each rank's micro-batch losses equal plain DDP's, bit for bit: DDP averages each
    gradient as a/2 + b/2, chunkmem's reduce-scatter as (a + b)/2, which are the same number in fp32
    (halving is exact), and the rest is the W=1 arithmetic. The run is interrupted after one epoch by a
    sharded checkpoint (every rank writes its own pieces) and resumed from it."""
    from support.distributed import run_ranks
    from support.lightning_models import STEPS_PER_EPOCH

    results = run_ranks(_fit_on_ranks, world_size=2, args=(str(tmp_path),))
    for result in results:
        assert len(result["ddp"]) == STEPS_PER_EPOCH  # 4 micro-batches per rank and epoch
        assert result["chunkmem"] == result["ddp"]
        assert result["sharded"]
        assert result["steps"] == STEPS_PER_EPOCH // 2
        for name, value in result["state"].items():
            assert torch.equal(value, result["ddp_state"][name]), name
    assert results[0]["ddp"] != results[1]["ddp"]  # the ranks saw different data


def _fit_with_dropout(rank: int, world_size: int) -> dict[str, Any]:
    """On every rank, as a script does: ``seed_everything``, build the module, fit; plain DDP, then
    ChunkStrategy. Building the module draws from the RNG after the seed was set."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from support.lightning_models import DropoutRegressor, chunk_strategy, fit

    from chunkmem.integrations.lightning import ProcessGroupEnvironment

    L.seed_everything(7, verbose=False)
    ddp, _ = fit(
        DDPStrategy(cluster_environment=ProcessGroupEnvironment()),
        epochs=1,
        module_class=DropoutRegressor,
        devices=world_size,
    )
    L.seed_everything(7, verbose=False)
    module, run = fit(chunk_strategy(), epochs=1, module_class=DropoutRegressor, devices=world_size)
    return {
        "ddp": ddp.losses,
        "chunkmem": module.losses,
        "ddp_state": ddp.state_dict(),
        "state": chunked_of(run).state_dict(),
    }


@pytest.mark.multirank
def test_two_ranks_with_dropout_draw_the_masks_plain_ddp_draws(tmp_path: Path) -> None:
    """DDPStrategy resets each rank's RNG to ``seed_everything``'s seed in its distributed setup;
    so does ChunkStrategy at W>1: with dropout on, every rank's losses and the final weights equal
    plain DDP's bit for bit (without the reset, the masks come from where building the module left
    the RNG)."""
    from support.distributed import run_ranks
    from support.lightning_models import STEPS_PER_EPOCH

    results = run_ranks(_fit_with_dropout, world_size=2)
    for result in results:
        assert len(result["ddp"]) == STEPS_PER_EPOCH // 2
        assert result["chunkmem"] == result["ddp"]
        for name, value in result["state"].items():
            assert torch.equal(value, result["ddp_state"][name]), name


@pytest.mark.slow  # the fast tier's case: the losses at one rank bit for bit, without dropout
def test_one_rank_with_dropout_draws_the_masks_plain_lightning_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one rank plain Lightning's strategy is SingleDeviceStrategy, which does not reset the RNG:
    nor does ChunkStrategy, so after ``seed_everything`` and building the module the dropout masks,
    the losses and the weights are plain Lightning's, bit for bit."""
    import lightning as L
    from support.lightning_models import DropoutRegressor, chunk_strategy, fit

    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # put back after the test: seed_everything sets them
        monkeypatch.setenv(name, "0")
    L.seed_everything(7, verbose=False)
    reference, _ = fit("auto", epochs=1, module_class=DropoutRegressor)
    L.seed_everything(7, verbose=False)
    module, run = fit(chunk_strategy(), epochs=1, module_class=DropoutRegressor)
    assert module.losses == reference.losses
    expected = reference.state_dict()
    for name, value in chunked_of(run).state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_second_fit_of_a_boosted_module_is_refused() -> None:
    """Its parameters live in chunks: ``configure_optimizers`` would build an optimizer over
    placeholders. The refusal comes before any step, so the losses of the first fit stay as they were."""
    from support.lightning_models import chunk_strategy, fit, loader

    module, run = fit(chunk_strategy(), epochs=1)
    steps = len(module.losses)
    with pytest.raises(NotSupportedError, match=r"second trainer\.fit"):
        run.fit(module, loader())
    assert len(module.losses) == steps


def test_bf16_mixed_computes_in_bf16_within_tolerance_of_fp32() -> None:
    """``Trainer(precision="bf16-mixed")`` is chunkmem's bf16 compute (fp32 masters): every loss is a
    bf16 number, within 5% of plain fp32 Lightning's over 8 steps (bf16 keeps 8 bits of mantissa)."""
    from support.lightning_models import chunk_strategy, fit

    reference, _ = fit("auto", epochs=1)
    module, _ = fit(chunk_strategy(), epochs=1, precision="bf16-mixed")
    assert all(torch.tensor(loss).bfloat16().item() == loss for loss in module.losses)
    assert not all(torch.tensor(loss).bfloat16().item() == loss for loss in reference.losses)
    assert module.losses == pytest.approx(reference.losses, rel=5e-2)
