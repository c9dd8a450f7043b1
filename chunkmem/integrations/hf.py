"""Hugging Face ``Trainer`` under chunkmem.

``ChunkTrainer(model=..., args=TrainingArguments(...), plugin=ChunkPlugin(...))`` trains as
``Trainer`` does with the user's ``TrainingArguments``: the model and the optimizer Trainer builds
(or the ``optimizers=`` given) are boosted when the trainer is built; Trainer's own loop runs, with
``ChunkAccelerator`` routing backward, ``no_sync`` (gradient accumulation), gradient clipping and
``prepare`` to chunkmem. Checkpoints (``save_steps``) are chunkmem's, inside Trainer's
``checkpoint-N`` directories, sharded at world size > 1; ``save_model`` writes a plain
``save_pretrained`` directory. What cannot be honoured is refused when the trainer is built
(``hf_refusals``). ``ChunkTrainerMixin`` puts the same in front of a Trainer subclass; a trainer that
keeps a reference model (TRL's ``ref_model``: ``DPOTrainer``, ``GRPOTrainer``...) or reward models
(``GRPOTrainer``'s ``reward_funcs``) gets them boosted beside the model under the same budget, and for
a PEFT model without a reference, the model with its adapter off (``trainer_references``); what such
a trainer asks that chunkmem cannot honour (vLLM generation...) is refused when it is built
(``trl_refusals``).

Importing this module imports ``transformers`` and ``accelerate`` (``import chunkmem`` does not).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer

from ..boosted.model import ChunkedModel
from ..booster import Booster
from ..compat.transformers import TrainerCheckpointHooks, set_signature_columns
from ..errors import NotSupportedError
from ..optim import ChunkOptimizer
from ..plugin import ChunkPlugin
from ..ranks.agreement import agree
from .hf_accelerator import routed_to_chunkmem
from .hf_refusals import refuse_unsupported
from .trainer_references import TrainerFrozenModels, refuse_second_adapter

__all__ = ["CHECKPOINT_DIR", "ChunkTrainer", "ChunkTrainerMixin"]

# chunkmem's checkpoint inside Trainer's checkpoint-N directory.
CHECKPOINT_DIR = "chunkmem"


class ChunkTrainerMixin(TrainerCheckpointHooks):
    """Put in front of ``transformers.Trainer`` or a subclass of it:
    ``class MyTrainer(ChunkTrainerMixin, SomeTrainer)``; build it with ``plugin=ChunkPlugin(...)``."""

    def __init__(self, *args: Any, plugin: ChunkPlugin, **kwargs: Any) -> None:
        if not isinstance(plugin, ChunkPlugin):
            raise TypeError(f"plugin must be a ChunkPlugin, got {type(plugin).__name__}")
        # chunkmem computes where Trainer does (use_cpu, the local rank's GPU): Trainer moves the
        # model there and puts each batch and its loss accumulator there.
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None:
            plugin = plugin.on_device(given.device)
        # Refused before Trainer builds anything (its accelerator would set up DeepSpeed or FSDP).
        refuse_unsupported(given, plugin, kwargs.get("model_init"))
        super().__init__(*args, **kwargs)
        self.booster = Booster(plugin.on_device(self.args.device))  # without args: Trainer's default ones
        # Trainer keeps the dataset columns that the model's forward names; the boosted model's
        # forward takes (*args, **kwargs), so read them from the module before boosting.
        set_signature_columns(self)
        # Trainer's own optimizer (its param groups, weight decay, optim choice) or the one given.
        optimizer = self.create_optimizer()
        # A preference or RL trainer's reference and reward models (TRL's ``ref_model`` and
        # ``reward_funcs``) are boosted beside the model, under the same budget; a PEFT model's
        # reference is the model with its adapter off.
        users_model = self.model
        refuse_second_adapter(self, users_model)
        frozen = TrainerFrozenModels(self)
        model, boosted, *_ = self.booster.boost(self.model, optimizer, frozen=frozen.models)
        assert isinstance(boosted, ChunkOptimizer), "boost returns an optimizer when given one"
        frozen.after_boost(self, users_model, model)
        self.model = self.model_wrapped = model
        self.optimizer = boosted
        self._chunk_optimizer = boosted

    # --- the accelerator ------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        # Trainer builds its Accelerator in one place from many arguments; the same object, with
        # the calls on the model and optimizer routed to chunkmem (ChunkAccelerator adds no state).
        self.accelerator.__class__ = routed_to_chunkmem(type(self.accelerator))

    # --- the loss -------------------------------------------------------------------------------
    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer decides from the unwrapped model's class whether label smoothing shifts a causal
        # LM's labels (looking through PeftModel to the base model): the user's model, as under DDP.
        with self.accelerator.showing_users_model():
            return super().compute_loss(*args, **kwargs)  # type: ignore[misc]

    # --- checkpoints --------------------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self._chunk_optimizer.communicator.world_size > 1

    def _checkpoint_paths(self, directory: str, sharded: bool) -> tuple[str, str, str]:
        """The model, optimizer and scheduler paths in ``directory``: files as world size 1 writes
        them, sharded directories as more ranks do."""
        base = os.path.join(directory, CHECKPOINT_DIR)
        suffix = "" if sharded else ".pt"
        return (
            os.path.join(base, f"model{suffix}"),
            os.path.join(base, f"optimizer{suffix}"),
            os.path.join(base, "scheduler.pt"),
        )

    def _saved_paths(self, checkpoint: str) -> tuple[str, str, str]:
        """The paths of the checkpoint in ``checkpoint`` in the layout it was saved in, whatever the
        world size that saved it: the booster loads a file or a sharded directory at any world size.
        Every rank looks; one that finds nothing makes every rank raise."""
        communicator = self._chunk_optimizer.communicator
        return agree(
            communicator,
            "finding the chunkmem checkpoint to resume from",
            lambda: self._find_saved(checkpoint),
            NotSupportedError,
            subject=checkpoint,
        )

    def _find_saved(self, checkpoint: str) -> tuple[str, str, str]:
        for sharded in (self._sharded, not self._sharded):
            paths = self._checkpoint_paths(checkpoint, sharded)
            if os.path.exists(paths[0]):
                return paths
        single, _, _ = self._checkpoint_paths(checkpoint, sharded=False)
        several, _, _ = self._checkpoint_paths(checkpoint, sharded=True)
        raise NotSupportedError(
            f"{checkpoint} holds no chunkmem checkpoint (neither {single}, which one rank writes, nor the directory "
            f"{several}, which several ranks write): ChunkTrainer resumes from the checkpoint-N directories it saved "
            "itself, at any world size. To start from a plain model's weights, load them with from_pretrained "
            "before building the trainer"
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Outside training: a plain ``save_pretrained`` directory (rank 0 writes the full fp32
        weights; ``from_pretrained`` loads it). Inside a checkpoint (``_internal_call``): chunkmem's
        model checkpoint, sharded at world size > 1, and the model's config. Every rank calls it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self.model
        assert isinstance(model, ChunkedModel), "ChunkTrainer boosts its model when it is built"
        if _internal_call:
            model_path, _, _ = self._checkpoint_paths(output_dir, self._sharded)
            self.booster.save_model(model, model_path, shard=self._sharded)
            if self.args.should_save and hasattr(model.module, "config"):
                model.module.config.save_pretrained(output_dir)
            return
        model.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _chunkmem_save_optimizer_and_scheduler(self, output_dir: str) -> None:
        _, optimizer_path, scheduler_path = self._checkpoint_paths(output_dir, self._sharded)
        self.booster.save_optimizer(self._chunk_optimizer, optimizer_path, shard=self._sharded)
        self.booster.save_lr_scheduler(self.lr_scheduler, scheduler_path, self._chunk_optimizer)

    def _refuse_a_resume_that_loses_state(self) -> None:
        # chunkmem's hooks take the place of Trainer's resume, so a subclass's own addition to it
        # never runs: GRPOTrainer restores its adaptive entropy controller there.
        if getattr(self.args, "use_adaptive_entropy", False):
            raise NotSupportedError(
                f"{type(self.args).__name__}.use_adaptive_entropy=True cannot be resumed under chunkmem: the trainer "
                "restores the entropy controller's state where chunkmem loads its own optimizer and scheduler, so a "
                "resumed run would start the controller afresh. Train without resuming, or with "
                "use_adaptive_entropy=False"
            )

    def _chunkmem_load_model(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._refuse_a_resume_that_loses_state()
        model_path, _, _ = self._saved_paths(resume_from_checkpoint)
        self.booster.load_model(self.model, model_path)

    def _chunkmem_load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._refuse_a_resume_that_loses_state()
        _, optimizer_path, scheduler_path = self._saved_paths(checkpoint)
        if not os.path.exists(optimizer_path):  # save_only_model: weights alone, as Trainer resumes then
            return
        self.booster.load_optimizer(self._chunk_optimizer, optimizer_path)
        self.booster.load_lr_scheduler(self.lr_scheduler, scheduler_path, self._chunk_optimizer)


class ChunkTrainer(ChunkTrainerMixin, Trainer):
    """``transformers.Trainer`` under chunkmem: ``ChunkTrainer(model=..., args=..., plugin=ChunkPlugin(...))``."""
