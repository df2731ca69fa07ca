"""ZeRO's gradient path: sums over microbatches, reductions over dp overlapped with backward, bounded memory.

A hook on every parameter adds its gradient into its bucket's flat buffer (in ``zero.grad_dtype``) and
drops the parameter's own copy. When a bucket has every gradient of a microbatch, the policy decides:
unsharded gradients (stages 0-1) are reduced once, after the last microbatch (all-reduce, or reduce-scatter
into the own slice); sharded gradients (stages 2-3) are reduce-scattered every microbatch and the full
buffer is dropped. A reduction reads its input until it is waited (NCCL holds it), so under sharded
gradients at most ``max_in_flight`` reductions are in flight on this rank: launching one more first waits
for the oldest and adds its output into the shard, and the last bucket of a microbatch's backward drains
them all, so the next forward starts with none (DeepSpeed's ipg buckets do the same). Peak gradient
memory is then the shards plus a few buckets, the same at m = 1 as at any number of microbatches.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch
from torch import Tensor

from megazero.parallel.comm import Comm
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.policy import StagePolicy


def grad_precision(precision: str, grad_dtype: str = "auto") -> str:
    """The precision gradients are accumulated over microbatches and reduced over dp in (``zero.grad_dtype``).

    auto is fp32 under bf16, as Megatron-LM does: bf16 keeps 8 mantissa bits, so a sum of many microbatches'
    gradients loses the small ones. fp16 keeps 11 bits and is loss-scaled, and stays fp16 (both frameworks'
    default); "model" keeps the paper's 2 bytes per gradient for any precision."""
    if grad_dtype == "fp32" or (grad_dtype == "auto" and precision == "bf16"):
        return "fp32"
    return precision


class GradReducer:
    """Backward hooks, microbatch sums and reductions over dp; ``finish()`` leaves every bucket's reduced
    gradient of the optimizer's range in ``grad(b)``.

    ``on_backward_done(b)``: called when a bucket's gradients of one microbatch are all in (stage 3 frees the
    layer there). ``on_final(b, grad)``: called once per step when a bucket's reduced gradient is final
    (the offloaded optimizer starts its copy to the host there, overlapping the rest of backward).
    ``before_deferred(b, full)``: called with a deferred bucket's whole buffer just before its dp reduction
    (``parallel.zero.finalize`` sums tied copies there)."""

    def __init__(self, layout: BucketLayout, policy: StagePolicy, dp: Comm, grad_dtype: torch.dtype,
                 device: torch.device, max_in_flight: int = 2,
                 on_backward_done: Optional[Callable[[Bucket], None]] = None,
                 on_final: Optional[Callable[[Bucket, Tensor], None]] = None,
                 before_deferred: Optional[Callable[[Bucket, Tensor], None]] = None):
        self.layout, self.policy, self.dp = layout, policy, dp
        self.grad_dtype, self.device = grad_dtype, device
        assert max_in_flight >= 1, max_in_flight
        self.max_in_flight = max_in_flight if policy.bound_in_flight else None
        self.on_backward_done, self.on_final, self.before_deferred = on_backward_done, on_final, before_deferred
        n = len(layout.buckets)
        self.full: list[Optional[Tensor]] = [None] * n  # a microbatch's (or, unsharded, the step's) bucket sum
        if policy.keeps_full_grads:
            for b in layout.buckets:
                self.full[b.index] = torch.zeros(b.numel, dtype=grad_dtype, device=device)
        # the reduced gradient of the optimizer's range: the own slice (sharded optimizer) or the whole bucket.
        # Stage 1 keeps the whole buffer and reduce-scatters it in place, into its own slice (NCCL's in-place
        # reduce-scatter; gloo copies): no second buffer, so model states are (2+2+K/N)Ψ as in the paper
        self.shard: list[Optional[Tensor]] = [None] * n
        self.in_place = policy.shard_optimizer and policy.keeps_full_grads
        if policy.shard_optimizer:
            for b in layout.buckets:
                lo, hi = layout.own_slice(b)
                self.shard[b.index] = self.full[b.index][lo:hi] if self.in_place else \
                    torch.zeros(b.shard, dtype=grad_dtype, device=device)
        self.ready, self.rounds = [0] * n, [0] * n
        # per bucket and parameter: its gradient is in the buffer (the first is copied in, the rest added); per
        # parameter, not per bucket, as a bucket may span model chunks whose backwards interleave
        self.written: list[list[bool]] = [[False] * len(b.params) for b in layout.buckets]
        self.rounds_done = 0  # bucket reductions launched this step (bounded mode)
        self.reduced_buckets = max(1, sum(not b.deferred for b in layout.buckets))
        self.microbatches = 1
        # this step's gradients stay local (no reduction over dp): an optimizer that communicates something else
        # in their place (1-bit Adam's compressed momentum); grad(b) is then the whole bucket
        self.local = False
        self.in_flight: deque = deque()  # (bucket, work, output, input) in launch order
        self.elem = torch.tensor([], dtype=grad_dtype).element_size()
        self.live_bytes = sum(t.numel() for t in self.full + ([] if self.in_place else self.shard)
                              if t is not None) * self.elem
        self.peak_bytes = self.live_bytes  # gradient bytes alive at once (buffers, shards, reductions in flight)
        for b in layout.buckets:
            offsets = {id(q): off for (_, q), off in zip(b.params, b.offsets)}
            for _, p in b.params:
                p.register_post_accumulate_grad_hook(self._hook(b, offsets))

    # ----- accounting ---------------------------------------------------------------------------------------
    def _alloc(self, numel: int, used: Optional[int] = None) -> Tensor:
        """A buffer of ``numel``, uninitialised but for the padding past ``used`` (zeroed): the first gradient
        of a round is copied in, not added, so nothing needs zeroing first (DDP's reducer does the same)."""
        self.live_bytes += numel * self.elem
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        t = torch.empty(numel, dtype=self.grad_dtype, device=self.device)
        t[numel if used is None else used:].zero_()
        return t

    def _drop(self, t: Tensor) -> None:
        self.live_bytes -= t.numel() * self.elem

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    # ----- backward -------------------------------------------------------------------------------------------
    def begin(self, microbatches: int, local: bool = False) -> None:
        assert not self.in_flight, "a reduction of an earlier step was never completed"
        assert microbatches >= 1, microbatches
        assert not local or self.policy.keeps_full_grads, "local gradients need whole buffers (stages 0-1)"
        self.microbatches, self.local = microbatches, local
        self.ready = [0] * len(self.ready)
        self.rounds = [0] * len(self.rounds)
        self.rounds_done = 0

    def _hook(self, b: Bucket, offsets: dict[int, int]):
        used = b.offsets[-1] + b.params[-1][1].numel()
        position = {id(q): j for j, (_, q) in enumerate(b.params)}

        def hook(p: Tensor) -> None:
            i = b.index
            if self.full[i] is None:
                self.full[i] = self._alloc(b.numel, used)
                self.written[i] = [False] * len(b.params)
            off, j = offsets[id(p)], position[id(p)]
            view = self.full[i][off:off + p.numel()]
            if self.written[i][j]:
                view.add_(p.grad.reshape(-1))
            else:  # the buffer's first gradient for this parameter: copied, so nothing needs zeroing first
                view.copy_(p.grad.reshape(-1))
                self.written[i][j] = True
            p.grad = None
            self.ready[i] += 1
            if self.ready[i] == len(b.params):
                self.ready[i] = 0
                self.rounds[i] += 1
                if self.on_backward_done is not None:
                    self.on_backward_done(b)
                if not b.deferred:
                    self._round_done(b)
        return hook

    def _round_done(self, b: Bucket) -> None:
        """All of a bucket's gradients of one microbatch are in: reduce now if the policy says so."""
        last = self.rounds[b.index] == self.microbatches
        if not (last or self.policy.reduce_every_microbatch):
            return
        written = self.written[b.index]
        if not all(written):  # a bucket spanning interleaved chunks: a count of hooks, not every parameter's,
            for j, ((_, p), off) in enumerate(zip(b.params, b.offsets)):  # completed the round; what has not
                if not written[j]:  # arrived yet is zero in this reduction (it comes in the next: sums are linear)
                    self.full[b.index][off:off + p.numel()].zero_()
        self._reduce(b)
        if self.max_in_flight is not None:  # a microbatch's backward is over when every bucket reduced once:
            self.rounds_done += 1  # drain, so the next forward starts with nothing in flight, as at m = 1
            if self.rounds_done % self.reduced_buckets == 0:
                while self.in_flight:
                    self._complete_oldest()

    def _reduce(self, b: Bucket) -> None:
        src = self.full[b.index]
        if self.local:
            self._launch(b, None, None, None)
            return
        if not self.policy.shard_optimizer:
            self._launch(b, self.dp.all_reduce(src, tag="grad", async_op=True), None, None)
            self._complete_finished()
            return
        if self.in_place:
            self._launch(b, self.dp.reduce_scatter_into(self.shard[b.index], src, tag="grad", async_op=True),
                         None, None)
            self._complete_finished()
            return
        if self.max_in_flight is not None:
            while len(self.in_flight) >= self.max_in_flight:
                self._complete_oldest()
        out = self._alloc(b.shard)
        work = self.dp.reduce_scatter_into(out, src, tag="grad", async_op=True)
        if self.policy.shard_grads:  # the buffer is the reduction's input until it is waited; then dropped
            self.full[b.index] = None
            self._launch(b, work, out, src)
        else:
            self._launch(b, work, out, None)
            self._complete_finished()

    def _complete_finished(self) -> None:
        """Unbounded mode: take in the reductions that are already done (no wait), so their buckets' final
        gradients reach ``on_final`` (the offloaded optimizer's copy to the host) during the backward."""
        while self.in_flight and self.in_flight[0][1].is_completed():
            self._complete_oldest()

    def _launch(self, b: Bucket, work, out: Optional[Tensor], src: Optional[Tensor]) -> None:
        if work is None:  # dp = 1: a local copy, done already
            self._complete((b, work, out, src))
        else:
            self.in_flight.append((b, work, out, src))

    def _complete_oldest(self) -> None:
        self._complete(self.in_flight.popleft())

    def _complete(self, item: tuple) -> None:
        b, work, out, src = item
        if work is not None:
            work.wait()
        if out is not None:
            self.shard[b.index].add_(out)
            self._drop(out)
        if src is not None:
            self._drop(src)
        if self.rounds[b.index] == self.microbatches and self.on_final is not None and not self._pending(b):
            self.on_final(b, self.grad(b))

    def _pending(self, b: Bucket) -> bool:
        return any(x[0] is b for x in self.in_flight)

    # ----- after the schedule -----------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for the reductions started in backward and reduce the deferred buckets. Afterwards ``grad(b)``
        is every bucket's reduced gradient of the optimizer's range (over dp: ``parallel.zero.finalize`` adds
        the sums over other groups)."""
        for b in self.layout.buckets:
            if self.rounds[b.index] != self.microbatches or self.ready[b.index]:
                # else the dp ranks would silently drift apart
                raise RuntimeError(
                    f"ZeRO: a gradient is missing for one of {b.names()} ({self.rounds[b.index]} of "
                    f"{self.microbatches} microbatches complete): every parameter given to the ZeroOptimizer "
                    f"must take part in every microbatch's loss")
        while self.in_flight:
            self._complete_oldest()
        for b in self.layout.buckets:
            if b.deferred:
                self._reduce_deferred(b)

    def _reduce_deferred(self, b: Bucket) -> None:
        i = b.index
        if self.full[i] is None:
            self.full[i] = self._alloc(b.numel, 0)
        if self.before_deferred is not None:
            self.before_deferred(b, self.full[i])
        if self.local:
            pass
        elif not self.policy.shard_optimizer:
            self.dp.all_reduce(self.full[i], tag="grad")
        elif self.in_place:
            self.dp.reduce_scatter_into(self.shard[i], self.full[i], tag="grad")
        else:
            out = self._alloc(b.shard)
            self.dp.reduce_scatter_into(out, self.full[i], tag="grad")
            self.shard[i].add_(out)
            self._drop(out)
            if self.policy.shard_grads:
                self._drop(self.full[i])
                self.full[i] = None
        if self.on_final is not None:
            self.on_final(b, self.grad(b))

    def grad(self, b: Bucket) -> Tensor:
        """The reduced gradient of the optimizer's range (valid after ``finish``); a local step's whole bucket."""
        return self.shard[b.index] if self.policy.shard_optimizer and not self.local else self.full[b.index]

    def zero_grad(self) -> None:
        for b in self.layout.buckets:
            i = b.index
            if self.policy.keeps_full_grads:  # overwritten by the next step's first gradients, not zeroed
                self.written[i] = [False] * len(b.params)
            elif self.full[i] is not None:
                self._drop(self.full[i])
                self.full[i] = None
            if self.shard[i] is not None and not self.in_place:  # in place: the whole buffer is overwritten
                self.shard[i].zero_()
