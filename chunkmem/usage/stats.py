"""Counters a user reads with ``model.stats()``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Stats"]


@dataclass
class Stats:
    """Cumulative since the model was boosted (take differences between two snapshots for a
    per-step figure). Byte counts are accounted chunk memory and transfer volume, exact.

    **What the device budget governs, and what it only measures.** ``device_bytes`` and
    ``peak_device_bytes`` are the bytes ``device_budget`` governs (never above it): chunk memory and
    the saved activations of ``ActivationPlacement(auto=...)`` calls while they are on the device
    (``activation_bytes``). Every other byte autograd saves on the device for a backward is only
    measured (with an ``ActivationPlacement``), in ``unbudgeted_activation_bytes`` and
    ``peak_unbudgeted_activation_bytes``: what is
    saved outside the ``auto`` blocks (the embeddings, the head, the loss; unless
    ``offload_outside`` offloads it with them) and in blocks without a placement, and what the
    ``offload`` blocks leave on the device and fetch back. The device's own peak can reach
    ``peak_device_bytes + peak_unbudgeted_activation_bytes``; temporaries, a recomputed block's
    tensors during its recomputation and the allocator's own cache are in neither. ``str(stats)``
    says this in a few lines."""

    peak_device_bytes: int = 0
    """Highest bytes on the compute device that ``device_budget`` governs (never above it): chunk
    memory, and the saved activations of ``auto`` calls. Not the device's peak: the saved
    activations outside the budget are in ``peak_unbudgeted_activation_bytes``."""
    device_bytes: int = 0
    """Bytes on the compute device that ``device_budget`` governs now (as ``peak_device_bytes``)."""
    host_bytes: int = 0
    """Accounted chunk bytes in host memory now (on a GPU, a pinned buffer at its allocator's
    block: the next power of two of its bytes)."""
    peak_host_bytes: int = 0
    """Highest accounted chunk bytes in host memory (never above ``host_budget``)."""
    disk_bytes: int = 0
    """Chunk bytes kept on disk (the disk tier's files)."""
    quantized_bytes: int = 0
    """Of the bytes above (device, host and disk), a quantized base's stored shards on this rank:
    packed 4-bit weights and their scales (``chunkmem.quantized``); gathered copies not included."""
    disk_read_bytes: int = 0
    """Bytes read from the disk tier's files."""
    disk_write_bytes: int = 0
    """Bytes written to the disk tier's files."""
    disk_param_read_bytes: int = 0
    """Of ``disk_read_bytes``, those read for gathers: compute-dtype parameter shards on disk
    (``offload_param_disk_frac``), one shard per gather of such a chunk."""
    disk_param_write_bytes: int = 0
    """Of ``disk_write_bytes``, those of what gathers read: the 16-bit copy of a parameter shard on
    disk (with fp32 compute, the fp32 master, which is what gathers read), written at boost and after
    each optimizer step that changed a trainable chunk; a frozen chunk's never after boost."""
    disk_read_seconds: float = 0.0
    """Seconds the reads took (summed over the I/O threads: ``disk_read_bytes / disk_read_seconds``
    is the achieved bandwidth of one thread)."""
    disk_write_seconds: float = 0.0
    """Seconds the writes took (as ``disk_read_seconds``)."""
    h2d_bytes: int = 0
    """Bytes copied from host memory to the compute device."""
    d2h_bytes: int = 0
    """Bytes copied from the compute device to host memory."""
    h2d_seconds: float = 0.0
    """Seconds the host-to-device copies took (CUDA events, so ``h2d_bytes / h2d_seconds`` is the
    achieved bandwidth; on the CPU the wall clock of each copy). A timing, not a count: it differs
    between ranks and runs."""
    d2h_seconds: float = 0.0
    """Seconds the device-to-host copies took (as ``h2d_seconds``)."""
    activation_bytes: int = 0
    """Saved activations of ``ActivationPlacement(auto=...)`` blocks accounted on the device now, under
    the budget (in ``device_bytes``): those kept, those of offloaded calls until copied out and once
    fetched back (the rank-agreed figures of each call)."""
    kv_cache_bytes: int = 0
    """The KV cache of a ``generate()`` under way, accounted on the device now, under the budget (in
    ``device_bytes``): what the cache holds at the longest sequence the call may reach (the prompt
    and ``max_new_tokens``, at its batch), reserved for the whole call; 0 outside ``generate()``."""
    unbudgeted_activation_bytes: int | None = None
    """Saved activations on the compute device now that ``device_budget`` does not govern (not in
    ``device_bytes``), measured: every storage autograd keeps for a backward of a training forward
    outside the ``auto`` calls (what is saved outside the named blocks, in blocks no placement
    names, the small tensors an ``offload`` block leaves and its copies fetched back), each once,
    until autograd lets go of it (``chunkmem.activations.meter`` says what is left out). ``None``:
    not measured, the model has no ``ActivationPlacement`` (every saved activation is then outside
    the budget)."""
    peak_unbudgeted_activation_bytes: int | None = None
    """Highest ``unbudgeted_activation_bytes`` since boosting (``None``: not measured)."""
    activation_kept_bytes: int = 0
    """Bytes of saved activations of ``auto`` blocks that stayed on the device (each storage once per
    save): the calls kept, and the small tensors offloaded calls keep."""
    activation_recomputed_bytes: int = 0
    """Bytes of saved activations of ``auto`` blocks recomputed in the backward (the first step's
    measure of the call, per recomputation); ``recomputed_blocks`` counts the recomputations."""
    activation_d2h_bytes: int = 0
    """Bytes of saved activations copied to host memory (``ActivationPlacement(offload=...)``, and the
    ``auto`` calls offloaded, every one in the first step: each offloaded storage once per block
    call); not in ``d2h_bytes``, which counts chunk traffic."""
    activation_h2d_bytes: int = 0
    """Bytes of saved activations copied back to the compute device for the backward; not in
    ``h2d_bytes``."""
    activation_disk_write_bytes: int = 0
    """Of ``activation_d2h_bytes``, the bytes written on to the disk tier (beyond
    ``ActivationPlacement.host_budget``); not in ``disk_write_bytes``, which counts chunk traffic."""
    activation_disk_read_bytes: int = 0
    """Bytes of saved activations read back from the disk tier for the backward; not in
    ``disk_read_bytes``."""
    activation_d2h_seconds: float = 0.0
    """Seconds the activation copies to host memory took (as ``d2h_seconds``)."""
    activation_h2d_seconds: float = 0.0
    """Seconds the activation copies back took (as ``h2d_seconds``)."""
    recomputed_blocks: int = 0
    """Forwards of blocks rerun in the backward (``ActivationPlacement(recompute=...)``): one per
    block call per backward."""
    pageable_copies: int = 0
    """Host-device copies on CUDA whose host buffer was not pinned, so the CPU waited for them (0
    under offload; always 0 on the CPU, where nothing is pinned)."""
    allgather_bytes: int = 0
    """Bytes of gathered chunk buffers produced by all-gathers (compute dtype; 0 at world size 1)."""
    reduce_scatter_bytes: int = 0
    """Bytes of fp32 gradient buffers reduced over ranks (0 at world size 1). On gloo the reduction
    is an all-reduce of the buffer (faster there than its reduce-scatter); the count is the same."""
    gathers: int = 0
    """Chunk gathers started because an op needed the chunk (demand fetches)."""
    prefetches: int = 0
    """Chunk gathers started ahead of use from the trace."""
    prefetch_hits: int = 0
    """Ops that found a needed chunk already fetched or in flight thanks to a prefetch."""
    prefetch_waits: int = 0
    """Prefetch hits whose gather had not completed yet, so compute waited for it."""
    evictions: int = 0
    """Gathered chunks released by the policy to make room."""
    releases: int = 0
    """Gathered chunks released after use."""
    grad_reductions: int = 0
    """Gradient buffers reduced into gradient shards."""
    grad_flushes: int = 0
    """Gradient buffers reduced early (before all their gradients arrived) to stay in budget."""
    grad_spills: int = 0
    """Gradient buffers moved to the host inside ``no_sync`` (where they cannot be reduced) to stay
    in budget; the next reduction adds what the host accumulated."""
    decision_work: int = 0
    """Trace entries and device buffers the policy looked at while deciding (a cost count: per op
    it is bounded by ``max_prefetch`` unless room must be made)."""
    trace_recordings: int = 0
    """Compute traces frozen (the first, and one per re-recording after a divergence)."""
    divergences: int = 0
    """Iterations that departed from the recorded trace."""
    host_step_seconds: float = 0.0
    """Seconds the optimizer spent stepping runs whose master is on the host (wall clock, early
    steps included: the host part of a step, without transfers)."""
    early_steps: int = 0
    """Chunks whose host step ran during the backward (``StepDuringBackward``), kept or undone."""
    early_steps_in_backward: int = 0
    """Of those, the ones that started while the backward was still running."""
    early_steps_undone: int = 0
    """Early steps put back because the loop did something before ``optimizer.step()`` that would
    have changed them (clipping that applied, fp16 inf/nan, another forward, zero_grad, ...)."""
    early_steps_declined: int = 0
    """Chunks that could have stepped early but whose restore point did not fit ``backup_budget``."""
    optimizer_steps: int = 0
    skipped_steps: int = 0
    """Optimizer steps skipped for inf/nan gradients (fp16 loss scaling)."""

    TIMINGS = frozenset(
        {
            "h2d_seconds",
            "d2h_seconds",
            "activation_h2d_seconds",
            "activation_d2h_seconds",
            "host_step_seconds",
            "disk_read_seconds",
            "disk_write_seconds",
        }
    )
    """The fields that are timings; every other field is an exact count, the same on every rank,
    but those of ``RANK_LOCAL`` and ``RANK_MEASURED``."""

    RANK_LOCAL = frozenset({"prefetch_waits", "early_steps_in_backward"})
    """Counts of whether asynchronous work was still running when looked at (a gather when its
    prefetch was claimed, the backward when an early host step started on its worker thread): they
    depend on each rank's timing, on a GPU more than on the CPU, and no decision reads them."""

    RANK_MEASURED = frozenset({"unbudgeted_activation_bytes", "peak_unbudgeted_activation_bytes"})
    """A rank's own measure of what it saved outside the budget: ranks may save different bytes
    (one rank's sequence is shorter), and no decision reads them."""

    def __str__(self) -> str:
        """What the budget governs and what it only measures, in a few lines (``repr``: every field)."""
        mib = 2**20
        now, peak = self.unbudgeted_activation_bytes, self.peak_unbudgeted_activation_bytes
        outside = (
            f"saved activations {now / mib:.1f} MiB now, {(peak or 0) / mib:.1f} MiB peak (outside the auto blocks, "
            "in blocks without a placement, what offload blocks leave on the device)"
            if now is not None
            else "saved activations, not measured (no ActivationPlacement: every one is outside the budget)"
        )
        return "\n".join(
            [
                f"under device_budget: {self.device_bytes / mib:.1f} MiB now, {self.peak_device_bytes / mib:.1f} MiB "
                f"peak (chunk memory, and saved activations of auto blocks: {self.activation_bytes / mib:.1f} MiB now)",
                f"not under the budget, only measured: {outside}",
                "not counted: temporaries, recomputations in the backward, the allocator's cache",
                f"host: {self.host_bytes / mib:.1f} MiB now, {self.peak_host_bytes / mib:.1f} MiB peak; disk: "
                f"{self.disk_bytes / mib:.1f} MiB",
            ]
        )

    def snapshot(self) -> Stats:
        """A copy that later counting does not change."""
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int | float]:
        """The counters by name (for JSON)."""
        return dataclasses.asdict(self)
