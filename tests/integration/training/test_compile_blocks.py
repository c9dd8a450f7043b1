"""``ChunkPlugin(compile=CompileBlocks(...))``: each repeated block compiled with ``torch.compile``, the
chunk hooks eager at its boundaries.

The reference everywhere is plain PyTorch with the same blocks compiled the same way (the block
class's ``forward`` through ``torch.compile`` with the same backend, one compiled function for every
block, as ``per_block_compiled`` builds it). At world size 1 on the CPU the two run the same kernels on
the same shapes, so losses and parameters are compared bit for bit; at two ranks each rank computes
half the batch and gradients are averaged by the reduce-scatter, so the whole-batch reference is met
within the tolerance the eager two-rank tests use (``test_distributed``), and chunkmem's own eager
run on the same rank is met bit for bit. The chunks a step gathers are counted per chunk from the
residency's actions and compared with an eager chunkmem run of the same placement; compiles are
counted by the backend (``torch._dynamo.testing``'s counters).

Most cases compile with ``aot_eager`` (AOTAutograd's graphs, saved tensors and backward, run by
eager kernels) or a counting backend; Inductor's generated code runs in ``test_benchmarks.py``'s
tiny run of ``benchmarks/compile.py``, which compares the same losses.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo.testing as dynamo_testing
from pydantic import ValidationError
from support.distributed import run_ranks
from support.models import (
    adamw_two_groups,
    as_reference,
    batches,
    boost,
    gpt2,
    llama,
    lm_loss,
    mean_over_ranks,
    train_reference,
)

from chunkmem import (
    ActivationPlacement,
    BudgetTooSmallError,
    ChunkedModel,
    ChunkPlugin,
    CompileBlocks,
    NotSupportedError,
    StepDuringBackward,
)
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.placement.actions import Verb

WIDTH, BATCH, STEPS = 32, 8, 3


class Block(torch.nn.Module):
    """A residual layer-norm + MLP block (what a transformer block's second half is)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack_data(steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(BATCH, 6, WIDTH, generator=g) for _ in range(steps)]


def stack_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """No compiled code or guards from another test (the reference and chunkmem compile the same
    class's forward: each test counts its own compiles)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- the references ------------------------------------------------------------------------------
BLOCK_CLASSES = ("Block", "GPT2Block", "LlamaDecoderLayer")


def per_block_compiled(
    model: torch.nn.Module, backend: Any, dynamic: bool | None = None, block_classes: tuple[type, ...] = ()
) -> torch.nn.Module:
    """Plain PyTorch with each block compiled: one ``torch.compile`` of the block class's forward,
    called for every block (the regional compilation recipe). Blocks: the modules of
    ``block_classes``, by default those named ``BLOCK_CLASSES``."""
    blocks = [
        m
        for m in model.modules()
        if isinstance(m, block_classes) or (not block_classes and type(m).__name__ in BLOCK_CLASSES)
    ]
    compiled = torch.compile(type(blocks[0]).forward, backend=backend, dynamic=dynamic)
    for block in blocks:
        block.forward = functools.partial(compiled, block)
    return model


def counting(backend: str = "aot_eager") -> Any:
    """A backend that counts the graphs Dynamo hands it and compiles them with ``backend``."""
    return dynamo_testing.CompileCounterWithBackend(backend)


def train_counting(
    chunked: ChunkedModel,
    optimizer: Any,
    booster: Any,
    data: Sequence[torch.Tensor],
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    rank: int = 0,
    world_size: int = 1,
) -> tuple[list[float], list[dict[int, int]]]:
    """Train one step per batch (each rank its slice); the mean loss over ranks per step, and each
    step's chunks brought onto the device (gathered, prefetched, or kept from then on), per chunk."""
    losses, gathered = [], []
    for batch in data:
        local = batch.chunk(world_size)[rank]
        with chunked.runtime.record_actions() as actions:
            value = loss(chunked, local)
            booster.backward(value, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        moves = (Verb.GATHER, Verb.PREFETCH, Verb.KEEP)
        gathered.append(dict(sorted(collections.Counter(a.chunk for a in actions if a.verb in moves).items())))
        losses.append(mean_over_ranks(value.detach(), world_size))
    return losses, gathered


def train_plain(
    model: torch.nn.Module, data: Sequence[torch.Tensor], loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
) -> list[float]:
    """Plain PyTorch, one step per batch on the whole batch."""
    optimizer = adamw_two_groups(model)
    losses = []
    for batch in data:
        value = loss(model, batch)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(value.item())
    return losses


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name].cpu(), value.detach().cpu()), name


# --- the config and what is refused --------------------------------------------------------------
def test_the_config_refuses_what_it_cannot_mean_and_takes_a_mapping() -> None:
    with pytest.raises(ValidationError, match="names no block class"):
        CompileBlocks(blocks=[])
    with pytest.raises(ValidationError, match=r"blocks must be a list of block classes"):
        CompileBlocks(blocks="GPT2Block")
    with pytest.raises(ValidationError, match="mode and options both given"):
        CompileBlocks(mode="default", options={"max_autotune": True})
    for cuda_graphs in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"options": {"triton.cudagraphs": 1}}):
        with pytest.raises(ValidationError, match="CUDA graphs"):
            CompileBlocks(**cuda_graphs)
    with pytest.raises(ValidationError, match="freezing folds the parameters"):
        CompileBlocks(options={"freezing": True})
    plugin = ChunkPlugin(compile={"blocks": ["GPT2Block"], "backend": "aot_eager", "dynamic": True})
    assert plugin.compile == CompileBlocks(blocks=("GPT2Block",), backend="aot_eager", dynamic=True)
    with pytest.raises(TypeError, match="compile must be a CompileBlocks or a mapping"):
        ChunkPlugin(compile="inductor")  # type: ignore[arg-type]


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Outer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _with_instance_forward() -> torch.nn.Module:
    model = Stack()
    model.blocks[1].forward = lambda x: x  # what a wrapper library leaves on an instance
    return model


REFUSALS: list[tuple[Callable[[], torch.nn.Module], dict[str, Any], type[Exception], str]] = [
    (Stack, {"blocks": ["Missing"]}, ValueError, r"names the block class 'Missing', but no module of the model is one"),
    (Nested, {"blocks": ["Outer", "Inner"]}, ValueError, r"names the class of layers\.0\.inner .* which holds it"),
    (Nested, {"blocks": ["Outer"], "_recompute": ["Inner"]}, NotSupportedError, r"inside the compiled block layers\.0"),
    (_with_instance_forward, {}, NotSupportedError, r"block blocks\.1 \(Block\) has a forward of its own"),
    (Inner, {}, ValueError, r"CompileBlocks: RepeatedBlocks\(min_count=2\) found no repeated block.*CompileBlocks\("),
]


@pytest.mark.parametrize(
    ("make", "fields", "error", "match"), REFUSALS, ids=["missing", "nested", "placed", "own", "none"]
)
def test_boost_refuses_before_anything_is_compiled_or_chunked(
    make: Callable[[], torch.nn.Module], fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = make()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    counter = dynamo_testing.CompileCounter()
    fields = dict(fields)
    recompute = fields.pop("_recompute", None)
    activations = ActivationPlacement(recompute=recompute) if recompute else None
    with pytest.raises(error, match=match):
        boost(model, adamw_two_groups, compile=CompileBlocks(backend=counter, **fields), activations=activations)
    assert counter.frame_count == 0
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and torch.equal(p.detach(), before[name]), name


def test_torch_compile_of_the_boosted_model_is_still_refused_and_names_the_option() -> None:
    chunked, _, _ = boost(Stack(), adamw_two_groups, compile=CompileBlocks(backend="eager"))
    with pytest.raises(NotSupportedError, match=r"ChunkPlugin\(compile=CompileBlocks\(\)\)"):
        chunked.compile()


def test_a_compiled_block_that_reads_another_blocks_parameter_is_refused() -> None:
    """The compiled code may read only its own parameters: another's is a hooked parameter, which
    the runtime refuses to let Dynamo trace (its chunk would not be gathered)."""

    class Reaching(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.other.weight.sum()

    model = Stack(blocks=2)
    model.blocks = torch.nn.ModuleList([Reaching(), Reaching()])
    for block in model.blocks:
        object.__setattr__(block, "other", model.head)  # not a submodule: the head's parameters are not the block's
    chunked, _, _ = boost(
        model, adamw_two_groups, compile=CompileBlocks(blocks=[Reaching], backend="eager"), chunk_size=8_000
    )
    with pytest.raises(Exception, match=r"torch\.compile is tracing an op on managed parameters \['head\.weight'\]"):
        chunked(torch.randn(2, 3, WIDTH))


def test_the_minimum_budget_holds_a_compiled_blocks_chunks_at_once() -> None:
    """A compiled call needs every chunk of its block gathered together (eager ops need one module's):
    a budget between the two minimums is refused at boost, naming the compiled block."""

    def minimum(compile: CompileBlocks | None) -> int:
        with pytest.raises(BudgetTooSmallError) as refused:
            _stack_run(compile, OFFLOADED.model_copy(update={"device_budget": 1}))
        return refused.value.minimum

    eager, compiled = minimum(None), minimum(CompileBlocks(backend="eager"))
    assert compiled > eager
    between = OFFLOADED.model_copy(update={"device_budget": (eager + compiled) // 2})
    with pytest.raises(BudgetTooSmallError, match=r"\(compiled\)"):
        _stack_run(CompileBlocks(backend="eager"), between)
    _stack_run(None, between)  # eager fits


class Writing(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc2.bias.mul_(1.0)  # an in-place write into a parameter
        return super().forward(x)


def test_an_in_place_write_into_a_parameter_inside_a_compiled_block_is_refused() -> None:
    model = Stack(blocks=2)
    model.blocks = torch.nn.ModuleList([Writing(), Writing()])
    chunked, _, _ = boost(model, adamw_two_groups, compile=CompileBlocks(blocks=[Writing], backend="eager"))
    with pytest.raises(NotSupportedError, match=r"in-place write inside a call of Writing.*blocks\.0\.fc2\.bias"):
        chunked(torch.randn(2, 3, WIDTH))


# --- world size 1 --------------------------------------------------------------------------------
# Every chunk offloaded under a budget: each gathered as the trace says, from host memory.
OFFLOADED = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, device_budget=300_000, max_prefetch=1)
# The auto policy chooses what stays on the device for the working sets it must make room for, a
# compiled block's chunks together: it may keep other chunks than the eager run keeps.
AUTO = AutoPlacementConfig(device_budget=300_000, max_prefetch=1)


def _stack_run(compile: CompileBlocks | None, placement: Any, **kwargs: Any) -> Any:
    return boost(
        Stack(), adamw_two_groups, placement=placement, precision="fp32", chunk_size=8_000, compile=compile, **kwargs
    )


@functools.cache
def _stack_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain per-block compile (``aot_eager``) of the stack over ``stack_data()``: losses and final state."""
    reference = per_block_compiled(as_reference(Stack()), "aot_eager")
    losses = train_plain(reference, stack_data(), stack_loss)
    torch._dynamo.reset()
    return losses, {k: v.detach().cpu().clone() for k, v in reference.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("placement", [OFFLOADED, AUTO], ids=["offloaded", "auto"])
def test_a_stack_equals_plain_per_block_compile_bit_for_bit_and_gathers_as_eager(placement: Any) -> None:
    expected, state = _stack_reference()
    eager_losses, eager_gathers = train_counting(*_stack_run(None, placement), stack_data(), stack_loss)
    counter = counting("aot_eager")
    chunked, optimizer, booster = _stack_run(CompileBlocks(backend=counter), placement)
    losses, gathers = train_counting(chunked, optimizer, booster, stack_data(), stack_loss)
    assert losses == expected == eager_losses
    assert_same_state(chunked.state_dict(), state)
    assert counter.frame_count == 1, "one compile for the three blocks and every step"
    assert chunked.stats().peak_device_bytes <= placement.device_budget
    assert sum(gathers[-1].values()) > 0, "the budget moves chunks"
    if placement is OFFLOADED:
        assert gathers[1:] == eager_gathers[1:]  # after the step that records the trace


def _hf_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


HF = {"gpt2": lambda: gpt2(n_embd=32, use_cache=False), "llama": lambda: llama(hidden=32, use_cache=False)}
HF_OFFLOADED = StaticPlacementConfig(
    offload_optim_frac=1.0, offload_param_frac=1.0, device_budget=600_000, max_prefetch=1
)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2"])  # LLaMA's blocks: test_benchmarks.py's tiny run, with Inductor
def test_hf_blocks_with_aot_autograd_equal_plain_per_block_compile_and_never_recompile(arch: str) -> None:
    """GPT-2 (tied embeddings outside the blocks) and LLaMA (rotary embeddings passed into every
    block, GQA, RMSNorm). AOTAutograd's compiled backward reads the tensors it saved, chunk views
    included, after the chunks were released and gathered again: bit for bit as plain PyTorch
    compiled per block."""
    data = batches(3)
    reference = per_block_compiled(as_reference(HF[arch]()), "aot_eager")
    expected = train_reference(reference, adamw_two_groups, data)
    placement = HF_OFFLOADED
    eager = boost(HF[arch](), adamw_two_groups, placement=placement, precision="fp32", chunk_size=4_000)
    _, eager_gathers = train_counting(*eager, data, lm_loss)
    torch._dynamo.reset()
    counter = counting("aot_eager")
    chunked, optimizer, booster = boost(
        HF[arch](),
        adamw_two_groups,
        placement=placement,
        precision="fp32",
        chunk_size=4_000,
        compile=CompileBlocks(backend=counter),
    )
    losses, gathers = train_counting(chunked, optimizer, booster, data[:2], lm_loss)
    assert counter.frame_count == 1, "one compile serves both blocks"
    more, gathers_later = train_counting(chunked, optimizer, booster, data[2:], lm_loss)
    assert counter.frame_count == 1, "no recompile after the second step"
    assert losses + more == expected
    assert_same_state(chunked.state_dict(), reference.state_dict())
    assert (gathers + gathers_later)[1:] == eager_gathers[1:]
    assert all(sum(step.values()) > 0 for step in gathers_later)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_sequence_lengths_compile_once_or_twice_not_per_length(dynamic: bool | None) -> None:
    """``dynamic=None``: the first length compiles for its shape, the second once more with the length
    symbolic, no later one; ``dynamic=True``: one compile."""
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(BATCH, n, WIDTH, generator=g) for n in (6, 4, 9, 3)]
    reference = per_block_compiled(as_reference(Stack()), dynamo_testing.CompileCounter(), dynamic)
    expected = train_plain(reference, data, stack_loss)
    torch._dynamo.reset()  # Dynamo remembers per function which sizes changed: chunkmem's run starts afresh
    counter = dynamo_testing.CompileCounter()
    chunked, optimizer, booster = _stack_run(CompileBlocks(backend=counter, dynamic=dynamic), OFFLOADED)
    losses, _ = train_counting(chunked, optimizer, booster, data, stack_loss)
    assert losses == expected
    assert counter.frame_count == (2 if dynamic is None else 1)


PLACED = {
    "recompute": ActivationPlacement(recompute=["Block"]),
    "offload": ActivationPlacement(offload=["Block"], min_offload_bytes=0),
    "auto": ActivationPlacement(auto=["Block"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", PLACED)
def test_activation_placement_wraps_the_compiled_blocks(how: str) -> None:
    """Recompute, offload and auto run around the compiled call: a recomputation reruns the compiled
    code, the offload's hooks see what AOTAutograd saves, and the results are plain per-block compile's."""
    expected, state = _stack_reference()
    counter = counting("aot_eager")
    chunked, optimizer, booster = _stack_run(
        CompileBlocks(backend=counter), AUTO.model_copy(update={"device_budget": 400_000}), activations=PLACED[how]
    )
    losses, _ = train_counting(chunked, optimizer, booster, stack_data(), stack_loss)
    assert losses == expected
    assert_same_state(chunked.state_dict(), state)
    assert counter.frame_count == 1
    stats = chunked.stats()
    if how == "recompute":
        assert stats.recomputed_blocks == 3 * STEPS
    if how == "offload":
        assert stats.activation_d2h_bytes > 0 and stats.activation_h2d_bytes == stats.activation_d2h_bytes
    if how == "auto":
        assert chunked.activation_plan is not None
        assert stats.activation_d2h_bytes > 0  # the first step offloads every call


@pytest.mark.slow
def test_no_sync_clipping_eval_checkpoints_and_plain_copies_with_compiled_blocks(tmp_path: Any) -> None:
    """Two micro-batches a step (the first under no_sync) and clipping, against plain per-block
    compile accumulating the same two; an eval forward between steps; the state saved by the compiled
    model loads into an eager one; a plain copy runs its class's own forward."""
    data = stack_data(4)
    reference = per_block_compiled(as_reference(Stack()), "aot_eager")
    plain_optimizer = adamw_two_groups(reference)
    expected = []
    for first, second in zip(data[::2], data[1::2], strict=True):
        stack_loss(reference, first).backward()
        value = stack_loss(reference, second)
        value.backward()
        expected.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item())
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    torch._dynamo.reset()
    counter = counting("aot_eager")
    chunked, optimizer, booster = _stack_run(CompileBlocks(backend=counter), OFFLOADED)
    norms = []
    for first, second in zip(data[::2], data[1::2], strict=True):
        with booster.no_sync(chunked, optimizer):
            booster.backward(stack_loss(chunked, first), optimizer)
        booster.backward(stack_loss(chunked, second), optimizer)
        norms.append(float(optimizer.clip_grad_norm(0.05)))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            chunked(data[0])  # an inference iteration between training steps
    # The norm is summed over flat shards, torch's per parameter: a few ulps apart, no more.
    assert norms == pytest.approx(expected, rel=1e-6)
    actual = chunked.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(actual[name], value.detach(), rtol=1e-5, atol=1e-7, msg=name)
    assert counter.frame_count == 2, "one compile for training, one for the no-grad forward"

    path = tmp_path / "model.pt"
    booster.save_model(chunked, path)
    eager, _, eager_booster = _stack_run(None, OFFLOADED)
    eager_booster.load_model(eager, path)
    assert_same_state(eager.state_dict(), actual)
    plain = chunked.plain_copy()
    assert plain is not None and all("forward" not in vars(m) for m in plain.modules())
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())
    with torch.no_grad():
        assert torch.equal(plain(data[0]), chunked(data[0]))


ON_DISK = StaticPlacementConfig(
    offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0, offload_param_disk_frac=1.0, max_prefetch=1
)


@pytest.mark.slow
def test_the_host_step_during_backward_and_the_disk_tier_with_compiled_blocks(tmp_path: Path) -> None:
    """Every chunk on disk (parameter shards read for each gather, optimizer states read and written
    by the host step), the host step run during the backward as each chunk's gradient is done: plain
    per-block compile's losses and final state, bit for bit."""
    expected, state = _stack_reference()
    counter = counting("aot_eager")
    chunked, optimizer, booster = _stack_run(
        CompileBlocks(backend=counter), ON_DISK, host_step=StepDuringBackward(), disk_dir=tmp_path
    )
    losses, gathers = train_counting(chunked, optimizer, booster, stack_data(), stack_loss)
    assert losses == expected
    assert_same_state(chunked.state_dict(), state)
    assert counter.frame_count == 1
    stats = chunked.stats()
    assert stats.disk_param_read_bytes > 0 and stats.disk_write_bytes > 0
    assert all(sum(step.values()) > 0 for step in gathers)


# --- the trainer doors -----------------------------------------------------------------------------
# Dynamo's graphs run as they are (backend "eager", no AOTAutograd: the doors pass the option
# through, the compiled calls are tested above).
@pytest.mark.slow
def test_chunk_trainer_with_compiled_blocks_equals_plain_trainer_with_the_blocks_compiled(tmp_path: Path) -> None:
    """``ChunkTrainer(plugin=ChunkPlugin(compile=...))`` under a budget that moves chunks, with
    accumulation and a schedule (no clipping: the same arithmetic), against ``Trainer`` on the same
    GPT-2 with its blocks compiled the same way: the same losses bit for bit, one compile."""
    from support.hf_trainer_helpers import dataset, logged, training_args
    from transformers import Trainer

    from chunkmem.integrations.hf import ChunkTrainer

    data = dataset(8)
    args = {"max_grad_norm": 0.0, "dataloader_drop_last": True}
    plain = Trainer(
        model=per_block_compiled(gpt2(n_embd=32, use_cache=False), "eager"),
        args=training_args(tmp_path / "plain", **args),
        train_dataset=data,
    )
    plain.train()
    torch._dynamo.reset()
    counter = counting("eager")
    plugin = ChunkPlugin(
        placement=AutoPlacementConfig(device_budget=200_000),
        chunk_size=8192,
        precision="fp32",
        compile=CompileBlocks(backend=counter),
    )
    chunked = ChunkTrainer(
        model=gpt2(n_embd=32, use_cache=False),
        args=training_args(tmp_path / "chunked", **args),
        train_dataset=data,
        plugin=plugin,
    )
    chunked.train()
    assert [line["loss"] for line in logged(chunked)] == [line["loss"] for line in logged(plain)]
    assert len(logged(chunked)) == 3
    assert counter.frame_count == 1
    assert chunked.model.stats().evictions > 0, "the budget must move chunks"


@pytest.mark.slow
def test_chunk_strategy_with_compiled_blocks_equals_plain_lightning_with_the_blocks_compiled() -> None:
    """``ChunkStrategy(compile=...)`` (each ``Linear`` a compiled block) under a budget that moves
    chunks, accumulating two micro-batches with a schedule, against plain Lightning with the same
    layers compiled the same way: every loss bit for bit, as many compiles (one per distinct layer
    shape, the three layers' shapes all differ), none in the second epoch."""
    from lightning.pytorch import Callback
    from support.lightning_models import BUDGET, CHUNK, Regressor, fit

    from chunkmem.integrations.lightning import ChunkStrategy

    plain_counter = counting("eager")

    class CompiledRegressor(Regressor):
        def __init__(self) -> None:
            super().__init__()
            per_block_compiled(self, plain_counter, block_classes=(torch.nn.Linear,))

    reference, _ = fit("auto", module_class=CompiledRegressor, accumulate_grad_batches=2)
    torch._dynamo.reset()
    counter = counting("eager")
    strategy = ChunkStrategy(
        placement=AutoPlacementConfig(device_budget=BUDGET),
        chunk_size=CHUNK,
        compile=CompileBlocks(blocks=[torch.nn.Linear], backend=counter),
    )
    per_epoch: list[int] = []

    class Compiles(Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            per_epoch.append(counter.frame_count)

    module, run = fit(strategy, accumulate_grad_batches=2, callbacks=[Compiles()])
    assert module.losses == reference.losses and len(module.losses) > 0
    assert per_epoch == [plain_counter.frame_count] * 2 == [3, 3]
    assert run.strategy.model.stats().evictions > 0, "the budget must move chunks"


# --- two and four ranks ------------------------------------------------------------------------
RANK_PLACEMENTS = {"static": StaticPlacementConfig(), "offloaded": OFFLOADED}


def _ranks(rank: int, world_size: int, placements: tuple[str, ...]) -> dict[str, Any]:
    """Each placement eager and compiled on this rank, and plain per-block compile on the whole batch."""
    try:
        data = stack_data(4)
        reference = per_block_compiled(as_reference(Stack()), "aot_eager")
        expected = train_plain(reference, data, stack_loss)
        out: dict[str, Any] = {"expected": expected, "reference": reference.state_dict()}
        del reference
        for name in placements:
            placement = RANK_PLACEMENTS[name]
            torch._dynamo.reset()
            eager = _stack_run(None, placement)
            eager_losses, eager_gathers = train_counting(*eager, data, stack_loss, rank, world_size)
            counter = counting("aot_eager")
            chunked, optimizer, booster = _stack_run(CompileBlocks(backend=counter), placement)
            losses, gathers = train_counting(chunked, optimizer, booster, data[:2], stack_loss, rank, world_size)
            frames = counter.frame_count
            more, later = train_counting(chunked, optimizer, booster, data[2:], stack_loss, rank, world_size)
            out[name] = {
                "losses": losses + more,
                "eager_losses": eager_losses,
                "gathers": gathers + later,
                "eager_gathers": eager_gathers,
                "frames": (frames, counter.frame_count),
                "evictions": chunked.stats().evictions,
                "state": chunked.state_dict(),
                "eager_state": eager[0].state_dict(),
            }
        return out
    finally:
        torch._dynamo.reset()  # a pooled rank: no compiled code or guards left for the next test


def assert_ranks_equal_eager_and_the_reference(results: list[dict[str, Any]], placements: tuple[str, ...]) -> None:
    """Each rank computes its slice of the batch and the reduce-scatter averages the ranks'
    gradients: the whole-batch reference is met within the eager multi-rank tests' tolerance;
    chunkmem's own eager run on the same rank, which does the same, bit for bit, with the same
    chunks brought onto the device from the second step on, and one compile, none after."""
    for result in results:
        for name in placements:
            run = result[name]
            assert run["losses"] == run["eager_losses"], name
            assert_same_state(run["state"], run["eager_state"])
            assert run["gathers"][1:] == run["eager_gathers"][1:], name
            assert all(sum(step.values()) > 0 for step in run["gathers"]), name
            assert run["frames"] == (1, 1), name
            assert run["losses"] == pytest.approx(result["expected"], rel=1e-5, abs=1e-6)
            for key, value in result["reference"].items():
                torch.testing.assert_close(run["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        if "offloaded" in placements:
            assert result["offloaded"]["evictions"] > 0, "the budget must move chunks"


@pytest.mark.multirank
def test_two_ranks_equal_eager_chunkmem_bit_for_bit_and_plain_per_block_compile_within_tolerance() -> None:
    placements = ("static",)
    assert_ranks_equal_eager_and_the_reference(run_ranks(_ranks, 2, args=(placements,)), placements)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.multirank
def test_four_ranks_sharded_and_under_a_budget_equal_eager_chunkmem_and_plain_per_block_compile() -> None:
    """At four ranks, a quarter of the batch each, sharded and with every chunk offloaded under a
    device budget with prefetch: the two-rank test's assertions, and the budget moves chunks."""
    placements = ("static", "offloaded")
    assert_ranks_equal_eager_and_the_reference(run_ranks(_ranks, 4, args=(placements,), timeout=400), placements)


# --- the planner -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_plan_with_compiled_blocks_equals_a_compiled_run() -> None:
    """The planner's meta run does not compile (nothing to compute), but records the same one op per
    block call: its counters are a compiled run's, step for step."""
    from chunkmem import StepCounters, plan

    x = stack_data(1)[0]
    plugin_fields = {"placement": OFFLOADED, "precision": "fp32", "chunk_size": 8_000}
    with torch.device("meta"):
        meta = Stack()
    predicted = plan(
        meta,
        ChunkPlugin(**plugin_fields, compile=CompileBlocks(backend="aot_eager")),
        {"x": x},
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        device_capacity=2**30,
        steps=3,
        device="cpu",
    )
    chunked, optimizer, booster = boost(
        Stack(),
        lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
        **plugin_fields,
        compile=CompileBlocks(backend=dynamo_testing.CompileCounter()),
    )
    measured = []
    ledger = chunked.manager.ledger
    for _ in range(3):
        before = chunked.stats()
        ledger.reset_peak()
        booster.backward(chunked(x).float().sum(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        measured.append(StepCounters.between(before, chunked.stats(), ledger.peak_device_bytes, ledger.peak_host_bytes))
    assert [vars(s) for s in predicted.steps] == [vars(s) for s in measured]
    assert measured[-1].gathers + measured[-1].prefetches > 0
