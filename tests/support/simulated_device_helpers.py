"""Pieces of ``system/simulated/test_simulated_device.py`` that other tests use too."""

from __future__ import annotations

import functools
from typing import Any

from support.simulated_waits import wait_sites

# --- removing one wait ------------------------------------------------------------------------
# Which scenario fails without each wait the AST scan finds (``simulated_waits``), by its label.
CATCHES: dict[str, str] = {
    "activations/disk.py: ActivationDisk.write: self._transfers.before_host_read(stage) #1": "activation-disk",
    "activations/disk.py: ActivationDisk.read: self._transfers.before_host_write(stage) #1": "activation-disk",
    "activations/disk.py: ActivationDisk.read: file.read(stage[:size], offset).result() #2": "activation-disk",
    "activations/disk.py: ActivationDisk._piece: busy.exception() #1": "activation-disk",
    "activations/disk.py: ActivationDisk._free: busy.exception() #1": "forward-raises",
    "activations/disk.py: ActivationDisk._free: self._transfers.before_host_write(stage) #1": "activation-disk",
    "activations/offload.py: ActivationOffload.recycle: self._transfers.before_host_write(host) #1": (
        "activation-offload"
    ),
    "activations/offload.py: ActivationOffload._unpack: self._layer.wait_event(call.ready) #1": "activation-offload",
    (
        "activations/offload.py: ActivationOffload._unpack: self._layer.record_stream(device, "
        "self._layer.current_stream()) #1"
    ): "activation-offload",
    (
        "activations/offload.py: ActivationOffload._fetch_now: self._transfers.before_host_read(copy.host) #1"
    ): "activation-offload",
    "boosted/model.py: ChunkedModel.apply_load: manager.prepare_master_writes() #1": "load-after-eval",
    "chunks/chunk_grads.py: ChunkGrads._load_host: self._transfers.before_host_read(host) #1": "w2-no-sync-spill",
    (
        "chunks/chunk_grads.py: ChunkGrads._drop_host: self._transfers.before_host_write(self._host) #1"
    ): "w2-no-sync-spill",
    "chunks/chunk_grads.py: ChunkGrads._send: self._comm.wait(work, what) #1": "w2-offload-p3",
    "chunks/chunk_residency.py: ChunkResidency.wait: pending.wait() #1": "auto-p3",
    "chunks/grad_on_disk.py: GradOnDisk.receive: self._transfers.before_host_read(host) #1": "disk-bf16",
    (
        "chunks/grad_on_disk.py: GradOnDisk._read_now: self._file.read(values, self._offset).result() #1"
    ): "disk-accumulate",
    "chunks/grad_on_disk.py: GradOnDisk._settle_writes: future.exception() #1": "disk-bf16",
    "chunks/grad_shard.py: GradShard._settle: self._transfers.before_host_read(self._grad) #1": "auto-p3",
    "chunks/grad_shard.py: GradShard._settle: self._transfers.before_host_read(staged) #2": "auto-p3",
    (
        "chunks/manager.py: ChunkManager.prepare_master_writes: chunk.store.prepare_host_write() #1"
    ): "evaluate-before-step",
    "chunks/param_on_disk.py: _read_or_note: read(into).result() #1": "param-disk-bf16",
    "chunks/param_on_disk.py: read_for_gather: transfers.before_host_write(staged) #1": "param-disk-bf16",
    "chunks/param_on_disk.py: ParamOnDisk.write: transfers.before_host_write(self._kept) #1": "param-disk-full",
    "chunks/param_on_disk.py: ParamOnDisk.write: future.exception() #1": "param-disk-full",
    (
        "chunks/shard.py: ShardStore.prepare_host_write: self._transfers.before_host_write(self._master) #1"
    ): "evaluate-before-step",
    (
        "chunks/shard.py: ShardStore._host_compute: self._transfers.before_host_write(self._host_cast) #1"
    ): "load-after-eval-bf16",
    (
        "chunks/shard.py: ShardStore.move_master_to_disk: file.write(self._master, self._disk_offset, "
        "param=self._master_is_param).result() #2"
    ): "disk-bf16",
    "chunks/shard.py: ShardStore.resident_master: fetched.result() #1": "disk-bf16",
    "chunks/shard.py: ShardStore.resident_master: written.exception() #1": "param-disk-full",
    "chunks/values_in_place.py: InPlaceShard.values: self.read(disk, values).result() #1": "values-in-place",
    "execution/executor.py: ResidencyExecutor._carry: chunk.residency.wait() #1": "auto-p3",
    "optim/disk_sides.py: DiskSides._settle: future.exception() #1": "w2-early-disk",
    "optim/early_steps.py: EarlySteps._wait: f.exception() #1": "w2-early-disk",
    "optim/optimizer.py: ChunkOptimizer._step_on: self._manager.prepare_master_writes() #1": "evaluate-before-step",
    "optim/scaling.py: GradScaling.prepare: self._early.settle() #1": "fp16-early",
    "ranks/comm.py: PendingGather.wait: self._comm.layer.wait_event(self._event) #1": "auto-p3",
    "ranks/comm.py: PendingGather.wait: self._comm.wait(self._work, self._what) #1": "w2-offload-p3",
    "ranks/comm.py: _SlotOfAllReduce.wait: self._work.wait() #1": "w2-offload-p3",
    "ranks/comm.py: _SlotOfAllReduce.wait: self._work.wait(timeout=timeout) #2": "w2-offload-p3-gloo",
    (
        "ranks/comm.py: Communicator.side_stream: self._layer.wait_stream(self._side_stream, "
        "self._layer.current_stream()) #1"
    ): "auto-p3",
    "ranks/comm.py: Communicator.all_gather: self.wait(work, what) #1": "w2-offload-p3",
    "ranks/comm.py: Communicator.wait: work.wait #1": "w2-offload-p3",
    "ranks/comm.py: Communicator.wait: work.wait(timeout=_POLL) #2": "w2-offload-p3-gloo",
    "ranks/comm.py: Communicator.all_reduce: self.wait(work, 'all_reduce') #1": "w2-offload-p3",
    "ranks/comm.py: Communicator.all_gather_tensors: self.wait(work, 'all_gather') #1": "w2-activation-auto",
    "ranks/rank_checks.py: _done: work.wait(timeout=_POLL) #1": "w2-offload-p3",
    (
        "tiers/transfers.py: HostTransfers.copy: layer.wait_stream(stream, layer.current_stream()) #1"
    ): "host-write-after-copy",
    "tiers/transfers.py: HostTransfers.copy: layer.record_stream(source, stream) #1": "host-write-after-copy",
    "tiers/transfers.py: HostTransfers.before_host_read: self._layer.synchronize(event) #1": "host-write-after-copy",
    "tiers/transfers.py: HostTransfers.before_host_write: self._layer.synchronize(event) #1": "activation-offload",
    "tiers/transfers.py: HostTransfers.before_host_write: self.before_host_read(host) #1": "host-write-after-copy",
}


# Calls the scan finds that order nothing a run's data needs (or whose order another wait gives), with why.
NOT_ORDERING: dict[str, str] = {
    "activations/auto.py: AutoBlocks.end_stretch: self._offload.settle(call) #1": (
        "accounting: the ledger drops a call's saved tensors once their copies to the host are done (the allocator "
        "keeps them, record_stream-ed to the copy stream, until then), so the accounted peak is not under the "
        "allocator's; what reads those host copies waits for them itself (_fetch_now's before_host_read)"
    ),
    "activations/auto.py: AutoBlocks._offloaded: self._offload.settle(call) #1": (
        "accounting: the ledger drops a call's saved tensors once their copies to the host are done (the allocator "
        "keeps them, record_stream-ed to the copy stream, until then), so the accounted peak is not under the "
        "allocator's; what reads those host copies waits for them itself (_fetch_now's before_host_read) (without "
        "it the ledger's budget check fails: BudgetExceededError)"
    ),
    "activations/auto.py: AutoBlocks._measure: layer.synchronize(layer.record_event()) #1": (
        "timing only: the host waits for the compute stream around a measured block call, so that the wall clock "
        "measures its forward on a GPU; no data is read after it"
    ),
    "activations/auto.py: AutoBlocks._measure: layer.synchronize(layer.record_event()) #2": (
        "timing only: the host waits for the compute stream around a measured block call, so that the wall clock "
        "measures its forward on a GPU; no data is read after it"
    ),
    "activations/blocks.py: ActivationBlocks._measured_copies: self._transfers.settle(wait=True) #1": (
        "timing: the measured copies' times are read once their end events completed (settle(wait=True)); every "
        "measured copy was waited for by the copy protocol first (the copies out at the call's end, those back "
        "before their buffers were recycled), so no event is unfinished here; on CUDA an unfinished one would "
        "raise, as it does on the simulated device "
        "(test_an_event_completes_once_the_host_waited_for_it_and_elapsed_time_needs_both)"
    ),
    "activations/blocks.py: ActivationBlocks.counts: self._transfers.settle() #1": (
        "waits for nothing: settle() without wait=True adds the times of copies whose end events completed, and "
        "leaves the others"
    ),
    "activations/disk.py: ActivationDisk.settle: write.result() #1": (
        "the failure of a write to disk: every write is waited for by the staging window before its piece is used "
        "again and before any read of the disk (_piece's busy.exception(), caught by activation-disk), so it orders "
        "nothing more; it raises a failed write at the call's end, agreed over ranks"
    ),
    "activations/disk.py: ActivationDisk.read: write.result() #1": (
        "the failure of a write to disk: every write is waited for by the staging window before its piece is used "
        "again and before any read of the disk (_piece's busy.exception(), caught by activation-disk), so it orders "
        "nothing more; it raises a failed write at the call's end, agreed over ranks (here for a call whose forward "
        "raised before it settled; its backward never runs: forward-raises drops it)"
    ),
    "activations/offload.py: ActivationOffload.settle: self._transfers.before_host_read(copy.host) #1": (
        "accounting: the ledger drops a call's saved tensors once their copies to the host are done (the allocator "
        "keeps them, record_stream-ed to the copy stream, until then), so the accounted peak is not under the "
        "allocator's; what reads those host copies waits for them itself (_fetch_now's before_host_read)"
    ),
    (
        "activations/offload.py: ActivationOffload.finish: self._disk.settle([c.disk for c in call.made if c.disk "
        "is not None], call.block, call.failure) #1"
    ): (
        "the failure of a write to disk: every write is waited for by the staging window before its piece is used "
        "again and before any read of the disk (_piece's busy.exception(), caught by activation-disk), so it orders "
        "nothing more; it raises a failed write at the call's end, agreed over ranks"
    ),
    (
        "checkpoint/dcp_reader.py: SafeFileSystemReader.read_data: super().read_data(LoadPlan(items), "
        "planner).wait() #1"
    ): (
        "waits for nothing: DCP's FileSystemReader reads synchronously and returns a torch Future already "
        "completed; the call raises the read's failure (named per file)"
    ),
    "chunks/grad_on_disk.py: GradOnDisk.receive: future.exception() #1": (
        "not a wait: the write's outcome read in its own done-callback (the write is done); it decides whether the "
        "staging buffer goes back to the pool (a failed write keeps it as the gradient), which only a failing "
        "gradient write shows"
    ),
    "chunks/param_on_disk.py: ParamOnDisk.write: self.settle() #1": (
        "accounting: ParamOnDisk.settle frees the staging the ledger counts for a write once it finished (or keeps "
        "a failed write's values, KEPT); the order of what the write read and wrote is given by the futures the "
        "disk pipeline waits for (DiskSides._settle's future.exception(), caught by disk-bf16) and the cast "
        "buffer's done-callback, so no data waits on it"
    ),
    "chunks/param_on_disk.py: ParamOnDisk.settle: future.exception() #1": (
        "reads the outcome of the write, which the disk pipeline waited for before (DiskSides._settle); removed, a "
        "failed write counts as written and the gathers read stale values from disk (param-disk-full: its numbers "
        "differ)"
    ),
    "chunks/param_on_disk.py: ParamOnDisk.copy_into: self.settle() #1": (
        "accounting: ParamOnDisk.settle frees the staging the ledger counts for a write once it finished (or keeps "
        "a failed write's values, KEPT); the order of what the write read and wrote is given by the futures the "
        "disk pipeline waits for (DiskSides._settle's future.exception(), caught by disk-bf16) and the cast "
        "buffer's done-callback, so no data waits on it"
    ),
    "chunks/shard.py: ShardStore.move_master_to_disk: self.settle_param() #1": (
        "accounting: ParamOnDisk.settle frees the staging the ledger counts for a write once it finished (or keeps "
        "a failed write's values, KEPT); the order of what the write read and wrote is given by the futures the "
        "disk pipeline waits for (DiskSides._settle's future.exception(), caught by disk-bf16) and the cast "
        "buffer's done-callback, so no data waits on it"
    ),
    "chunks/shard.py: ShardStore.move_master_to_disk: written.result() #1": (
        "raises a failed write of the parameter shard at boost: settle_param, just before it, waited for that write"
    ),
    "chunks/shard.py: ShardStore.settle_param: self._param_disk.settle() #1": (
        "accounting: ParamOnDisk.settle frees the staging the ledger counts for a write once it finished (or keeps "
        "a failed write's values, KEPT); the order of what the write read and wrote is given by the futures the "
        "disk pipeline waits for (DiskSides._settle's future.exception(), caught by disk-bf16) and the cast "
        "buffer's done-callback, so no data waits on it"
    ),
    "chunks/shard.py: ShardStore.resident_master: self.settle_param() #1": (
        "accounting: ParamOnDisk.settle frees the staging the ledger counts for a write once it finished (or keeps "
        "a failed write's values, KEPT); the order of what the write read and wrote is given by the futures the "
        "disk pipeline waits for (DiskSides._settle's future.exception(), caught by disk-bf16) and the cast "
        "buffer's done-callback, so no data waits on it"
    ),
    "chunks/shard.py: ShardStore.resident_master: param.exception() #2": (
        "raises a failed write of the parameter shard after a checkpoint's read: settle_param, just before it, "
        "waited for that write"
    ),
    "execution/runtime.py: ChunkRuntime.stats: self._manager.transfers.settle() #1": (
        "waits for nothing: settle() without wait=True adds the times of copies whose end events completed, and "
        "leaves the others"
    ),
    "optim/disk_sides.py: DiskSides.evict: chunk.store.settle_param #1": (
        "accounting: ParamOnDisk.settle frees the staging the ledger counts for a write once it finished (or keeps "
        "a failed write's values, KEPT); the order of what the write read and wrote is given by the futures the "
        "disk pipeline waits for (DiskSides._settle's future.exception(), caught by disk-bf16) and the cast "
        "buffer's done-callback, so no data waits on it"
    ),
    "ranks/comm.py: Communicator.reduce_scatter_sum: self.wait(work, what) #1": (
        "the synchronous form (async_op=False), which the library never calls (gradients are reduced asynchronously "
        "and waited for by ChunkGrads._send, caught by w2-offload-p3); "
        "tests/system/ranks/test_distributed.py checks its result"
    ),
    "ranks/comm.py: Communicator.reduce_to_first: self.wait(work, 'reduce') #1": (
        "no caller in the library (the planner's communicator and benchmarks/checkpoint_io.py override or count it)"
    ),
    "ranks/rank_channel.py: _listen: dist.irecv(header, src=None, group=group, tag=_HEADER_TAG).wait() #1": (
        "on the cross-rank channel's listener thread, a thread of its own (not a pool's), which the simulation does "
        "not run: the header it waits for is read on that thread only"
    ),
    "ranks/rank_channel.py: RankChannel._close: send.wait(timeout=_CLOSING_WAIT) #1": (
        "on the thread that closes a channel whose owner was collected, a thread of its own that the simulation "
        "does not run: the closing header it waits for is sent and read on that thread only, and the groups are "
        "destroyed after it (tests/system/ranks/test_rank_channel.py counts what is left)"
    ),
    "ranks/rank_checks.py: _done: work.wait() #2": (
        "a cross-rank check whose collective completed between the poll's timeout and the look (a timing window no "
        "run can be made to hit): the work is done, and the call raises its failure"
    ),
    "ranks/rank_checks.py: RankChecks.diverged: send.wait() #1": (
        "only when every rank departed from the trace the same way (the alarm each sends is waited for before "
        "training goes on): departures are the rank-agreement tests' "
        "(tests/system/ranks/test_rank_divergence.py), not a scenario here"
    ),
    "tiers/disk.py: _close_file: pool.shutdown(wait=True) #1": (
        "joins the disk tier's I/O threads before its file is closed: every read and write was waited for by its "
        "owner before the model that closes it goes (dropped-with-writes drops one right after writes), so no run "
        "closes a file under a transfer; the simulated device checks the close against every transfer "
        "(disk_io_seen) in case one is left"
    ),
    "tiers/transfers.py: HostTransfers._timed: self.settle() #1": (
        "waits for nothing: settle() without wait=True adds the times of copies whose end events completed, and "
        "leaves the others"
    ),
    "tiers/transfers.py: HostTransfers.settle: self._layer.synchronize(end) #1": (
        "timing: the measured copies' times are read once their end events completed (settle(wait=True)); every "
        "measured copy was waited for by the copy protocol first (the copies out at the call's end, those back "
        "before their buffers were recycled), so no event is unfinished here; on CUDA an unfinished one would "
        "raise, as it does on the simulated device "
        "(test_an_event_completes_once_the_host_waited_for_it_and_elapsed_time_needs_both)"
    ),
}


@functools.cache
def sites() -> dict[str, Any]:
    """The waits the AST scan finds, by label: scanned when a test asks (seconds a worker at collection)."""
    return {site.label: site for site in wait_sites()}
