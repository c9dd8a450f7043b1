"""What ``ChunkTrainer`` cannot honour in a ``TrainingArguments`` (or a Trainer), refused when the
trainer is built, before anything is boosted: each refusal names the field, why, and what to do.
The fields TRL's configs add are refused by ``trl_refusals``."""

from __future__ import annotations

from typing import Any

from ..errors import NotSupportedError
from ..plugin import ChunkPlugin
from .trl_refusals import trl_refusals

__all__ = ["refuse_unsupported"]

# Optimizers that are not one elementwise update per parameter (chunkmem steps flat shards of
# parameters) or that run their own backward.
_NON_ELEMENTWISE_OPTIM = ("adafactor", "lomo", "adalomo", "galore", "apollo", "grokadamw", "schedule_free", "8bit")


def _refusal(field: str, value: Any, why: str, fix: str) -> NotSupportedError:
    return NotSupportedError(f"TrainingArguments.{field}={value!r} is not supported under chunkmem: {why}. {fix}")


def _checks(args: Any, plugin: ChunkPlugin) -> list[NotSupportedError]:
    found: list[NotSupportedError] = []

    def refuse(condition: Any, field: str, why: str, fix: str) -> None:
        if condition:
            found.append(_refusal(field, getattr(args, field), why, fix))

    sharding = "chunkmem already shards parameters, gradients and optimizer state across the ranks"
    refuse(args.deepspeed, "deepspeed", sharding, "Drop deepspeed; the ChunkPlugin's placement replaces ZeRO")
    refuse(args.fsdp, "fsdp", sharding, "Drop fsdp (and fsdp_config)")
    refuse(getattr(args, "parallelism_config", None), "parallelism_config", sharding, "Drop parallelism_config")
    refuse(
        args.torch_compile,
        "torch_compile",
        "Trainer compiles the whole model, and chunks are gathered in Python hooks around every op, which a "
        "compiled graph would skip",
        "Set torch_compile=False, and compile the repeated blocks with the hooks eager at their boundaries: "
        "ChunkTrainer(plugin=ChunkPlugin(compile=CompileBlocks(backend=..., mode=...)))",
    )
    refuse(
        args.use_liger_kernel,
        "use_liger_kernel",
        "Liger's Triton kernels read weights outside torch ops, where chunkmem cannot gather them",
        "Set use_liger_kernel=False",
    )
    refuse(
        args.fp16 or args.fp16_full_eval,
        "fp16" if args.fp16 else "fp16_full_eval",
        "fp16 loss scaling is chunkmem's (ChunkPlugin(precision='fp16')) and its skipped steps are not yet "
        "reported to Trainer's scheduler",
        "Train in bf16 (bf16=True with ChunkPlugin(precision='bf16')) or fp32",
    )
    refuse(
        args.bf16 != (plugin.precision == "bf16"),
        "bf16",
        f"the ChunkPlugin computes in {plugin.precision} (the plugin's precision decides the dtype chunks are "
        "gathered in; Accelerate's autocast is not used)",
        "Make them agree: bf16=True with ChunkPlugin(precision='bf16'), or bf16=False with precision='fp32'",
    )
    refuse(
        args.bf16_full_eval,
        "bf16_full_eval",
        "evaluation runs the boosted model in the plugin's precision",
        "Drop bf16_full_eval",
    )
    refuse(
        args.auto_find_batch_size,
        "auto_find_batch_size",
        "it rebuilds the model and optimizer after an out-of-memory error, and the boosted ones cannot be rebuilt",
        "Set the batch size (chunkmem's planner, chunkmem.plan, tells what fits)",
    )
    refuse(
        args.load_best_model_at_end,
        "load_best_model_at_end",
        "it reads the best checkpoint's weights as a plain model's, not chunkmem's checkpoint",
        "Load the best checkpoint yourself with booster.load_model after training",
    )
    refuse(
        args.save_on_each_node,
        "save_on_each_node",
        "chunkmem's checkpoints are written once for the whole job and need a filesystem every rank sees",
        "Save to a shared filesystem with save_on_each_node=False",
    )
    optim = str(getattr(args.optim, "value", args.optim))
    refuse(
        any(name in optim for name in _NON_ELEMENTWISE_OPTIM),
        "optim",
        "chunkmem steps flat shards of parameters with an elementwise torch optimizer",
        "Use an elementwise torch optimizer (adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop)",
    )
    refuse(
        args.n_gpu > 1,
        "n_gpu",
        "Trainer would run the model in torch.nn.DataParallel (one process, several GPUs)",
        "Launch one process per GPU with torchrun or accelerate launch",
    )
    return found


def refuse_unsupported(args: Any, plugin: ChunkPlugin, model_init: Any) -> None:
    """Raise what ``args`` (a ``TrainingArguments``, or None for Trainer's defaults) and a
    ``model_init`` ask for that chunkmem cannot honour, every refusal in one error."""
    found = [] if args is None else _checks(args, plugin) + trl_refusals(args, plugin)
    if model_init is not None:
        found.append(
            NotSupportedError(
                "Trainer(model_init=...) is not supported under chunkmem: it builds a new model for each run or "
                "trial, and the boosted model cannot be rebuilt. Pass model= (one run per ChunkTrainer)"
            )
        )
    if len(found) == 1:
        raise found[0]
    if found:
        raise NotSupportedError("\n".join(str(error) for error in found))
