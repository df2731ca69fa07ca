"""ZeRO-3 parameter partitioning: a layer's parameters exist whole only around its forward and backward.

Each transformer layer is one bucket (see ``parallel.zero``). A forward
pre-hook gathers the layer's parameters over dp and starts gathering the next
layer; a forward hook frees them (``reshard_after_forward``); a hook on the
layer's output gathers them again when the output's gradient arrives, and
starts on the layer before. Freeing resizes the buffer's storage to zero, so
the parameter views — and the tensors autograd saved — stay valid and see the
data again once it is gathered back into the same storage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn


@dataclass
class Bucket:
    """A contiguous piece of the parameter buffer and everything reduced or updated with it."""

    params: list  # [(name, Parameter)]
    offsets: list  # element offset of each parameter in the bucket
    numel: int  # padded to a multiple of dp
    full: Tensor = None  # the parameters (stage 3: storage freed while not gathered)
    grad: Optional[Tensor] = None  # full gradient (stages 0-1: kept; 2-3: per microbatch)
    shard_grad: Optional[Tensor] = None  # this rank's reduced slice (stages 1-3)
    shard_param: Optional[Tensor] = None  # stage 3: this rank's slice of the parameters
    master: Optional[Tensor] = None  # fp32 optimizer range (own slice; stage 0: whole bucket)
    exp_avg: Optional[Tensor] = None
    exp_avg_sq: Optional[Tensor] = None
    decay_mask: Optional[Tensor] = None
    norm_mask: Optional[Tensor] = None
    sp_index: Optional[Tensor] = None  # where sequence-parallel parameters' gradients (summed over tp) are
    deferred: bool = False  # reduced after the schedule (tied embedding / stage-3 root)
    unit: Optional[nn.Module] = None  # stage 3: the layer whose parameters these are
    ready: int = 0
    rounds: int = 0
    pending: list = field(default_factory=list)  # (work, output) of in-flight reductions
    gathered: bool = True
    gather_work: object = None
    in_backward: bool = False
    dp: int = 1

    @property
    def shard(self) -> int:
        return self.numel // self.dp


class LayerGathering:
    """Gather/free of stage-3 buckets; mixed into ZeroOptimizer, which owns buckets, grid and counters."""

    def gather_root(self) -> None:
        """Stage 3: gather the root bucket(s) (embeddings, final norm) for a forward outside a step."""
        if self.stage == 3:
            for b in self.buckets:
                if b.deferred:
                    self._gather(b)

    def release(self) -> None:
        """Stage 3: free every gathered bucket (after evaluation, after the step)."""
        if self.stage == 3:
            self.settle_gathers()
            for b in self.buckets:
                if b.gathered:
                    self._free(b)

    def settle_gathers(self) -> None:
        """Complete prefetches nobody used, before the optimizer writes the slices they read."""
        for b in self.buckets:
            if b.gather_work is not None:
                self._gather(b)

    # ----- stage 3: gather and free layers ------------------------------------------------------
    def _free(self, b: Bucket) -> None:
        if b.gathered:
            b.full.untyped_storage().resize_(0)
            b.gathered = False
            self.gathered_bytes -= b.numel * b.full.element_size()

    def _gather(self, b: Bucket, async_op: bool = False) -> None:
        if b.gathered:
            return
        if b.gather_work is not None:
            b.gather_work.wait()
            b.gather_work = None
            b.gathered = True
            return
        b.full.untyped_storage().resize_(b.numel * b.full.element_size())
        self.gathered_bytes += b.numel * b.full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        # From pinned memory when offloaded: an asynchronous copy, ordered before the gather on the stream; the
        # host writes shard_param only in the step, after the gathers settle and the overflow check syncs.
        shard = b.shard_param.to(self.device, non_blocking=True)
        work = self.grid.dp_comm.all_gather_into(b.full.data, shard, tag="param", async_op=async_op)
        if work is not None:  # in flight (async_op): settled by the next _gather or settle_gathers
            b.gather_work = work
        else:  # done (synchronous, or dp = 1: a local copy)
            b.gathered = True

    def _install_unit_hooks(self) -> None:
        units = [b for b in self.buckets if b.unit is not None]
        order = list(reversed(units))  # forward order within the stage
        for i, b in enumerate(order):
            nxt = order[i + 1] if i + 1 < len(order) else None
            prev = order[i - 1] if i > 0 else None
            b.unit.register_forward_pre_hook(self._pre_forward(b, nxt))
            b.unit.register_forward_hook(self._post_forward(b, prev))

    def _pre_forward(self, b: Bucket, nxt: Optional[Bucket]):
        def hook(module, args):
            self._gather(b)
            # not while recomputing under activation checkpointing: the next layer's backward is already done
            if nxt is not None and not b.in_backward and not nxt.gathered and nxt.gather_work is None:
                self._gather(nxt, async_op=True)  # prefetch the next layer
        return hook

    def _post_forward(self, b: Bucket, prev: Optional[Bucket]):
        def hook(module, args, output):
            if b.in_backward:  # recomputation under activation checkpointing: keep for the backward
                return
            if torch.is_grad_enabled() and output.requires_grad:
                def pre_backward(grad):
                    b.in_backward = True
                    self._gather(b)
                    if prev is not None and not prev.gathered and prev.gather_work is None:
                        self._gather(prev, async_op=True)  # prefetch the layer before
                    return None
                output.register_hook(pre_backward)
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(b)
        return hook

