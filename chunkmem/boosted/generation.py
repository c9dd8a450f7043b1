"""``generate`` on a boosted model under the device budget.

Hugging Face's ``generate`` runs the module once for the prompt (the prefill), then once per new
token (the decode steps). Around it:

* **The KV cache is in the ledger** (``MemoryKind.KV_CACHE``), non-model data under the device
  budget: before decoding starts its size at the longest sequence the call may reach is forecast
  (``kv_cache.forecast_cache``: batch and copies, prompt and ``max_new_tokens`` / ``max_length``,
  the config's layers, kv heads and head dim, the compute dtype), agreed over ranks (the largest),
  and reserved for the whole call, as a static cache holds its keys. Where it cannot fit beside
  what stays on the device and the model's largest single-op working set, ``generate`` is refused
  before anything runs, on every rank alike, with a ``BudgetExceededError`` naming the budget, the
  cache's bytes and how many tokens or sequences would fit. After every module call the cache's real
  bytes are measured (the largest over ranks) and must stay within the reservation.
* **Each module call is an inference iteration**: the prefill on the inference trace, the decode
  steps on the decode trace (``IterationTracker``), recorded by the first decode step and cyclic, so
  every later step's chunks are prefetched in the recorded order, those it starts with at the end
  of the step before. When ``generate`` returns, what those last prefetches gathered is released.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist

from chunkmem.placement.policy import format_bytes

from ..errors import BudgetExceededError
from ..execution.runtime import ChunkRuntime
from ..ranks.comm import Communicator
from ..usage.accounting import MemoryKind
from .kv_cache import CacheForecast, cache_bytes, forecast_cache, output_cache

__all__ = ["generate_under_budget"]


def _agreed(comm: Communicator, forecast: CacheForecast) -> CacheForecast:
    """The forecast at the ranks' largest batch, prompt and length (each rank's prompt may differ)."""
    if comm.world_size == 1:
        return forecast
    sizes = torch.tensor([forecast.sequences, forecast.prompt, forecast.positions], device=comm.tensor_device)
    comm.all_reduce(sizes, dist.ReduceOp.MAX)
    sequences, prompt, positions = (int(v) for v in sizes.tolist())
    return forecast.agreed(sequences, prompt, positions)


def _refuse_beyond_budget(runtime: ChunkRuntime, chunks: Collection[int], forecast: CacheForecast, rank: int) -> None:
    """Refuse, before decoding, a cache that cannot fit beside what stays on the device and the
    model's largest op. Every figure is the same on every rank (the ledger, the agreed forecast)."""
    need = runtime.policy.inference_need(chunks)
    free = runtime.transient_room(forecast.nbytes + need.working_set)  # idle chunks released if needed
    budget = runtime.policy.budget
    if free is None or budget is None or forecast.nbytes + need.working_set <= free:
        return
    resting = budget - free
    minimum = resting + need.working_set + forecast.nbytes
    room = max(0, free - need.working_set)
    tokens, sequences = forecast.new_tokens_within(room), forecast.sequences_within(room)
    largest = f" ('{need.worst.label}')" if need.worst is not None else ""
    raise BudgetExceededError(
        f"rank {rank}: generate() cannot fit its KV cache under device_budget={budget} ({format_bytes(budget)}): it "
        f"needs {forecast.describe()}, beside the {format_bytes(resting)} that stay on the device and the "
        f"{format_bytes(need.working_set)} the model's largest op{largest} gathers: {format_bytes(minimum)} in all. "
        f"Raise device_budget to at least {minimum} ({format_bytes(minimum)}), generate fewer tokens ("
        + (f"max_new_tokens={tokens} fits at this batch" if tokens else "not one new token fits at this batch")
        + f"), or run a smaller batch ({sequences} sequences fit at these lengths, beams and returned sequences "
        "included).",
        minimum,
    )


class _Calls:
    """The module calls of one ``generate``: the prefill, then decode steps; each an inference
    iteration, each checked for the cache it left."""

    def __init__(self, runtime: ChunkRuntime, comm: Communicator, forecast: CacheForecast) -> None:
        self._runtime = runtime
        self._comm = comm
        self._forecast = forecast
        self._calls = 0

    def begin(self, module: torch.nn.Module, args: Any) -> None:
        self._runtime.begin_forward(decoding=self._calls > 0)
        self._calls += 1

    def returned(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._runtime.agree_reads()
        self._check_cache(output_cache(out))

    def end(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._runtime.end_forward()

    def _check_cache(self, cache: object) -> None:
        """The cache's real bytes (the largest over ranks, so that every rank refuses alike) within
        what is reserved for it."""
        held = cache_bytes(cache, self._comm.device) if cache is not None else 0
        if self._comm.world_size > 1:
            agreed = torch.tensor([held], device=self._comm.tensor_device)
            self._comm.all_reduce(agreed, dist.ReduceOp.MAX)
            held = int(agreed.item())
        reserved = self._forecast.nbytes
        if held > reserved:
            step = "the prompt" if self._calls == 1 else f"decode step {self._calls - 1}"
            raise BudgetExceededError(
                f"rank {self._comm.rank}: after {step} of generate() the KV cache holds {format_bytes(held)} on the "
                f"device, more than the {format_bytes(reserved)} reserved for it under the device budget from the "
                f"model's config ({self._forecast.shape}): the config does not describe the cache this model "
                "keeps. Generate with use_cache=False, or from a plain copy (model.plain_copy())."
            )


@contextmanager
def _calls_hooked(module: torch.nn.Module, calls: _Calls) -> Iterator[None]:
    handles = [
        module.register_forward_pre_hook(calls.begin),
        module.register_forward_hook(calls.returned),
        module.register_forward_hook(calls.end, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def generate_under_budget(
    module: torch.nn.Module,
    runtime: ChunkRuntime,
    comm: Communicator,
    chunks: Collection[int],
    dtype: torch.dtype,
    generate: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``generate(*args, **kwargs)`` of ``module`` (whose parameters are in ``chunks``), computing in
    ``dtype``, with its KV cache reserved under the budget and its module calls as inference
    iterations (module docstring). A collective: every rank calls it."""
    runtime.agree_entry("generate")
    forecast = _agreed(comm, forecast_cache(module, args, kwargs, dtype))
    _refuse_beyond_budget(runtime, chunks, forecast, comm.rank)
    calls = _Calls(runtime, comm, forecast)
    with runtime.transient(forecast.nbytes, "the KV cache of generate()", MemoryKind.KV_CACHE):
        try:
            with _calls_hooked(module, calls):
                out = generate(*args, **kwargs)
        except BaseException:
            # The error that stopped generate is the one to see; releasing what is idle is only
            # tidying (a collective failure may fail it again).
            with suppress(Exception):
                runtime.end_decoding()
            raise
        runtime.end_decoding()
        return out
