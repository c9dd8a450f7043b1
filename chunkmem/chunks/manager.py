"""``ChunkManager``: packs parameters into chunks (``register``), maps each parameter to its chunk,
and shards every chunk where the placement puts it (``close_all``). It owns the model's byte ledger
and host transfers; what is gathered, released or evicted during a step is the runtime's
(``chunkmem.execution``), not the manager's."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import DiskTierError, UnmanageableParameter
from ..ranks.agreement import agree
from ..ranks.comm import Communicator
from ..ranks.local_failures import LocalFailures
from ..tiers.transfers import HostTransfers
from ..usage.accounting import MemoryLedger
from ..usage.memory import return_freed_host_memory
from ..usage.stats import Stats
from .chunk import Chunk
from .param_values import LiveValues, ParamValues
from .search import group_key
from .tensor_state import TensorInfo
from .values_in_place import WeightFiles, choose_in_place

if TYPE_CHECKING:
    from ..placement import ChunkPlacement
    from ..tiers.disk import SidesFile
    from .values_in_place import InPlaceShard

__all__ = ["ChunkManager"]

log = logging.getLogger("chunkmem")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ChunkManager:
    """Owns the chunks of one model on one rank, the parameter -> chunk map and the byte ledger.
    ``values`` is where closing a chunk reads its parameters' values (default: their own data)."""

    def __init__(
        self, comm: Communicator, compute_dtype: torch.dtype, stats: Stats, values: ParamValues | None = None
    ) -> None:
        self._comm = comm
        self._values: ParamValues = values if values is not None else LiveValues()
        self._compute_dtype = compute_dtype
        self._stats = stats
        self._transfers = HostTransfers(stats, comm.layer, comm.copy_stream)
        self._ledger = MemoryLedger()
        self._chunks: list[Chunk] = []
        self._infos: dict[int, TensorInfo] = {}
        self._ordered: list[TensorInfo] = []
        self._weight_files: WeightFiles | None = None  # some chunk reads in place from them
        self._failures = LocalFailures(comm.world_size)
        self._some_rank_reads_from_disk = False

    @property
    def ledger(self) -> MemoryLedger:
        return self._ledger

    @property
    def transfers(self) -> HostTransfers:
        """Every copy between host and device of this model's chunks."""
        return self._transfers

    def prepare_master_writes(self) -> None:
        """The CPU is about to write master shards (an optimizer step, a load): wait for
        asynchronous copies still reading host masters."""
        for chunk in self._chunks:
            if chunk.layout.closed:
                chunk.store.prepare_host_write()

    @property
    def weight_files(self) -> WeightFiles | None:
        """The weights files some chunk of this rank reads in place (``None``: none does)."""
        return self._weight_files

    @property
    def failures(self) -> LocalFailures:
        """This rank's failures (reads in a forward or a backward) kept for the ranks to agree on."""
        return self._failures

    @property
    def some_rank_reads_from_disk(self) -> bool:
        """Some chunk of some rank reads what gathers read from disk: in place from the weights
        files, or from the disk tier's file (the same on every rank)."""
        return self._some_rank_reads_from_disk

    @property
    def comm(self) -> Communicator:
        return self._comm

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(self._chunks)

    def chunk(self, chunk_id: int) -> Chunk:
        """The chunk with this id (ids are registration order)."""
        return self._chunks[chunk_id]

    @property
    def infos(self) -> tuple[TensorInfo, ...]:
        """Every managed parameter, in registration order."""
        return tuple(self._ordered)

    def manages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` (this very object) is in one of the chunks."""
        return id(param) in self._infos

    def info(self, param: torch.Tensor) -> TensorInfo:
        """Where ``param`` lives; raises ``KeyError`` naming its shape when it is not managed."""
        info = self._infos.get(id(param))
        if info is None or info.param is not param:
            raise KeyError(
                f"rank {self._comm.rank}: parameter of shape {tuple(param.shape)} is not managed by this chunk "
                "manager; it was not part of the model when it was boosted"
            )
        return info

    # --- registration -----------------------------------------------------------------------
    def register(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        chunk_size: int,
        trainable_chunk_size: int | None = None,
        quantized: Collection[torch.nn.Parameter] = (),
        quantized_chunk_sizes: Mapping[torch.dtype, int] | None = None,
    ) -> None:
        """Pack parameters, in order, into chunks of ``chunk_size`` elements (rounded up to a
        multiple of the world size), the trainable ones into chunks of ``trainable_chunk_size``
        where given (an adapter a small part of a frozen model: its chunks sized for it, not for
        the model), the ``quantized`` ones (a quantized base's stored tensors, frozen: see
        ``chunkmem.quantized``) into chunks that hold them in their own dtype, of
        ``quantized_chunk_sizes[dtype]`` where given (packed bytes and their scales are sized
        apart). Each group (dtype, requires_grad, quantized) fills its own open chunk; a
        parameter larger than its group's size gets a chunk of its own."""
        quantized_sizes = dict(quantized_chunk_sizes or {})
        for size in (chunk_size, trainable_chunk_size, *quantized_sizes.values()):
            if size is not None and size <= 0:
                raise ValueError(f"chunk_size must be a positive number of elements, got {size}")
        world = self._comm.world_size
        stored = {id(p) for p in quantized}
        open_chunks: dict[tuple[torch.dtype, bool, bool], Chunk] = {}
        for name, param in named_params:
            is_quantized = id(param) in stored
            self._check_manageable(name, param, is_quantized)
            key = (*group_key(param), is_quantized)
            size = (
                quantized_sizes.get(param.dtype)
                if is_quantized
                else trainable_chunk_size
                if param.requires_grad
                else None
            )
            capacity = -(-(size or chunk_size) // world) * world
            dtype = param.dtype if is_quantized else self._compute_dtype
            numel = param.numel()
            if numel > capacity:
                chunk = self._new_chunk(-(-numel // world) * world, param.requires_grad, dtype, is_quantized)
            else:
                chunk = open_chunks.get(key)
                if chunk is None or not chunk.layout.fits(numel):
                    chunk = self._new_chunk(capacity, param.requires_grad, dtype, is_quantized)
                    open_chunks[key] = chunk
            info = TensorInfo(
                name=name,
                param=param,
                chunk_id=chunk.chunk_id,
                index=len(chunk.layout.tensors),
                offset=chunk.layout.used,
                numel=numel,
                shape=param.shape,
                trainable=param.requires_grad,
            )
            chunk.layout.append(info)
            self._infos[id(param)] = info
            self._ordered.append(info)

    def _new_chunk(self, capacity: int, trainable: bool, dtype: torch.dtype, quantized: bool) -> Chunk:
        chunk = Chunk(
            len(self._chunks),
            capacity,
            dtype,
            trainable,
            self._comm,
            self._ledger,
            self._stats,
            self._transfers,
            self._failures,
            quantized,
        )
        self._chunks.append(chunk)
        return chunk

    def _check_manageable(self, name: str, param: torch.nn.Parameter, quantized: bool = False) -> None:
        where = f"parameter '{name}' (rank {self._comm.rank})"
        if id(param) in self._infos:
            raise UnmanageableParameter(f"{where} is registered twice; pass each parameter once")
        if quantized:  # the quantized base's own tensors (chunkmem.quantized found and checked them)
            if param.requires_grad:
                raise UnmanageableParameter(f"{where} is a quantized base's stored tensor: it cannot train")
            self._values.check(param, where)
            return
        if type(param) is not torch.nn.Parameter:
            raise UnmanageableParameter(
                f"{where} is a {type(param).__name__} (from {type(param).__module__}), not a plain nn.Parameter; "
                "chunkmem cannot manage parameter or tensor subclasses it does not know. Quantized weights other "
                "than bitsandbytes' 4-bit ones (Params4bit in Linear4bit modules, which chunkmem keeps in chunks of "
                "their quantized bytes) are such subclasses: their packed data, scales and kernels cannot be put in "
                "a chunk's flat storage and gathered back. Load the base with BitsAndBytesConfig(load_in_4bit=True), "
                "or in 16-bit without a quantization config (chunks shard and offload it instead) and boost with "
                "ChunkPlugin(precision='bf16'); other subclasses: unwrap them first"
            )
        self._values.check(param, where)
        if param.dtype not in SUPPORTED_DTYPES:
            raise UnmanageableParameter(
                f"{where} has dtype {param.dtype}; chunks hold float32, bfloat16 or float16 parameters. "
                "Cast the model (e.g. model.float()) or keep that parameter out of the boosted model"
            )
        if param.layout != torch.strided:
            raise UnmanageableParameter(f"{where} has layout {param.layout}; only dense parameters can be managed")

    # --- building the shards ----------------------------------------------------------------
    def choose_in_place(self, param_on_disk: Sequence[bool]) -> dict[int, InPlaceShard]:
        """The chunks whose shard this rank reads in place from the weights files, chosen once at
        boost (``choose_in_place``); ``param_on_disk``: the placement's, by chunk id."""
        files = WeightFiles(self._comm.rank, self._failures)

        def choose() -> dict[int, InPlaceShard]:
            chosen = {}
            for chunk in self._chunks:
                label = f"chunk {chunk.chunk_id} (rank {self._comm.rank})"
                found = choose_in_place(label, chunk.layout, param_on_disk[chunk.chunk_id], self._values, files)
                if found is not None:
                    chosen[chunk.chunk_id] = found
            return chosen

        # Only chunks on disk are read in place (the placement is the same on every rank). Each rank
        # opens and samples files of its own: one that fails there is an error on every rank.
        what = "opening the weights files read in place"
        chosen = agree(self._comm, what, choose, DiskTierError) if any(param_on_disk) else {}
        self._weight_files = files if chosen else None
        # Whether the ranks agree their reads after each forward (``agree_reads``): asked of every
        # rank once here, as some may read in place and others not (files of their own).
        some = torch.tensor([int(bool(chosen) or any(param_on_disk))], device=self._comm.tensor_device)
        self._comm.all_reduce(some, dist.ReduceOp.MAX)
        self._some_rank_reads_from_disk = bool(some.item())
        return chosen

    def close_all(
        self,
        placement: Callable[[Chunk], ChunkPlacement],
        disk: Callable[[Chunk], SidesFile | None] | None = None,
        in_place: Callable[[int], InPlaceShard | None] | None = None,
    ) -> None:
        """Shard every chunk, one at a time (a model larger than the device still wraps), with its
        master and parameter shard where ``placement`` says, its master on the disk file ``disk``
        gives (if any), its values read from ``values`` (or, ``in_place``, left in the weights
        files)."""
        for chunk in self._chunks:
            sides = disk(chunk) if disk is not None else None
            chunk.close(placement(chunk), self._values, sides, in_place(chunk.chunk_id) if in_place else None)
            if sides is not None:
                return_freed_host_memory()  # what was just written to disk and freed
        self._values.release()
