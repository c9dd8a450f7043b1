"""``chunkmem-plan`` (or ``python -m chunkmem.plan_command``): predict a training run of a transformers model
without running it.

    python -m chunkmem.plan_command --hf-config llama-7b --device-budget 24GiB --batch 1x2048 \\
        --world-size 8 --precision bf16 [--policy auto] [--max-prefetch 2] [--json]
    python -m chunkmem.plan_command --hf-config llama-7b --device-budget 24GiB --host-budget 48GiB \\
        --disk-bandwidth 3GB/s      # the auto policy spills to disk what 48 GiB of RAM cannot hold
    python -m chunkmem.plan_command --hf-config llama-7b --device-budget 24GiB --activations offload=LlamaDecoderLayer
    python -m chunkmem.plan_command --hf-config gpt2-xl --device-budget 8GiB --activations auto=@repeated  # found
    python -m chunkmem.plan_command --hf-config gpt2-xl --device-budget 8GiB --grad-accum 8   # 8 micro-batches a step

``--hf-config`` is a shipped shape (``gpt2``, ``gpt2-medium``, ``gpt2-xl``, ``llama-7b``,
``llama-13b``, ``llama-70b``), or a path to a ``config.json`` / model directory. The model is
built on the meta device, so planning a 70B model takes seconds and no memory; see
``chunkmem.planning.planner`` for what is predicted and how.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError

from chunkmem.placement import ActivationPlacement, AutoPlacementConfig, RepeatedBlocks, StaticPlacementConfig
from chunkmem.placement.config import Budget

from .compat.python import DefaultsWhereSetHelpFormatter
from .device import PLANNED_DEVICES, planned_precision
from .errors import ChunkmemError
from .planning.plan_fixes import FixKind, PlanFix
from .planning.planner import Plan, plan
from .plugin import ChunkPlugin
from .usage.memory import process_capacity

__all__ = ["SHAPES", "build_meta_model", "cli", "main"]

# Published shapes (vocabulary, width, layers, heads, key-value heads, MLP width, positions).
SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "gpt2-medium": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16},
    "gpt2-xl": {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25},
    "llama-7b": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "llama-13b": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    "llama-70b": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}


def _config(name_or_path: str, positions: int) -> Any:
    from transformers import CONFIG_MAPPING

    if name_or_path in SHAPES:
        fields = dict(SHAPES[name_or_path])
        model_type = fields.pop("model_type")
        key = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
        fields[key] = max(positions, 1024)
        return CONFIG_MAPPING[model_type](**fields)
    path = Path(name_or_path)
    if not path.exists():
        raise SystemExit(f"--hf-config: {name_or_path} is neither a shipped shape ({', '.join(SHAPES)}) nor a path")
    file = path / "config.json" if path.is_dir() else path
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"--hf-config: cannot read {file} as a transformers config.json ({error})") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise SystemExit(
            f"--hf-config: {file} has model_type {model_type!r}, which this transformers does not know; give a "
            f"config.json with a known model_type, or a shipped shape ({', '.join(SHAPES)})"
        )
    return CONFIG_MAPPING[model_type].from_dict(fields)


def build_meta_model(name_or_path: str, positions: int) -> torch.nn.Module:
    """A causal LM of that shape on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    config = _config(name_or_path, positions)
    config.loss_type = "ForCausalLM"  # what transformers would pick, without its warning
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        first = str(error).strip().splitlines()[0]
        raise SystemExit(f"--hf-config: {name_or_path} ({config.model_type}) has no causal LM: {first}") from None


def _batch(text: str) -> tuple[int, int]:
    try:
        batch, sequence = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes BATCHxSEQUENCE such as 1x2048, got {text!r}") from None
    if batch < 1 or sequence < 1:
        raise argparse.ArgumentTypeError(f"--batch takes a batch and a sequence length of at least 1, got {text!r}")
    return batch, sequence


_HOWS = ("recompute", "offload", "auto")


REPEATED = "@repeated"
"""``--activations HOW=@repeated``: ``RepeatedBlocks()`` (the model's repeated layers, found without
naming their class); no class name starts with ``@``."""


def _activations(text: str) -> tuple[str, tuple[str | RepeatedBlocks, ...]]:
    how, _, classes = text.partition("=")
    names = tuple(c.strip() for c in classes.split(","))
    if how not in _HOWS or not all(names):
        raise argparse.ArgumentTypeError(
            f"--activations takes HOW=CLASS[,CLASS...] with HOW one of {', '.join(_HOWS)}, such as "
            f"recompute=LlamaDecoderLayer, or HOW={REPEATED} (the model's repeated layers); got {text!r}"
        )
    return how, tuple(RepeatedBlocks() if name == REPEATED else name for name in names)


def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to 1, got {text!r}")
    return value


_BUDGET: TypeAdapter[Any] = TypeAdapter(Budget)


def _bytes(text: str) -> int:
    """A size as placement configs read it (whole strings; no digit separators, nan or inf)."""
    try:
        return int(_BUDGET.validate_python(text))
    except ValidationError as error:
        reason = error.errors()[0]["msg"].removeprefix("Value error, ")
        raise argparse.ArgumentTypeError(f"expected a size such as 24GiB or 1.5e9 (bytes): {reason}") from None


def _bandwidth(text: str) -> float:
    return float(_bytes(text.lower().removesuffix("/s")))


def _parser(prog: str) -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog=prog, description=summary, formatter_class=DefaultsWhereSetHelpFormatter)
    parser.add_argument("--hf-config", required=True, help=f"{', '.join(SHAPES)}, or a config.json / model dir")
    parser.add_argument(
        "--device-budget", type=_bytes, default=None, help="chunk bytes on each device, e.g. 24GiB (default: no cap)"
    )
    parser.add_argument(
        "--device-memory",
        type=_bytes,
        default=None,
        help="what each rank may use of its device (default: 80GiB, an H100's, on cuda; this machine's memory on cpu)",
    )
    parser.add_argument("--batch", type=_batch, default="1x2048", help="per-rank micro-batch, BATCHxSEQUENCE")
    parser.add_argument("--world-size", type=_at_least(1), default=1, help="data-parallel ranks")
    parser.add_argument(
        "--device", choices=PLANNED_DEVICES, default=PLANNED_DEVICES[0], help="the device training computes on"
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="compute dtype (default: what ChunkPlugin picks when training on --device: bf16 on cuda, fp32 on cpu)",
    )
    parser.add_argument(
        "--policy",
        choices=["auto", "static", "offload"],
        default="auto",
        help="auto: AutoPlacementConfig; static: StaticPlacementConfig, everything on the device; offload: "
        "StaticPlacementConfig with masters and optimizer state in host memory (offload fractions 1)",
    )
    parser.add_argument("--max-prefetch", type=_at_least(0), default=2, help="chunks gathered ahead of use")
    parser.add_argument(
        "--chunk-size", type=_at_least(1), default=None, help="elements per chunk (default: searched, as boost does)"
    )
    parser.add_argument(
        "--grad-accum",
        type=_at_least(1),
        default=1,
        help="micro-batches per optimizer step, all but the last in booster.no_sync; above 1 the plan is for "
        "ChunkPlugin(gradient_accumulation=True)",
    )
    parser.add_argument("--bandwidth", type=_bandwidth, default="25GB/s", help="host-device bytes/s")
    parser.add_argument(
        "--host-budget", type=_bytes, default=None, help="chunk bytes in host memory, e.g. 16GiB (default: no cap)"
    )
    parser.add_argument(
        "--disk-frac",
        type=_fraction,
        default=0.0,
        help="--policy static/offload: fraction of chunk memory whose optimizer side is on disk (with auto, "
        "--host-budget decides what goes to disk)",
    )
    parser.add_argument(
        "--param-disk-frac",
        type=_fraction,
        default=0.0,
        help="--policy offload: fraction of chunk memory whose parameter shard (what gathers read) is on disk "
        "too, at most --disk-frac (with auto, --host-budget decides)",
    )
    parser.add_argument("--disk-bandwidth", type=_bandwidth, default="2GB/s", help="disk bytes/s")
    parser.add_argument(
        "--activations",
        type=_activations,
        action="append",
        default=[],
        metavar="HOW=CLASS[,CLASS]",
        help="ActivationPlacement: recompute, offload or auto (placed under --device-budget) the saved activations of "
        f"these block classes, e.g. offload=GPT2Block, or of the model's repeated layers ({REPEATED}, e.g. "
        f"auto={REPEATED}: RepeatedBlocks()); repeatable. The plan predicts each block call's saved bytes",
    )
    parser.add_argument(
        "--activation-host-budget",
        type=_bytes,
        default=None,
        metavar="BYTES",
        help="ActivationPlacement.host_budget: the offload blocks' (and offloaded auto calls') copies beyond it go to "
        "disk, e.g. 8GiB; the plan predicts the bytes written and read back per step",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _placement(args: argparse.Namespace) -> StaticPlacementConfig | AutoPlacementConfig:
    if args.policy == "auto":
        return AutoPlacementConfig(
            device_budget=args.device_budget, max_prefetch=args.max_prefetch, host_budget=args.host_budget
        )
    offload = 1.0 if args.policy == "offload" else 0.0
    return StaticPlacementConfig(
        device_budget=args.device_budget,
        max_prefetch=args.max_prefetch,
        offload_optim_frac=max(offload, args.disk_frac),
        offload_param_frac=offload,
        offload_disk_frac=args.disk_frac,
        offload_param_disk_frac=args.param_disk_frac,
        host_budget=args.host_budget,
    )


def _activation_placement(
    choices: list[tuple[str, tuple[str | RepeatedBlocks, ...]]], host_budget: int | None
) -> ActivationPlacement | None:
    if not choices and host_budget is None:
        return None
    fields: dict[str, list[str | RepeatedBlocks]] = {}
    for how, names in choices:
        fields.setdefault(how, []).extend(names)
    return ActivationPlacement(**fields, host_budget=host_budget)


# The flag that sets each field of the configs the command line builds, by config.
_FLAGS: dict[str, dict[str, str]] = {
    "AutoPlacementConfig": {
        "device_budget": "--device-budget",
        "host_budget": "--host-budget",
        "max_prefetch": "--max-prefetch",
    },
    "StaticPlacementConfig": {
        "device_budget": "--device-budget",
        "host_budget": "--host-budget",
        "max_prefetch": "--max-prefetch",
        "offload_optim_frac": "--policy",
        "offload_param_frac": "--policy",
        "offload_disk_frac": "--disk-frac",
        "offload_param_disk_frac": "--param-disk-frac",
    },
    "ActivationPlacement": {
        "recompute": "--activations",
        "offload": "--activations",
        "auto": "--activations",
        "host_budget": "--activation-host-budget",
    },
    "ChunkPlugin": {"chunk_size": "--chunk-size", "precision": "--precision", "gradient_accumulation": "--grad-accum"},
}
# Where an error names no field (a check across fields): the flags that build that config.
_WHOLE: dict[str, str] = {
    "AutoPlacementConfig": "--policy auto",
    "StaticPlacementConfig": "--policy, --disk-frac and --param-disk-frac",
    "ActivationPlacement": "--activations",
    "ChunkPlugin": "--chunk-size",
}


def _refusal(error: Exception) -> str:
    """A refused setting as argparse says a refused argument: ``argument FLAG: what is wrong``."""
    if not isinstance(error, ValidationError):
        return " ".join(str(error).split())
    first = error.errors()[0]
    message = " ".join(first["msg"].removeprefix("Value error, ").split())
    loc = [str(part) for part in first["loc"]]
    flags = _FLAGS.get(error.title, {})
    field = next((part for part in loc if part in flags), None)
    if field is not None:
        return f"argument {flags[field]}: {message}"
    return f"argument {_WHOLE.get(error.title, ' / '.join(loc) or error.title)}: {message}"


def _size(nbytes: int, up: bool) -> str:
    """``nbytes`` as a size a flag takes, in whole MiB (rounded ``up`` or down)."""
    mib = -(-nbytes // 2**20) if up else nbytes // 2**20
    return f"{mib}MiB"


def _flag(fix: PlanFix) -> str:
    """A fix as the flag that makes it."""
    value, kind = fix.value, fix.kind
    if kind is FixKind.RAISE_DEVICE_BUDGET:
        return f"--device-budget {_size(value, up=True)}" if isinstance(value, int) else "a larger --device-budget"
    if kind is FixKind.LOWER_DEVICE_BUDGET:
        assert isinstance(value, int), "a lower device budget has a value"
        return f"--device-budget {_size(value, up=False)}"
    if kind is FixKind.RAISE_HOST_BUDGET:
        assert isinstance(value, int), "a host budget fix has a value"
        return f"--host-budget {_size(value, up=True)}"
    if kind is FixKind.RECOMPUTE_BLOCKS:
        return f"--activations recompute={value}" + (f" ({fix.detail})" if fix.detail else "")
    if kind is FixKind.SMALLER_BATCH:
        return "a smaller --batch"
    return "a smaller --chunk-size"


def main(argv: list[str] | None = None, prog: str = "python -m chunkmem.plan_command") -> Plan:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    for flag, value, policies in (
        ("--disk-frac", args.disk_frac, "static or offload"),
        ("--param-disk-frac", args.param_disk_frac, "offload"),
    ):
        if args.policy == "auto" and value > 0:
            parser.error(
                f"argument {flag}: applies to --policy {policies}; with --policy auto, --host-budget decides "
                "what goes to disk"
            )
    precision = args.precision or planned_precision(args.device)
    capacity = args.device_memory
    if capacity is None and args.device == "cpu":
        capacity = process_capacity(torch.device("cpu"))
    batch, sequence = args.batch
    try:
        model = build_meta_model(args.hf_config, sequence)
    except SystemExit as refused:  # what build_meta_model says of --hf-config, as argparse says it
        parser.error(f"argument {refused.code}")
    try:
        plugin = ChunkPlugin(
            placement=_placement(args),
            precision=precision,
            chunk_size=args.chunk_size,
            gradient_accumulation=args.grad_accum > 1,
            activations=_activation_placement(args.activations, args.activation_host_budget),
        )
    except (ChunkmemError, ValueError) as error:  # a ValidationError is a ValueError
        parser.error(_refusal(error))
    try:
        ids = torch.zeros(batch, sequence, dtype=torch.long, device="meta")
        result = plan(
            model,
            plugin,
            {"input_ids": ids, "labels": ids},
            world_size=args.world_size,
            device_capacity=capacity,
            bandwidth=args.bandwidth,
            disk_bandwidth=args.disk_bandwidth,
            grad_accum=args.grad_accum,
            device=args.device,
        )
    except (ChunkmemError, ValueError) as error:  # a ValidationError is a ValueError
        parser.error(_refusal(error))
    flags = [_flag(fix) for fix in result.fixes]
    if args.json:
        shown = {**result.as_dict(), "model": args.hf_config, "batch": [batch, sequence]}
        for fix, flag in zip(shown["fixes"], flags, strict=True):
            fix["flag"] = flag
        json.dump(shown, sys.stdout, indent=2)
        print()
    else:
        chosen = "" if args.precision else f" (the default on {args.device})"
        print(
            f"{args.hf_config}, batch {batch}x{sequence} per rank, {precision}{chosen}, {args.policy} placement, "
            f"on {args.device}"
        )
        print(result.table())
        if flags:
            print(f"to fit: {'; or '.join(flags)}")
    return result


def cli() -> None:
    """The ``chunkmem-plan`` console script (``main`` returns the plan, which a console script would
    take for an exit status)."""
    main(prog="chunkmem-plan")


if __name__ == "__main__":
    main()
