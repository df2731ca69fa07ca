"""ZeRO's parts for the parameters that reduce over one group: the dense ones over dp, the experts' over edp.

A parameter declares its group (``parallel.zero.declared.reduce_group``); each group gets its own flat
buckets, reducer, gatherer, optimizer states and checkpoint owners, sharded over that group's ranks, so an
expert's states are split over the edp ranks that hold it as a dense parameter's are over dp. The
``ZeroOptimizer`` composes the partitions and owns what spans them: the one overflow all-reduce, the norm.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from megazero.parallel.comm import Comm
from megazero.parallel.zero.checkpoint import ZeroCheckpoint
from megazero.parallel.zero.finalize import GradFinalizer
from megazero.parallel.zero.gather import ParamGatherer
from megazero.parallel.zero.grads import GradReducer
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.nvme_params import NvmeParams
from megazero.parallel.zero.policy import StagePolicy
from megazero.parallel.zero.update import Update


class Partition:
    def __init__(self, name: str, chunks: list[nn.Module], select: Callable[[nn.Parameter], bool], comm: Comm,
                 tied: Comm, tp: Comm, policy: StagePolicy, dtype: torch.dtype, grad_dtype: torch.dtype,
                 bucket_mb: float, device: torch.device, param_device: torch.device,
                 initial_value: Optional[Callable[[nn.Parameter], Tensor]], reshard_after_forward: bool,
                 overlap_param_gather: bool, max_in_flight: int,
                 make_optim: Callable[[BucketLayout, Comm], Update],
                 param_disk: Optional[Callable[[], NvmeParams]] = None):
        """``comm``: the group this partition's gradients are reduced and its states sharded over; ``tied``: the
        group that sums tied copies (the embedding group); ``tp``: the tensor-parallel group; ``make_optim``:
        the update on this rank's share (``parallel.zero.update.Update``), from the layout and ``comm``;
        ``param_disk``: stage 3's shards on a local disk (``zero.offload_params=nvme``), its file made here."""
        self.name, self.comm, self.policy = name, comm, policy
        self.layout = BucketLayout(chunks, policy, comm.size, comm.rank, dtype, grad_dtype, bucket_mb, device,
                                   param_device, select=select)
        self.optim = make_optim(self.layout, comm)
        self.finalize = GradFinalizer(tied, tp, device)

        local = self.optim.may_read_local_gradients()

        def add(b: Bucket, initial: Tensor) -> None:
            decay, count, sp = self.layout.mask_runs(b, tp.rank)
            self.optim.add_bucket(b, initial, decay, count)
            whole = self.layout.mask_runs(b, tp.rank, whole=True)[2] if local else None
            self.finalize.add_bucket(b, sp, whole)

        try:
            if param_disk is not None:
                self.layout.param_disk = param_disk()
            self.layout.materialise(initial_value, add)
        except BaseException:  # a disk too small: neither scratch file outlives the start
            self.close()
            raise
        self.gatherer = ParamGatherer(chunks, self.layout, policy, comm, device, reshard_after_forward,
                                      overlap_param_gather)
        self.reducer = GradReducer(self.layout, policy, comm, grad_dtype, device, max_in_flight,
                                   on_backward_done=self.gatherer.backward_done, on_final=self.optim.grad_ready,
                                   before_deferred=self.finalize.sum_tied)
        self.checkpoint = ZeroCheckpoint(self.layout, policy, self.optim, comm, device, host_ok=tp.size == 1)

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    def tensors_by_kind(self, offload_optimizer: bool, offload_params: bool) -> dict[str, list[Tensor]]:
        """This partition's share of ``ZeroOptimizer.tensors_by_kind``."""
        o, buckets, r = self.optim, self.buckets, self.reducer
        on_disk = self.layout.param_disk is not None  # the shards' storage is empty outside the step
        shards = [b.shard_param for b in buckets if b.shard_param is not None and not on_disk]
        grads = [t for t in r.full + r.shard if t is not None]
        staging, states = o.staging_tensors(), o.state_tensors()
        host = (states + staging if offload_optimizer else []) + (shards if offload_params else [])
        return {"params": [b.full for b in buckets] + shards, "grads": grads + staging, "optimizer": states,
                "host": host}

    def state_bytes(self, keeps_full_grads: bool, on_gpu: bool) -> dict[str, int]:
        """This partition's share of ``ZeroOptimizer.model_state_bytes``: bytes by kind and place."""
        out = dict.fromkeys(("params", "grads", "optimizer", "cpu", "nvme"), 0)
        disk = self.layout.param_disk
        out["nvme"] = (disk.disk_bytes() if disk is not None else 0) + self.optim.disk_bytes()
        for b in self.buckets:
            if b.shard_param is None:
                out["params"] += b.full.numel() * b.full.element_size()
            elif disk is None:  # (on a disk: counted above)
                n = b.shard_param.numel() * b.shard_param.element_size()
                out["cpu" if self.layout.param_device.type == "cpu" and on_gpu else "params"] += n
            grads = self.reducer.full[b.index] if keeps_full_grads else self.reducer.shard[b.index]
            out["grads"] += grads.numel() * grads.element_size()
        opt = self.optim.state_bytes()
        if self.optim.offloaded() or self.optim.disk_bytes():  # on the host: the states, or their buffers
            out["cpu"] += opt + self.optim.staging_bytes()  # and the gradients' pinned landing buffers
        else:
            out["optimizer"] += opt
        return out

    def close(self) -> None:
        """Remove the scratch files (the states', the shards')."""
        self.optim.close()
        if self.layout.param_disk is not None:
            self.layout.param_disk.close()

    def grads(self) -> list[Tensor]:
        return [self.reducer.grad(b) for b in self.buckets]

    def begin(self, microbatches: int) -> None:
        """Before the schedule: the reducer learns whether this step's gradients are reduced over dp."""
        self.reducer.begin(microbatches, local=not self.optim.reads_reduced_gradients())
        self.gatherer.gather_root()

    def reduce(self) -> None:
        """Complete this partition's gradients: over its group (tied copies first), then the tp sums."""
        self.gatherer.settle()  # stage 3's unused prefetches, before the update writes what they read
        if self.layout.param_disk is not None and self.buckets and self.optim.master_is_param[0]:
            self.layout.param_disk.prefetch(self.buckets[0])  # the step's first shard, read as the reductions end
        self.reducer.finish()
        self.finalize.sum_sequence_parallel(self.grads(), whole=self.reducer.local)
