"""Shared pieces of the benchmarks: models from configs, data, device choice, timing, memory probes,
tables and JSON.

Everything here is plain PyTorch / ``transformers``; nothing imports chunkmem, so the same helpers
measure chunkmem and the systems it is compared with in the same way.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_VARIABLE = "CHUNKMEM_BENCHMARK_RESULTS"
RESULTS = Path(os.environ.get(RESULTS_VARIABLE) or Path(__file__).resolve().parent / "results")
"""Where a benchmark writes its JSON and plots unless told (``--out-dir``): ``benchmarks/results/``,
or ``$CHUNKMEM_BENCHMARK_RESULTS`` (the tests point it at a temporary directory, so that no test
run writes into the checkout's results)."""

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "host_memory_bytes": psutil.virtual_memory().total,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


# --- when, how and on how busy a machine a run was made ------------------------------------------------
def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages now (runnable processes, as ``uptime`` shows)."""
    return [round(value, 2) for value in os.getloadavg()]


@dataclass
class RunRecord:
    """What a benchmark's JSON says of its run (``meta``): the date it started (UTC), the command
    that ran it, and the machine's load before, during (``sample``) and after it."""

    date: str
    command: str
    load_before: list[float]
    samples: list[list[float]] = field(default_factory=list)

    def sample(self) -> None:
        """Note the load now (a benchmark calls it between its rounds)."""
        self.samples.append(load_average())

    def peak_load(self, after: list[float] | None = None) -> float:
        """The highest 1-minute load seen: before, at the samples, and ``after``."""
        return max(load[0] for load in [self.load_before, *self.samples, *([after] if after else [])])

    def busy(self, after: list[float] | None = None) -> bool:
        """Whether the 1-minute load exceeded the machine's cores at some point: other processes
        competed for the CPUs, and the times measured then are slower than the machine is."""
        return self.peak_load(after) > (os.cpu_count() or 1)

    def meta(self) -> dict[str, Any]:
        after = load_average()
        return {
            "date": self.date,
            "command": self.command,
            "machine": machine(),
            "load": {
                "before": self.load_before,
                "after": after,
                "samples": self.samples,
                "peak_1min": self.peak_load(after),
                "cores": os.cpu_count(),
                "busy": self.busy(after),
            },
        }


_RUN: RunRecord | None = None


def begin_run(script: str, argv: Sequence[str] | None = None) -> RunRecord:
    """Start the record of this run of ``script`` (a benchmark's ``__file__``) with ``argv`` (its
    arguments; default: this process's): the command a reader can run again, from the checkout's
    root."""
    global _RUN
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    args = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", str(shown), *args])
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _RUN = RunRecord(date=now, command=command, load_before=load_average())
    return _RUN


def current_run() -> RunRecord:
    """The record ``begin_run`` started (one begun now for ``sys.argv`` when no script began one)."""
    return _RUN if _RUN is not None else begin_run(sys.argv[0] or "python", sys.argv[1:])


# --- the model and the data ----------------------------------------------------------------------
@dataclass(frozen=True)
class GPT2Shape:
    """A GPT-2 built from a config (no download): ``layers`` blocks of width ``width``."""

    layers: int
    width: int
    vocab: int
    seq: int

    @property
    def heads(self) -> int:
        # GPT-2's own sizes use 64-wide heads (XL: 1600 / 25); fall back to a divisor otherwise.
        for head_dim in (64, 80, 128, 32, 16, 8, 4, 2, 1):
            if self.width % head_dim == 0:
                return self.width // head_dim
        raise AssertionError("unreachable: 1 divides every width")

    def params(self) -> int:
        """Parameter count of ``GPT2LMHeadModel`` with tied embeddings (the same formula the model
        realises: embeddings, per block two layer norms, attention and MLP, a final layer norm)."""
        h = self.width
        block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
        return self.vocab * h + self.seq * h + self.layers * block + 2 * h

    def describe(self) -> str:
        return f"GPT-2 {self.layers}x{self.width} (vocab {self.vocab}, {self.params() / 1e6:.1f}M params)"


def gpt2_model(layers: int, width: int, vocab: int, seq: int, seed: int = 0) -> torch.nn.Module:
    """A GPT-2 language model from a config, initialised from ``seed`` (the same weights on every
    rank and in every process), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = GPT2Shape(layers, width, vocab, seq)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=width,
        n_layer=layers,
        n_head=shape.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    use_causal_lm_loss(model)
    return model


def use_causal_lm_loss(model: torch.nn.Module) -> None:
    """Name the loss ``transformers`` already falls back to for GPT-2.

    ``PreTrainedModel.__init__`` derives ``loss_type`` from the class name, and ``GPT2LMHeadModel``
    matches none of its loss names, so every forward with labels logs "`loss_type=None` was set in
    the config but it is unrecognized" and then uses ``ForCausalLM``. Setting that same loss by
    name silences the warning without changing the computation.
    """
    if getattr(model, "loss_type", "ForCausalLM") is None:
        model.loss_type = "ForCausalLM"


def token_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def rank_batch(step: int, rank: int, world_size: int, batch: int, seq: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of global batch number ``step``: the same tokens whichever system (or
    how many ranks) consumes it, generated on demand so no process holds the whole data set."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (world_size * batch, seq), generator=g)
    return tokens[rank * batch : (rank + 1) * batch].clone()


# --- time ------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The order in which round ``round_index`` visits ``names``: rotated by one each round, so no
    system always runs first (cold) or always right after the same neighbour."""
    if not names:
        return []
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


# --- memory ----------------------------------------------------------------------------------------
def current_rss() -> int:
    """Resident bytes of this process now."""
    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int:
    """Highest resident bytes of this process since it started (the kernel's high-water mark)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def device_peak(device: torch.device) -> int | None:
    """Highest bytes the CUDA caching allocator handed out on ``device`` (None on the CPU, where
    host RSS is the measure)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    """Collect garbage and return cached device blocks, so the next run starts from the same state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def parse_bytes(text: str) -> int:
    """``"20GiB"``, ``"512MB"`` or a plain number of bytes."""
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def cap_device_memory(device: torch.device, limit: int) -> int:
    """Let this process allocate at most ``limit`` bytes on ``device`` (emulating a smaller card);
    returns the limit in force (the card's total when it is smaller)."""
    if device.type != "cuda":
        raise ValueError("a device-memory cap needs a CUDA device; on the CPU the host memory is the device")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    return min(limit, total)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --- tables and files ------------------------------------------------------------------------------
Align = Literal["<", ">"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[Align] | None = None) -> str:
    """A text table whose columns line up in every row: text left-aligned, numbers right-aligned
    (``align`` per column; by default a column is right-aligned when every body cell parses as a
    number, a percentage or a byte size). Each column starts at the same offset on every line;
    trailing blanks are dropped."""
    cells = [[str(h) for h in headers], *[[("-" if c is None else str(c)) for c in row] for row in rows]]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"table row {row} has {len(row)} cells for {len(headers)} columns")
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    if align is None:
        align = [">" if all(_numeric(row[i]) for row in cells[1:]) else "<" for i in range(len(headers))]
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(cell: str) -> bool:
    text = cell.strip()
    if text in ("", "-"):
        return True
    low, dash, high = text.partition("-")
    if dash and low and _numeric(low) and _numeric(high):  # a range, "12.5-19.0"
        return True
    for suffix in (" GiB", " MiB", " KiB", " B", "%", "x", " s", " ms"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    try:
        float(text)
    except ValueError:
        return False
    return True


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[Align] | None = None) -> None:
    print(format_table(headers, rows, align))


def write_json(name: str, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """``payload`` as ``out_dir/name.json``, with the run's ``meta`` block (``RunRecord.meta``:
    date, command, machine, load) first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": current_run().meta(), **payload}, indent=2, default=str))
    tmp.replace(path)
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
