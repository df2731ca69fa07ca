"""The sums that complete a step's gradients besides the data-parallel reduction (Megatron-core's
``finalize_model_grads``), each read from what the model declares, never from parameter names.

- Tied copies: a parameter two pipeline stages hold (the token embedding of a tied head, on the first and the
  last stage; ``tied_parameters()``, ``parallel.zero.declared``) has its gradient summed with the other
  copy's over the group that joins them (Megatron's embedding group), in its deferred bucket's buffer just
  before that bucket is reduced over dp, so both copies take the same update.
- Sequence parallelism: a parameter marked ``sequence_parallel`` (the norms, the position table, a mixture of
  experts' router and experts) saw 1/tp of the tokens on each tp rank, so its reduced gradient is summed over
  tp, once every bucket is reduced: one all-reduce of the short runs of every bucket gathered together, and
  one in place per long run.

``ZeroOptimizer.reduce`` orders them: the reducer's deferred buckets (``sum_tied`` first), then
``sum_sequence_parallel``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megazero.kernels.adam_cpu import Run
from megazero.parallel.comm import Comm
from megazero.parallel.zero.layout import Bucket

# sequence-parallel runs at least this long are summed over tp in place, one all-reduce each: the scattered
# short ones (norm scales) are gathered into one buffer, which for a bucket of experts' gradients (all of
# them summed over tp) would be a second copy of the bucket
LONG_RUN = 2 ** 16


class GradFinalizer:
    def __init__(self, tied: Comm, tp: Comm, device: torch.device):
        """tied: the group that sums tied copies (the embedding group); tp: the tensor-parallel group."""
        self.tied, self.tp, self.device = tied, tp, device
        # per bucket, over the optimizer's range (False) and, where it is asked for, the whole bucket (True):
        # where the short sequence-parallel runs are, and the long runs, summed in place
        self.sp_index: dict[bool, list[Optional[Tensor]]] = {False: [], True: []}
        self.sp_long: dict[bool, list[list[tuple[int, int]]]] = {False: [], True: []}

    def add_bucket(self, b: Bucket, sequence_parallel: list[Run], whole: Optional[list[Run]] = None) -> None:
        """A bucket's runs of (sequence-parallel) over the optimizer's range (``BucketLayout.mask_runs``), in
        bucket order, and optionally over the whole bucket; kept as an index on the device, so the step needs no
        host sync."""
        assert b.index == len(self.sp_index[False]), (b.index, len(self.sp_index[False]))
        for key, runs in ((False, sequence_parallel), (True, whole)):
            if runs is None:
                continue
            on = [(a, z) for a, z, flag in runs if flag]
            parts = [torch.arange(a, z, device=self.device) for a, z in on if z - a < LONG_RUN]
            self.sp_index[key].append(torch.cat(parts) if parts else None)
            self.sp_long[key].append([(a, z) for a, z in on if z - a >= LONG_RUN])

    def sum_tied(self, b: Bucket, full: Tensor) -> None:
        """Sum the tied copies' gradients in a deferred bucket's whole buffer, before its dp reduction."""
        for j in b.tied:
            off, n = b.offsets[j], b.params[j][1].numel()
            self.tied.all_reduce(full[off:off + n], tag="grad")

    def sum_sequence_parallel(self, grads: list[Tensor], whole: bool = False) -> None:
        """Sum the sequence-parallel parameters' reduced gradients over tp (``grads``: every bucket's range, or
        with ``whole`` every whole bucket)."""
        if self.tp.size == 1:
            return
        assert len(self.sp_index[whole]) == len(grads), "whole-bucket runs were not given"
        for g, long in zip(grads, self.sp_long[whole]):  # a mixture of experts' experts: whole buckets, in place
            for a, z in long:
                self.tp.all_reduce(g[a:z], tag="grad")
        parts = [(g, idx) for g, idx in zip(grads, self.sp_index[whole]) if idx is not None]
        if not parts:
            return
        flat = torch.cat([g.index_select(0, idx) for g, idx in parts])
        self.tp.all_reduce(flat, tag="grad")
        start = 0
        for g, idx in parts:
            g.index_copy_(0, idx, flat[start:start + idx.numel()])
            start += idx.numel()

    def rewritten(self) -> set[int]:
        """The buckets whose gradients ``sum_sequence_parallel`` changes after they were final (an early host
        copy of them must be sent again)."""
        if self.tp.size == 1:
            return set()
        return {i for i, (idx, long) in enumerate(zip(self.sp_index[False], self.sp_long[False]))
                if idx is not None or long}
