"""Placement configs: one frozen pydantic model per policy, discriminated by ``policy``.

A config is data only. ``placement.make_policy`` turns a config into the policy object that
decides; ``chunkmem`` executes what the policy decides.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .places import PLACES, Location

__all__ = [
    "AutoPlacementConfig",
    "PlacementConfig",
    "StaticPlacementConfig",
    "load_placement_config",
]

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Count = Annotated[int, Field(ge=0, strict=True)]


_BUDGET_FORM = "a number of bytes > 0 or a string such as '3GiB' or '512MiB'"


# A whole string: a number (digits with an optional decimal part and exponent) and an optional
# unit. pydantic's ByteSize matches a prefix only, so "2,048MiB" was 2 bytes and "3GiB!" 3 GiB.
_BUDGET_TEXT = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")
_SEPARATED = re.compile(r"\d[,_' ]\d")


def _byte_count(value: Any, info: ValidationInfo) -> Any:
    """Say what a budget must look like, instead of pydantic's "could not parse value and unit"
    for a negative number or a malformed string, and refuse what ByteSize would misread."""
    field = info.field_name or "budget"
    if isinstance(value, bool):
        raise ValueError(f"must be {_BUDGET_FORM}, not a bool")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{field}={value!r} is not a number of bytes; give {_BUDGET_FORM}")
    if isinstance(value, int | float) and value <= 0:
        raise ValueError(f"must be {_BUDGET_FORM}, got {value!r} (a budget cannot be zero or negative)")
    if isinstance(value, str):
        value = _budget_text(value, field)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(
            f"must be {_BUDGET_FORM}, got {value!r}: a number without a unit counts bytes, so it must be whole "
            f"(for {value:g} gibibytes write '{value:g}GiB')"
        )
    if isinstance(value, float):
        return int(value)  # a whole number of bytes, written as a float or a string ("2e9")
    return value


def _budget_text(text: str, field: str) -> Any:
    """A budget string as a float (a bare number of bytes) or as the string ByteSize parses
    whole (a number and a unit); refused with the field and the value otherwise."""
    if text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise ValueError(f"{field}={text!r} is not a number of bytes; give {_BUDGET_FORM}")
    if _SEPARATED.search(text):
        # "1,5GiB" is 1.5 GiB in some locales and "2,048MiB" 2048 MiB in others: refuse both.
        raise ValueError(
            f"{field}={text!r} has a digit separator (',', '_', \"'\" or a space): write the number without one, "
            "with a '.' for a decimal part, such as '2048MiB' or '1.5GiB'"
        )
    if text.strip().startswith("-"):
        raise ValueError(f"must be {_BUDGET_FORM}, got {text!r} (a budget cannot be negative)")
    match = _BUDGET_TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"must be {_BUDGET_FORM}, got {text!r}")
    number, unit = match.groups()
    if not unit:
        bare = float(number)
        if not math.isfinite(bare):
            raise ValueError(f"{field}={text!r} is not a number of bytes; give {_BUDGET_FORM}")
        return bare
    if unit.lower() not in ByteSize.byte_sizes:
        raise ValueError(f"must be {_BUDGET_FORM}, got {text!r} (unknown unit {unit!r})")
    if "e" in number.lower():
        raise ValueError(f"must be {_BUDGET_FORM}, got {text!r} (no exponent with a unit: write the digits)")
    return text


Budget = Annotated[ByteSize, BeforeValidator(_byte_count), Field(gt=0)]


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class StaticPlacementConfig(_Config):
    """Fixed placement by fractions of chunk memory, as in ColossalAI's Gemini ``static`` policy.

    The fractions pick chunks in registration order (deterministic: the first chunks are the ones
    kept gathered / offloaded), so every rank makes the same choice.
    """

    policy: Literal["static"] = "static"
    shard_param_frac: Fraction = 1.0
    """Fraction of chunk memory whose parameters are sharded (ZeRO-3) and gathered per use. The rest
    stays gathered on the device between uses (ZeRO-2 style: only gradients and optimizer states
    are sharded). 1.0 shards everything, 0.0 keeps every chunk gathered."""
    offload_param_frac: Fraction = 0.0
    """Fraction of chunk memory whose compute-dtype parameter shard lives off the device between
    uses. Only meaningful when every chunk is sharded and its optimizer state is offloaded, so it
    requires ``shard_param_frac == 1`` and ``offload_optim_frac == 1`` when it is above zero."""
    offload_optim_frac: Fraction = 0.0
    """Fraction of chunk memory whose fp32 master shard, gradient shard and optimizer states live
    in host memory (the optimizer step for those chunks runs on the host). Chunks kept gathered are
    never offloaded."""
    offload_disk_frac: Fraction = 0.0
    """Fraction of chunk memory whose optimizer side leaves host memory for disk (files under
    ``ChunkPlugin(disk_dir=...)``): the optimizer states, the fp32 gradient shard (written when it is
    reduced) and, with 16-bit compute, the fp32 master, all read by the chunk's host step, which
    writes master and states back; what gathers read (the 16-bit copy, or the fp32 master with
    fp32 compute) stays in host memory. Only chunks whose optimizer side is offloaded can go to
    disk, the first of them in chunk order, so it requires ``offload_disk_frac <=
    offload_optim_frac``."""
    offload_param_disk_frac: Fraction = 0.0
    """Fraction of chunk memory whose compute-dtype parameter shard (what gathers read: the 16-bit
    copy, or with fp32 compute the fp32 master) lives on disk too, not in host memory: each gather
    reads it from disk into a staging buffer, and the chunk's optimizer step writes it back when its
    master changed (a frozen chunk's is written once, at boost). Chosen among the chunks whose
    optimizer side is on disk and whose parameter shard is offloaded, frozen chunks first (never
    written), then in chunk order, so it requires ``offload_param_disk_frac <= offload_disk_frac``
    and ``<= offload_param_frac``; it needs ``ChunkPlugin(disk_dir=...)`` like ``offload_disk_frac``."""
    max_prefetch: Count = 2
    """How many chunks, next in the recorded compute trace, may be fetched ahead of use. 0 fetches
    only on demand. Prefetch only uses budget that is free; it never breaks ``device_budget``. The
    default 2 is measured (``benchmarks/peers.py``, GPT-2 4x256 at W=2 on a CPU: 0.79x the step
    time of no prefetch, 0.90x that of 1); with nothing to gather it costs under 2% (W=1,
    ``benchmarks/overhead.py``)."""
    device_budget: Budget | None = None
    """Cap on chunk memory (parameters, gradients and optimizer states held in chunks) on the compute
    device, in bytes or a string such as ``"3GiB"``. ``None`` means no cap beyond the device."""
    host_budget: Budget | None = None
    """Cap on chunk memory in host memory (fp32 masters, gradient shards and optimizer states kept
    there, with 16-bit compute the 16-bit copies gathers read, and the buffers chunks on disk are
    stepped in), in bytes or a string such as ``"16GiB"``. ``None`` means no cap. A placement that
    does not fit is refused when boosting, with the minimum, and with the ``offload_disk_frac`` that
    would fit it where one does. On a CPU compute device (host memory too) it caps only what is
    offloaded from it: where nothing is and no ``device_budget`` is given, it is refused (see the
    README)."""

    # The fractions choose each chunk's (optimizer side, parameter shard) pair; the checks below
    # refuse the fractions that would choose a pair ``places.PLACES`` rules out, with its reason.
    @model_validator(mode="after")
    def _disk_needs_offload(self) -> StaticPlacementConfig:
        if self.offload_disk_frac > self.offload_optim_frac:
            raise ValueError(
                f"offload_disk_frac={self.offload_disk_frac} is above offload_optim_frac={self.offload_optim_frac}: "
                "only chunks whose optimizer side is offloaded to the host can go on to disk; raise "
                "offload_optim_frac or lower offload_disk_frac"
            )
        return self

    @model_validator(mode="after")
    def _param_disk_needs_disk_and_param_offload(self) -> StaticPlacementConfig:
        limits = (("offload_disk_frac", self.offload_disk_frac), ("offload_param_frac", self.offload_param_frac))
        for field, limit in limits:
            if self.offload_param_disk_frac > limit:
                raise ValueError(
                    f"offload_param_disk_frac={self.offload_param_disk_frac} is above {field}={limit}: a parameter "
                    "shard goes to disk only for a chunk whose optimizer side is on disk (offload_disk_frac) and whose "
                    f"parameter shard is offloaded (offload_param_frac), since {PLACES[Location.HOST, Location.DISK]}; "
                    f"raise {field} or lower offload_param_disk_frac"
                )
        return self

    @model_validator(mode="after")
    def _param_offload_needs_optim_offload(self) -> StaticPlacementConfig:
        if self.offload_param_frac > 0 and (self.shard_param_frac < 1 or self.offload_optim_frac < 1):
            raise ValueError(
                f"offload_param_frac={self.offload_param_frac} needs shard_param_frac=1.0 and "
                f"offload_optim_frac=1.0 (got {self.shard_param_frac} and {self.offload_optim_frac}): "
                f"{PLACES[Location.DEVICE, Location.HOST]}; set offload_param_frac=0 or offload the optimizer fully"
            )
        return self


class AutoPlacementConfig(_Config):
    """Budgeted placement that measures non-model memory in a warmup step, then keeps chunks on the
    device while they fit and evicts the one whose next use is furthest away (Belady)."""

    policy: Literal["auto"] = "auto"
    device_budget: Budget | None = None
    """Hard cap on chunk memory on the compute device, in bytes or a string such as ``"3GiB"``.
    ``None`` derives the cap from the device capacity and the two ratios below."""
    max_prefetch: Count = 0
    """How many chunks, next in the recorded compute trace, may be fetched ahead of use."""
    warmup_non_model_data_ratio: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.8
    """During the warmup step (nothing measured yet), assume this fraction of device capacity is
    taken by non-model data (activations, temporaries); model data gets the rest."""
    steady_device_cap_ratio: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """After warmup, model data at each trace position is kept within this fraction of device
    capacity minus the non-model data measured at that position."""
    total_limit: Budget | None = None
    """Optional limit on everything this process keeps on the device (model data plus activations
    and other non-model data), in bytes or a string such as ``"20GiB"``; the capacity the ratios
    above apply to is the smaller of it and what the process may use (free device memory at boost
    plus what it holds, within its per-process memory fraction)."""
    host_budget: Budget | None = None
    """Cap on chunk memory in host memory, in bytes or a string such as ``"16GiB"``: optimizer sides
    that do not stay on the device stay in host memory while they fit under it, and the rest go to
    disk (``ChunkPlugin(disk_dir=...)``), the chunks the optimizer reads least first: frozen chunks
    (never stepped), then trainable ones from the last. The compute-dtype parameter shards count too:
    when every optimizer side off the device is on disk and the host still holds too much, the
    parameter shards of those chunks go to disk as well, in the same order (frozen ones are never
    written back). ``None`` means no cap and no disk."""


PlacementConfig = Annotated[StaticPlacementConfig | AutoPlacementConfig, Field(discriminator="policy")]
_ADAPTER: TypeAdapter[StaticPlacementConfig | AutoPlacementConfig] = TypeAdapter(PlacementConfig)


def load_placement_config(
    source: StaticPlacementConfig | AutoPlacementConfig | Mapping[str, Any] | str | Path,
) -> StaticPlacementConfig | AutoPlacementConfig:
    """Return the config class named by ``policy`` from a config, a mapping, or a ``.json`` /
    ``.yaml`` / ``.yml`` file path. Invalid content raises ``pydantic.ValidationError`` naming the
    field; an unreadable path or unknown suffix raises ``ValueError``."""
    if isinstance(source, StaticPlacementConfig | AutoPlacementConfig):
        return source
    if isinstance(source, Mapping):
        return _validate(dict(source), "placement config")
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"placement config file {path} must end in .json, .yaml or .yml")
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read placement config file {path}: {error}") from error
    if suffix == ".json":
        data = json.loads(text, object_pairs_hook=_unique_keys(path))
        if not isinstance(data, Mapping):
            raise ValueError(f"placement config file {path} must hold a mapping, got {type(data).__name__}")
        return _validate(dict(data), f"placement config file {path}")
    data = _load_yaml(text, path)
    if not isinstance(data, Mapping):
        raise ValueError(f"placement config file {path} must hold a mapping, got {type(data).__name__}")
    return _validate(dict(data), f"placement config file {path}")


def _unique_keys(path: Path) -> Any:
    """A JSON ``object_pairs_hook`` that refuses a key given twice (json keeps the last silently)."""

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"placement config file {path} gives the key {key!r} twice; keep one")
            seen[key] = value
        return seen

    return build


def _load_yaml(text: str, path: Path) -> Any:
    """``yaml.safe_load``, refusing a key given twice in a mapping (YAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
            if repeated:
                line = node.start_mark.line + 1
                raise ValueError(
                    f"placement config file {path} gives the key(s) {repeated} twice in the mapping at line {line}; "
                    "keep one"
                )
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: builds plain data only


def _validate(data: dict[str, Any], where: str) -> StaticPlacementConfig | AutoPlacementConfig:
    """The ``policy`` key picks the class; without it pydantic only says it cannot "extract the
    tag", so name the key and its values here."""
    if "policy" not in data:
        message = (
            f"{where} has no 'policy' key; the 'policy' key chooses the placement: add policy: static "
            "(StaticPlacementConfig) or policy: auto (AutoPlacementConfig)"
        )
        raise ValidationError.from_exception_data(
            "placement config",
            [{"type": PydanticCustomError("missing_policy", message), "loc": ("policy",), "input": data}],
        )
    return _ADAPTER.validate_python(data)
