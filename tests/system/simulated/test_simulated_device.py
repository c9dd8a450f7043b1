"""The simulated asynchronous device (``chunkmem.device.simulated``): training on it equals the
synchronous CPU run bit for bit; its model of a GPU (collectives on a stream of their own, host
threads as actors, a caching allocator, events that complete) finds what a GPU would get wrong;
and removing any one wait of the library (every one the AST scan of ``simulated_waits`` finds,
a call site at a time) makes a run on it fail by its checker."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import adamw_two_groups, batches, boost, gpt2, lm_loss, train_chunked
from support.paths import ROOT
from support.simulated import (
    SCENARIOS,
    assert_identical,
    caught_on_every_rank,
    every_auto_call_offloaded,
    run_scenario,
    synchronous,
)
from support.simulated_device_helpers import CATCHES, NOT_ORDERING, sites

from chunkmem import Booster, ChunkPlugin, HostBudgetTooSmallError
from chunkmem.device import CollectiveWaits, bf16_supported, compute_device, device_layer
from chunkmem.device.sim_allocator import cuda_block_size, pinned_block_size
from chunkmem.device.simulated import (
    SimulatedDeviceError,
    SimulatedLayer,
    Simulator,
    UnfinishedEventError,
    UnorderedAccessError,
    simulated_device,
)
from chunkmem.placement import DISK_WINDOW, ActivationPlacement, AutoPlacementConfig, StaticPlacementConfig
from chunkmem.ranks.comm import Communicator

pytestmark = pytest.mark.simulated

FAST = {"offload-p3-bf16", "load-after-eval"}


def _both(rank: int, world_size: int, name: str) -> None:
    # The synchronous run is shared with the tests below that remove a wait (one run a process).
    assert_identical(run_scenario(rank, world_size, name, True), synchronous(rank, world_size, name), name)


def _marks(name: str) -> list[Any]:
    marks: list[Any] = [] if name in FAST else [pytest.mark.slow]
    if SCENARIOS[name].world_size > 1:
        marks += [pytest.mark.multirank] + ([pytest.mark.fast_tier] if name in FAST else [])
    return marks


@pytest.mark.parametrize("name", [pytest.param(name, marks=_marks(name)) for name in SCENARIOS])
def test_training_on_the_simulated_device_equals_the_synchronous_run_bit_for_bit(name: str) -> None:
    world_size = SCENARIOS[name].world_size
    if world_size == 1:
        _both(0, 1, name)
    else:
        run_ranks(_both, world_size, args=(name,))


def test_the_simulated_device_is_asynchronous_and_pins() -> None:
    with simulated_device():
        layer = device_layer(torch.device("cpu"))
        assert isinstance(layer, SimulatedLayer) and layer.asynchronous and layer.pins
        assert layer.is_pinned(layer.host_empty(4, torch.float32, torch.device("cpu")))
        assert not layer.is_pinned(torch.empty(4))


def test_a_gpu_is_neither_picked_nor_taken_on_the_simulated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a GPU is present the plugin picks it by itself, and nothing would be simulated there:
    asked for the simulated device, chunkmem computes on the CPU (in fp32, as on any CPU) and
    refuses a GPU handed to it. The GPU is made to look present, so this holds on any machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with simulated_device(check=False):
        assert compute_device() == torch.device("cpu")
        assert not bf16_supported(None)
        with pytest.raises(ValueError, match=r"CHUNKMEM_DEVICE=cpu-async .* handed cuda:0"):
            device_layer(torch.device("cuda", 0))


@pytest.mark.parametrize("simulated", [True, False])
def test_the_scenarios_compute_on_the_cpu_where_a_gpu_is_present(
    monkeypatch: pytest.MonkeyPatch, simulated: bool
) -> None:
    """Both runs a scenario compares (simulated and synchronous) compute on the CPU on a GPU
    machine too: the GPU is made to look present, so a run handed to it fails here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = run_scenario(0, 1, "offload-p0", simulated)
    assert len(result["losses"]) == 2 and all(value.device.type == "cpu" for value in result["state"].values())


def test_a_block_in_which_nothing_computed_on_the_simulated_device_fails() -> None:
    """A model boosted before the block keeps its synchronous layer (as one on a GPU keeps the
    GPU's): training it inside the block checks nothing, so the block fails rather than pass."""
    booster = Booster(plugin=ChunkPlugin(precision="fp32", process_group=Communicator(None, torch.device("cpu"))))
    model, *_ = booster.boost(torch.nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="nothing computed on the simulated device"), simulated_device():
        model(torch.ones(2, 8)).sum().backward()


def test_a_host_write_before_the_copy_reading_the_buffer_is_waited_for_raises() -> None:
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        host = layer.host_empty(8, torch.float32, torch.device("cpu"))
        host.fill_(1.0)
        device = torch.empty(8)
        side = layer.new_stream()
        layer.wait_stream(side, layer.current_stream())  # the memory was allocated on the compute stream
        with layer.on_stream(side):
            device.copy_(host, non_blocking=True)
            read = layer.record_event()
        layer.synchronize(read)
        host.fill_(2.0)  # waited for: fine
        with layer.on_stream(side):
            device.copy_(host, non_blocking=True)
        with pytest.raises(UnorderedAccessError, match="fill_"):
            host.fill_(3.0)  # the copy on the side stream may not have read it yet
        assert len(simulator.errors) == 1


def test_memory_allocated_on_one_stream_is_used_on_another_only_after_a_wait() -> None:
    """The caching allocator gives a stream memory its earlier work may still use: another stream
    touching it must wait for the allocating stream first (what ``side_stream`` does)."""
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        side = layer.new_stream()
        made = torch.empty(8)
        with layer.on_stream(side), pytest.raises(UnorderedAccessError, match=r"empty \(makes it\)"):
            made.fill_(1.0)
        layer.wait_stream(side, layer.current_stream())
        with layer.on_stream(side):
            made.fill_(1.0)
    assert len(simulator.errors) == 1


# --- host threads -----------------------------------------------------------------------------
def _threads(body: Callable[[SimulatedLayer, torch.Tensor, concurrent.futures.ThreadPoolExecutor], None]) -> str:
    """What the checker says about ``body`` (given the layer, a host buffer the host filled, a pool
    of two threads); '' when nothing."""
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        assert isinstance(layer, SimulatedLayer)
        host = layer.host_empty(8, torch.float32, torch.device("cpu"))
        host.fill_(1.0)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-pool")
        with pool, contextlib.suppress(UnorderedAccessError):
            body(layer, host, pool)
    return simulator.errors[0] if simulator.errors else ""


def _write(tensor: torch.Tensor) -> None:
    tensor.fill_(2.0)


def _read(tensor: torch.Tensor) -> float:
    return float(tensor.sum())


# Each case: what the host does with a pool task writing the buffer (or reading it), and whether
# the checker finds an unordered access.
THREAD_CASES: dict[str, tuple[Callable[..., None], bool]] = {
    "a task's write the host reads without waiting": (lambda layer, h, pool: (pool.submit(_write, h), _read(h)), True),
    "a task's write the host reads after result()": (
        lambda layer, h, pool: (pool.submit(_write, h).result(), _read(h)),
        False,
    ),
    "a task's write the host reads after exception()": (
        lambda layer, h, pool: (pool.submit(_write, h).exception(), _read(h)),
        False,
    ),
    "a task reading what the host wrote before submit": (lambda layer, h, pool: pool.submit(_read, h).result(), False),
    "the host writing what a task may still read": (lambda layer, h, pool: (pool.submit(_read, h), _write(h)), True),
    "a done-callback reading the task's write": (
        lambda layer, h, pool: pool.submit(_write, h).add_done_callback(lambda f: _read(h)),
        False,
    ),
    "a second task reading the first's write (two threads: no order)": (
        lambda layer, h, pool: (pool.submit(_write, h), pool.submit(_read, h).result()),
        True,
    ),
    "a task on a pool of one reading the one before's write (in order)": (
        lambda layer, h, pool: _serial(h),
        False,
    ),
    "the host reading after shutdown(wait=True)": (lambda layer, h, pool: _after_shutdown(h), False),
}


def _serial(host: torch.Tensor) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as one:
        one.submit(_write, host)
        one.submit(_read, host).result()


def _after_shutdown(host: torch.Tensor) -> None:
    other = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    other.submit(_write, host)
    other.shutdown(wait=True)
    _read(host)


@pytest.mark.parametrize("case", list(THREAD_CASES))
def test_host_threads_are_actors_ordered_by_their_futures_only(case: str) -> None:
    """Pool tasks and done-callbacks are actors of their own: only ``submit``, ``result()`` /
    ``exception()``, a done-callback, ``shutdown(wait=True)`` and a one-thread pool's order order
    them, whatever the threads did (every case five times: the same verdict each time)."""
    body, unordered = THREAD_CASES[case]
    found = [_threads(body) for _ in range(5)]
    assert all(bool(f) == unordered for f in found), found
    if unordered:
        assert "test-pool task" in found[0]


# --- the caching allocator --------------------------------------------------------------------
@pytest.mark.parametrize("free", ["del", "resize_(0)"])
def test_a_free_while_another_stream_uses_the_memory_raises_unless_record_stream_ed(free: str) -> None:
    """A tensor allocated on the compute stream, written on a side stream, freed by the host
    before the compute stream waits for that write: the allocator gives the memory to the compute
    stream's next op, so the free raises, whether by ``del`` or by ``untyped_storage().resize_(0)``
    (how chunkmem frees gathered chunks). ``record_stream`` keeps the block until the side stream
    passes the point of the free: held (reserved, not reused) until the host waits for it."""

    def run(record: bool) -> tuple[Simulator, list[int]]:
        with simulated_device(check=False) as simulator:
            layer = device_layer(torch.device("cpu"))
            side = layer.new_stream()
            tensor = torch.empty(1_000)  # 4000 bytes on the compute stream
            layer.wait_stream(side, layer.current_stream())
            with layer.on_stream(side):
                tensor.add_(1.0)
            if record:
                layer.record_stream(tensor, side)
            with contextlib.suppress(UnorderedAccessError):
                if free == "del":
                    del tensor
                    torch.empty(1)  # the next op sees the free
                else:
                    tensor.untyped_storage().resize_(0)
            reserved = [simulator.device_memory().reserved]
            if record:
                kept = [torch.empty(1_000)]  # the block is held: a new one is reserved
                reserved.append(simulator.device_memory().reserved)
                layer.synchronize(layer.record_event(side))
                kept.append(torch.empty(1_000))  # the side stream passed the free: the held block is reused
                reserved.append(simulator.device_memory().reserved)
        return simulator, reserved

    unrecorded, _ = run(record=False)
    assert len(unrecorded.errors) == 1 and "not record_stream-ed to the stream" in unrecorded.errors[0]
    recorded, reserved = run(record=True)
    assert recorded.errors == []
    block = cuda_block_size(4_000)
    assert reserved[1] - reserved[0] == block and reserved[2] == reserved[1], reserved


def test_the_allocators_round_and_reuse_as_cudas_do() -> None:
    """Device blocks: multiples of 512 bytes, a freed block reused by a later request on its
    stream that fits (split when the rest is 512 bytes or more), not by another stream's. Pinned
    host blocks: the next power of two, reused for the same rounded size."""
    assert [cuda_block_size(n) for n in (1, 512, 513, 4_000)] == [512, 512, 1024, 4096]
    assert [pinned_block_size(n) for n in (1, 4_000, 4_096, 20_000)] == [1, 4096, 4096, 32768]
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        big = torch.empty(2_048)  # 8192 bytes
        del big
        small = torch.empty(1_000)  # 4096 of the cached 8192; 4096 stay cached
        figures = simulator.device_memory()
        assert (figures.reserved, figures.allocated) == (8192, 4096)
        side = layer.new_stream()
        with layer.on_stream(side):
            other = torch.empty(1_000)  # the compute stream's cached block is not the side stream's
        assert simulator.device_memory().reserved == 8192 + 4096
        host = layer.host_empty(5_000, torch.float32, torch.device("cpu"))  # 20000 bytes
        assert simulator.pinned_memory().reserved == 32768
        del small, other, host


def test_a_use_of_memory_freed_by_resize_0_is_a_use_after_free() -> None:
    """``untyped_storage().resize_(0)`` frees the memory under every tensor on the storage: an op
    on one before the storage is allocated again is a use after free (on a GPU it reads or writes
    memory the allocator may have handed to another tensor)."""
    with simulated_device(check=False) as simulator:
        tensor = torch.empty(8)
        tensor.untyped_storage().resize_(0)
        with pytest.raises(UnorderedAccessError, match="use after free"):
            tensor.fill_(1.0)
        tensor.untyped_storage().resize_(32)
        tensor.fill_(1.0)  # allocated again
    assert len(simulator.errors) == 1


def test_a_free_under_a_tasks_unordered_use_raises_before_the_memory_goes() -> None:
    """A host buffer a pool task wrote, freed by ``resize_(0)`` with no ``result()`` between: the
    free raises, and the memory is still there (a real task's access, by ctypes say, would
    otherwise land in freed memory and corrupt the process). After ``result()`` the free is fine."""
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        host = layer.host_empty(1_000, torch.float32, torch.device("cpu"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-pool") as pool:
            future = pool.submit(host.fill_, 1.0)
            concurrent.futures.wait([future])  # done, though nothing orders the host after it
            with pytest.raises(UnorderedAccessError, match=r"test-pool task .* freed \(resize_\(0\)\)"):
                host.untyped_storage().resize_(0)
            assert host.untyped_storage().nbytes() == 4_000
            future.result()
            host.untyped_storage().resize_(0)
    assert len(simulator.errors) == 1


def test_a_tasks_use_of_a_buffer_the_host_freed_is_seen_whenever_the_task_runs() -> None:
    """A pool task handed a host buffer that the host frees (``resize_(0)``) with no ``result()``
    between, and allocates again later: whether the task's first step, a view of the buffer, comes
    after the free (PyTorch refuses it, into a future nobody reads) or after the new allocation,
    the checker records the error; a task ordered after the allocation (submitted then) is fine."""
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        host = layer.host_empty(1_000, torch.float32, torch.device("cpu"), pinned=False)
        host.fill_(1.0)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-pool") as pool:
            started = threading.Event()
            task = pool.submit(lambda: (started.wait(), host.view(-1)[:1].clone()))
            host.untyped_storage().resize_(0)
            started.set()
            concurrent.futures.wait([task])
            assert isinstance(task.exception(), SimulatedDeviceError)  # the view of freed memory
            assert len(simulator.errors) == 1 and "(a view)" in simulator.errors[0]
            started.clear()
            task = pool.submit(lambda: (started.wait(), host.view(-1)[:1].clone()))
            host.untyped_storage().resize_(0)
            host.untyped_storage().resize_(4_000)  # allocated again before the task runs
            started.set()
            concurrent.futures.wait([task])
            assert isinstance(task.exception(), UnorderedAccessError)
            assert "resize_ (allocates it again)" in simulator.errors[1]
            assert pool.submit(host.view(-1)[:1].clone).exception() is None  # submitted after it
    assert len(simulator.errors) == 2


# --- the budget against what the allocator holds ----------------------------------------------
def _plain_non_model_peak() -> int:
    """Plain PyTorch's peak of live device blocks beyond its model state (parameters, gradients and
    AdamW's two states, each a block) over the same two steps: what the activations and temporaries
    of a step need, which no chunkmem budget governs."""
    with simulated_device(check=False) as simulator:
        model = gpt2()
        optimizer = adamw_two_groups(model)
        simulator.reset_peaks()
        for ids in batches(2):
            lm_loss(model, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = simulator.device_memory().peak_allocated
    return peak - 4 * sum(cuda_block_size(p.numel() * p.element_size()) for p in model.parameters())


BUDGETS: dict[str, tuple[Any, ActivationPlacement | None]] = {
    "auto-p3": (AutoPlacementConfig(device_budget=600_000, max_prefetch=3), None),
    "static-offload-optim-p2": (
        StaticPlacementConfig(device_budget=600_000, offload_optim_frac=1.0, max_prefetch=2),
        None,
    ),
    "activation-auto": (StaticPlacementConfig(device_budget=2_735_616), ActivationPlacement(auto=["GPT2Block"])),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BUDGETS))
def test_the_allocator_holds_the_budget_and_what_a_step_needs_beyond_it(case: str) -> None:
    """What a GPU user reads from ``max_memory_reserved`` after boosting, against the budget: the
    ledger stays within it (what chunkmem promises), and the caching allocator's blocks (rounded,
    cached per stream, held for the streams they were ``record_stream``-ed to until the host knows
    those passed) within the budget plus twice what plain PyTorch's activations and temporaries of
    the same step need (the stated slack: chunkmem's step holds its ops' outputs and autograd's
    gradients of each op's parameters on top, and the allocator caches blocks a later request of
    another size cannot use)."""
    placement, activations = BUDGETS[case]
    non_model = _plain_non_model_peak()
    context = every_auto_call_offloaded() if activations is not None else contextlib.nullcontext()
    with context, simulated_device() as simulator:
        chunked, optimizer, booster = boost(
            gpt2(),
            adamw_two_groups,
            process_group=Communicator(None, torch.device("cpu")),
            precision="fp32",
            chunk_size=6_000,
            placement=placement,
            activations=activations,
        )
        simulator.reset_peaks()  # the user's model built on the host before boosting is not the budget's
        train_chunked(chunked, optimizer, booster, batches(2))
        memory, pinned = simulator.device_memory(), simulator.pinned_memory()
    budget = placement.device_budget
    stats = chunked.stats()
    ledger = stats.peak_device_bytes
    print(
        f"{case}: budget {budget}, ledger peak {ledger}, allocated peak {memory.peak_allocated}, reserved peak "
        f"{memory.peak_reserved}, plain PyTorch's non-model peak {non_model}; pinned: ledger's host peak "
        f"{stats.peak_host_bytes}, allocated peak {pinned.peak_allocated}, reserved peak {pinned.peak_reserved}"
    )
    assert ledger <= budget
    assert memory.peak_allocated <= budget + 2 * non_model, (memory, budget, non_model)
    assert memory.peak_reserved <= 2 * (budget + non_model), (memory, budget, non_model)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_host_ledger_charges_the_blocks_the_pinned_allocator_holds(precision: str) -> None:
    """Every chunk offloaded to host memory and plain SGD (no optimizer state: every host byte
    chunkmem keeps between steps is pinned, and no staging buffer is used): after two steps the
    host ledger is what the pinned allocator holds, each buffer's power-of-two block, and what those
    blocks add up to per chunk: the fp32 master and gradient shard, and with 16-bit compute the copy
    gathers read. The shards' bytes are not powers of two, so the blocks hold more than them."""
    with simulated_device() as simulator:
        chunked, optimizer, booster = boost(
            gpt2(),
            lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
            process_group=Communicator(None, torch.device("cpu")),
            precision=precision,
            chunk_size=6_000,
            placement=StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0),
        )
        train_chunked(chunked, optimizer, booster, batches(2))
        pinned = simulator.pinned_memory()
    copy = 2 if precision == "bf16" else 0  # bytes an element of the 16-bit copy takes
    shards = [chunk.layout.shard_numel for chunk in chunked.manager.chunks]
    blocks = sum(2 * pinned_block_size(4 * n) + pinned_block_size(copy * n) for n in shards)
    assert chunked.stats().host_bytes == pinned.allocated == blocks
    assert blocks > sum((8 + copy) * n for n in shards)
    # A host budget is held against the blocks: one byte less is refused before training, naming them.
    with simulated_device(), pytest.raises(HostBudgetTooSmallError) as refused:
        boost(
            gpt2(),
            lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
            process_group=Communicator(None, torch.device("cpu")),
            precision=precision,
            chunk_size=6_000,
            placement=StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, host_budget=blocks - 1),
        )
    assert refused.value.minimum == blocks


def test_a_side_on_disk_pins_nothing_and_the_host_need_says_so(tmp_path: Path) -> None:
    """fp32 and plain SGD, every side on disk, the parameter shards in host memory: each master
    stays in host memory (gathers read it) unpinned, the gradient shards are on disk. The host need
    the placement is checked by is then the masters' bytes, as the ledger holds them, plus the disk
    tier's window (the largest ``DISK_WINDOW`` gradient shards, stepped in host memory): no pinned
    block is counted for what is not pinned."""
    with simulated_device():
        chunked, *_ = boost(
            gpt2(),
            lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
            process_group=Communicator(None, torch.device("cpu")),
            precision="fp32",
            chunk_size=6_000,
            placement=StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0),
            disk_dir=str(tmp_path),
        )
        shards = [chunk.layout.shard_numel for chunk in chunked.manager.chunks]
        assert chunked.stats().host_bytes == sum(4 * n for n in shards)  # the masters, exactly
        window = sum(sorted((4 * n for n in shards), reverse=True)[:DISK_WINDOW])
        assert chunked.runtime.policy.host_need() == chunked.stats().host_bytes + window


# --- events -----------------------------------------------------------------------------------
def test_an_event_completes_once_the_host_waited_for_it_and_elapsed_time_needs_both() -> None:
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        side = layer.new_stream()
        begin = layer.record_event(side, timing=True)
        with layer.on_stream(side):
            torch.empty(4).fill_(1.0)
        end = layer.record_event(side, timing=True)
        assert not layer.query(begin) and not layer.query(end)
        with pytest.raises(UnfinishedEventError, match="Both events must be completed"):
            layer.elapsed_seconds(begin, end)
        layer.synchronize(end)
        assert layer.query(begin) and layer.query(end)  # a later point of the stream was waited for
        assert layer.elapsed_seconds(begin, end) == 0.0
        plain = layer.record_event(side)
        layer.synchronize(plain)
        with pytest.raises(UnfinishedEventError, match="enable_timing"):
            layer.elapsed_seconds(plain, plain)
    assert len(simulator.errors) == 2


# --- collectives ------------------------------------------------------------------------------
def _collective_cases(rank: int, world_size: int) -> dict[str, str]:
    """Each case at W=2 on the simulated device: what its checker says ('' when nothing)."""
    import torch.distributed as dist

    def run(body: Callable[[SimulatedLayer], None], waits: CollectiveWaits = CollectiveWaits.STREAM) -> str:
        with simulated_device(check=False, collectives=waits) as simulator:
            layer = device_layer(torch.device("cpu"))
            assert isinstance(layer, SimulatedLayer)
            assert layer.collective_waits(dist.group.WORLD, "gloo") is waits
            with contextlib.suppress(UnorderedAccessError):
                body(layer)
        return simulator.errors[0] if simulator.errors else ""

    def gather(wait: bool) -> Callable[[SimulatedLayer], None]:
        def body(layer: SimulatedLayer) -> None:
            out, local = torch.empty(4), torch.full((2,), float(rank))
            work = dist.all_gather_into_tensor(out, local, async_op=True)
            if wait:
                work.wait()
            _ = out * 2  # on the compute stream
            if not wait:
                work.wait()

        return body

    def to_host(synchronize: bool) -> Callable[[SimulatedLayer], None]:
        def body(layer: SimulatedLayer) -> None:
            out, local = torch.empty(4), torch.full((2,), float(rank))
            host = layer.host_empty(4, torch.float32, torch.device("cpu"))
            dist.all_gather_into_tensor(out, local, async_op=True).wait()  # the compute stream waits
            host.copy_(out, non_blocking=True)
            copied = layer.record_event()
            if synchronize:
                layer.synchronize(copied)
            _ = host.sum()  # the host reads the output

        return body

    def input_from_a_side_stream(body_layer: SimulatedLayer) -> None:
        out, local = torch.empty(4), torch.empty(2)
        side = body_layer.new_stream()
        with body_layer.on_stream(side):
            local.fill_(float(rank))  # not waited for by the current stream
        dist.all_gather_into_tensor(out, local, async_op=True).wait()

    return {
        "a gather read without work.wait()": run(gather(wait=False)),
        "a gather read after work.wait()": run(gather(wait=True)),
        "gloo: a gather read without work.wait()": run(gather(wait=False), CollectiveWaits.HOST),
        "gloo: a gather read after work.wait()": run(gather(wait=True), CollectiveWaits.HOST),
        "the host reads a gathered buffer copied out, not waited for": run(to_host(synchronize=False)),
        "the host reads a gathered buffer copied out and waited for": run(to_host(synchronize=True)),
        "a gather of what a side stream wrote unwaited": run(input_from_a_side_stream),
    }


@pytest.mark.slow
@pytest.mark.multirank
def test_collectives_run_on_a_stream_of_their_own_and_work_wait_orders_the_current_stream() -> None:
    """NCCL's semantics on gloo's bytes: a collective runs after the current stream's work, on its
    own stream; ``work.wait()`` orders the current stream after it (the host not); what the host
    reads of its output needs the copy waited for. With gloo's (``CollectiveWaits.HOST``) the wait
    orders the host."""
    found = run_ranks(_collective_cases, 2)
    assert found[0].keys() == found[1].keys()
    for case, said in found[0].items():
        unordered = "without" in case or "not waited" in case or "unwaited" in case
        assert bool(said) == unordered and bool(found[1][case]) == unordered, (case, said, found[1][case])
    assert "collective stream of process group" in found[0]["a gather read without work.wait()"]
    assert "gloo's work of process group" in found[0]["gloo: a gather read without work.wait()"]


def test_every_wait_the_scan_finds_is_listed() -> None:
    assert not CATCHES.keys() & NOT_ORDERING.keys()
    assert sorted(sites()) == sorted({**CATCHES, **NOT_ORDERING}), (
        "a wait was added or moved: say which scenario catches it"
    )


def _removed_in_the_suite() -> list[str]:
    """The waits the suite removes: every one with ``CHUNKMEM_WAIT_ALL=1``, else the first of each
    scenario (each scenario's checker is shown to catch a removal there). The whole table, every wait
    five times, is ``benchmarks/wait_removal.py``'s: its committed results must list exactly the waits
    ``CATCHES`` names, each caught in every run (``test_the_committed_wait_removal_table_is_current``)."""
    if os.environ.get("CHUNKMEM_WAIT_ALL") == "1":
        return list(CATCHES)
    first: dict[str, str] = {}
    for label, name in CATCHES.items():
        first.setdefault(name, label)
    return list(first.values())


@pytest.mark.parametrize(
    "label",
    [pytest.param(label, marks=[pytest.mark.slow, *_marks(CATCHES[label])[1:]]) for label in _removed_in_the_suite()],
)
def test_removing_one_wait_fails_a_run_on_the_simulated_device_by_its_checker(label: str) -> None:
    """The suite removes each wait once; ``CHUNKMEM_WAIT_RUNS=5`` repeats each removal (every run
    must be caught: the checker does not depend on how the threads and gloo happened to run)."""
    name = CATCHES[label]
    for run in range(RUNS):
        found = caught_on_every_rank(sites()[label], name)
        assert any(f is not None and f.startswith("checker:") for f in found), f"{label}: {name}, run {run}: {found}"


RUNS = int(os.environ.get("CHUNKMEM_WAIT_RUNS", "1"))


def test_the_committed_wait_removal_table_is_current() -> None:
    """``benchmarks/results/wait_removal.json`` (the docs' table) lists every wait ``CATCHES`` names,
    with the scenario named there, each caught by the checker in every one of at least five runs: a
    wait added, moved or given another scenario fails here until the table is made again
    (``python benchmarks/wait_removal.py``)."""
    table = json.loads((ROOT / "benchmarks/results/wait_removal.json").read_text())
    rows = {row["label"]: row for row in table["waits"]}
    assert sorted(rows) == sorted(CATCHES), "the table is stale: run python benchmarks/wait_removal.py"
    for label, name in CATCHES.items():
        row = rows[label]
        assert row["scenario"] == name, (label, row["scenario"], name)
        assert row["runs"] >= 5 and row["caught_by_checker"] == row["runs"], (label, row["caught_by_checker"])


def test_the_wait_removal_table_counts_a_run_only_when_the_checker_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks/wait_removal.py``, which makes the remove-one-wait table: a removal the checker
    catches counts caught in every run, with the checker's message; a removal the scenario never
    notices (a wait that orders nothing, made to stand as one the scenario needs) counts missed, and
    the tool fails."""
    from benchmarks import wait_removal

    caught = "tiers/transfers.py: HostTransfers.copy: layer.record_stream(source, stream) #1"
    assert wait_removal.main(["--runs", "2", "--only", caught, "--out-dir", str(tmp_path)]) == 0
    [entry] = json.loads((tmp_path / "wait_removal.json").read_text())["waits"]
    assert (entry["caught_by_checker"], entry["runs"], entry["world_size"]) == (2, 2, 1)
    assert "not record_stream-ed to the stream" in entry["message"]
    nothing = "tiers/transfers.py: HostTransfers._timed: self.settle() #1"
    monkeypatch.setitem(CATCHES, nothing, "host-write-after-copy")
    assert wait_removal.main(["--runs", "1", "--only", nothing, "--out-dir", str(tmp_path)]) == 1
    [entry] = json.loads((tmp_path / "wait_removal.json").read_text())["waits"]
    assert entry["caught_by_checker"] == 0 and entry["message"] is None
