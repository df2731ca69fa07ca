"""ZeRO's parameter gathers: stage 3's gather/free around each layer, stages 1-2's all-gather after the step.

Sharded parameters (stage 3): each transformer layer is one bucket. A forward pre-hook gathers the layer's
parameters over dp and starts gathering the next layer; a forward hook frees them
(``reshard_after_forward``); a hook on the layer's output gathers them again when the output's gradient
arrives, and starts on the layer before. Freeing resizes the buffer's storage to zero, so the parameter
views, and the tensors autograd saved, stay valid and see the data again once it is gathered back.

Sharded optimizer, whole parameters (stages 1-2): after the update every rank holds only its own slice
up to date. The all-gather of every bucket is started asynchronously, in forward order, and each is
waited for just before its first use in the next forward (a pre-hook on every module that holds
parameters, and on its parent, which may read them without calling it), as Megatron-LM's
``overlap_param_gather`` does: the gathers overlap the next step's data
loading and first layers instead of blocking the step's end.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megazero.parallel.comm import Comm
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.policy import StagePolicy


class ParamGatherer:
    def __init__(self, chunks: list[nn.Module], layout: BucketLayout, policy: StagePolicy, dp: Comm,
                 device: torch.device, reshard_after_forward: bool = True, overlap: bool = True):
        self.layout, self.policy, self.dp, self.device = layout, policy, dp, device
        self.reshard_after_forward, self.overlap = reshard_after_forward, overlap
        n = len(layout.buckets)
        self.gathered = [not policy.shard_params] * n
        self.work: list = [None] * n  # in-flight gathers: (work, input kept alive until waited)
        self.in_backward = [False] * n
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.read_next: dict[int, Optional[Bucket]] = {}  # stage 3: the layer two ahead in forward order
        self.read_prev: dict[int, Optional[Bucket]] = {}  # and two behind (the backward's order)
        self.first_layers: list[Bucket] = []  # each chunk's first two layers (a forward's first gathers)
        if policy.shard_params:
            self._install_unit_hooks()
        elif policy.gather_after_step and overlap:
            self._install_use_hooks(chunks)

    # ----- shared -------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Complete every gather in flight (before anything reads or writes the buffers outside a forward)."""
        for b in self.layout.buckets:
            if self.work[b.index] is not None:
                self._wait(b)

    def _wait(self, b: Bucket) -> None:
        work, _ = self.work[b.index]
        if work is not None:
            work.wait()
        self.work[b.index] = None
        self.gathered[b.index] = True

    # ----- stages 1-2: after the step -----------------------------------------------------------------------
    def after_step(self) -> None:
        """Every rank updated its slice: all-gather the buckets (started now; waited at first use)."""
        if self.policy.shard_params:
            self.release()
            self._post_reads([b for b in self.layout.buckets if b.deferred])  # on a disk: the next step's root
            return
        if not self.policy.gather_after_step:
            return
        if self.dp.size == 1:  # the own slice is the whole bucket: nothing to gather
            return
        for b in reversed(self.layout.buckets):  # forward order: the first needed is the first done
            lo, hi = self.layout.own_slice(b)
            # NCCL gathers in place (the input is the output's own slice); gloo wants separate buffers
            mine = b.full[lo:hi] if b.full.device.type == "cuda" else b.full[lo:hi].clone()
            work = self.dp.all_gather_into(b.full, mine, tag="param", async_op=self.overlap)
            if self.overlap and work is not None:
                self.work[b.index] = (work, mine)
                self.gathered[b.index] = False

    def _install_use_hooks(self, chunks: list[nn.Module]) -> None:
        """A bucket is waited for before the forward of each module holding one of its parameters, and of that
        module's parent below the chunk: a parent may read a child's weights without calling it (a Llama
        attention's q, k, v share one input gather through ``column_parallel_linears``)."""
        where = {id(p): b for b in self.layout.buckets for _, p in b.params}
        for chunk in chunks:
            parent = {id(child): m for m in chunk.modules() for child in m.children()}
            waits: dict[int, tuple[nn.Module, dict]] = {}
            for module in chunk.modules():
                mine = {where[id(p)].index: where[id(p)] for p in module.parameters(recurse=False)
                        if id(p) in where}
                if module is chunk:  # deferred buckets (the tied copy) are read by the chunk's own forward
                    mine.update({b.index: b for b in self.layout.buckets if b.deferred})
                up = parent.get(id(module))
                for target in [module] + ([up] if up is not None and up is not chunk and mine else []):
                    waits.setdefault(id(target), (target, {}))[1].update(mine)
            for target, mine in waits.values():
                if mine:
                    target.register_forward_pre_hook(self._wait_hook(list(mine.values())))

    def _wait_hook(self, buckets: list[Bucket]):
        def hook(module, args):
            for b in buckets:
                if self.work[b.index] is not None:
                    self._wait(b)
        return hook

    # ----- stage 3: gather and free layers --------------------------------------------------------------------
    def gather_root(self) -> None:
        """Gather the root bucket(s) (embeddings, final norm) for the forwards of a step or an evaluation."""
        if self.policy.shard_params:
            for b in self.layout.buckets:
                if b.deferred:
                    self._gather(b)
            self._post_reads(self.first_layers)  # shards on a disk: the forward's first layers

    def release(self) -> None:
        """Free every gathered bucket (after evaluation, after the step)."""
        if self.policy.shard_params:
            self.settle()
            for b in self.layout.buckets:
                self._free(b)

    def backward_done(self, b: Bucket) -> None:
        """A layer's gradients of one microbatch are all in: it is not needed again until the next forward."""
        if self.policy.shard_params and b.unit is not None:
            self.in_backward[b.index] = False
            if self.reshard_after_forward:
                self._free(b)

    def _free(self, b: Bucket) -> None:
        if self.gathered[b.index]:
            b.full.untyped_storage().resize_(0)
            self.gathered[b.index] = False
            self.gathered_bytes -= b.numel * b.full.element_size()

    def _gather(self, b: Bucket, async_op: bool = False) -> None:
        if self.gathered[b.index]:
            return
        if self.work[b.index] is not None:
            self._wait(b)
            return
        b.full.untyped_storage().resize_(b.numel * b.full.element_size())
        self.gathered_bytes += b.numel * b.full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        # From pinned memory when offloaded: an asynchronous copy, ordered before the gather on the stream; the
        # host writes shard_param only in the step, after the gathers settle and the overflow check syncs. From a
        # disk (offload_params=nvme): a buffer of its own, read ahead, pageable (the copy is staged, synchronous).
        shard = self.layout.shard_values(b).to(self.device, non_blocking=True)
        work = self.dp.all_gather_into(b.full.data, shard, tag="param", async_op=async_op)
        if work is not None:  # in flight: settled by the next _gather or settle()
            self.work[b.index] = (work, shard)
        else:  # done (synchronous, or dp = 1: a local copy)
            self.gathered[b.index] = True

    def _install_unit_hooks(self) -> None:
        """Prefetch within a model chunk only: under an interleaved schedule the next chunk's first layer runs
        much later (after other microbatches), and prefetching it would keep a third layer gathered."""
        for c in sorted({b.chunk for b in self.layout.buckets}):
            order = [b for b in reversed(self.layout.buckets) if b.unit is not None and b.chunk == c]  # forward
            for i, b in enumerate(order):
                nxt = order[i + 1] if i + 1 < len(order) else None
                prev = order[i - 1] if i > 0 else None
                # shards on a disk: a layer's read is posted as the layer before it starts gathering
                self.read_next[b.index] = order[i + 2] if i + 2 < len(order) else None
                self.read_prev[b.index] = order[i - 2] if i > 1 else None
                b.unit.register_forward_pre_hook(self._pre_forward(b, nxt))
                b.unit.register_forward_hook(self._post_forward(b, prev, order[-2:] if nxt is None else []))
            self.first_layers += order[:2]

    def _post_reads(self, buckets: list[Bucket]) -> None:
        """Shards on a disk: post the reads of the layers a pass starts with (each read once; the step's write of a
        shard drops a read posted before it)."""
        if self.layout.param_disk is not None:
            for b in buckets:
                self.layout.param_disk.prefetch(b)

    def _read_ahead(self, b: Optional[Bucket]) -> None:
        """Shards on a disk (zero.offload_params=nvme): post the read of the layer after the one being prefetched."""
        if self.layout.param_disk is not None and self._idle(b):
            self.layout.param_disk.prefetch(b)

    def _idle(self, b: Optional[Bucket]) -> bool:
        return b is not None and not self.gathered[b.index] and self.work[b.index] is None

    def _pre_forward(self, b: Bucket, nxt: Optional[Bucket]):
        def hook(module, args):
            self._gather(b)
            # not while recomputing under activation checkpointing: the next layer's backward is already done
            if not self.in_backward[b.index] and self._idle(nxt):
                self._gather(nxt, async_op=True)  # prefetch the next layer
                self._read_ahead(self.read_next[b.index])
        return hook

    def _post_forward(self, b: Bucket, prev: Optional[Bucket], tail: list[Bucket]):
        def hook(module, args, output):
            if self.in_backward[b.index]:  # recomputation under activation checkpointing: keep for the backward
                return
            if torch.is_grad_enabled() and output.requires_grad:
                def pre_backward(grad):
                    self.in_backward[b.index] = True
                    self._gather(b)
                    if self._idle(prev):
                        self._gather(prev, async_op=True)  # prefetch the layer before
                        self._read_ahead(self.read_prev[b.index])
                    if prev is None:  # the backward's last layer: the next forward's first
                        self._post_reads(self.first_layers)
                    return None
                output.register_hook(pre_backward)
                self._post_reads(tail)  # the forward's last layer: the backward's first
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(b)
        return hook
