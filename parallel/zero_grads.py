"""ZeRO's gradient path: sums over microbatches, reductions over dp, overlapped with backward.

A hook on every parameter adds its gradient into its bucket's flat buffer (in ``zero.grad_dtype``) and
drops the parameter's own copy. When a bucket has every gradient of a microbatch, the stage decides: stages
0-1 reduce on the last microbatch (all-reduce; reduce-scatter into the own slice), stages 2-3 reduce-scatter
every microbatch and free the full gradient. Buckets holding the tied embedding or stage 3's root are
deferred to the end of the schedule, when both embedding copies' gradients are in.
"""
from __future__ import annotations

import torch
from torch import Tensor

from parallel.zero_params import Bucket


def grad_precision(precision: str, grad_dtype: str = "auto") -> str:
    """The precision gradients are accumulated over microbatches and reduced over dp in (``zero.grad_dtype``).

    auto is fp32 under bf16, as Megatron-LM does: bf16 keeps 8 mantissa bits, so a sum of many microbatches'
    gradients loses the small ones. fp16 keeps 11 bits and is loss-scaled, and stays fp16 (both frameworks'
    default); "model" keeps the paper's 2 bytes per gradient for any precision."""
    if grad_dtype == "fp32" or (grad_dtype == "auto" and precision == "bf16"):
        return "fp32"
    return precision


class GradientReduction:
    """Backward hooks that sum each bucket's gradients over microbatches and reduce them over dp as soon as the
    stage allows; mixed into ZeroOptimizer, which owns the buckets, grid, stage and dtypes."""

    def begin_step(self, microbatches: int) -> None:
        self.microbatches = microbatches
        for b in self.buckets:
            b.rounds = b.ready = 0
        self.gather_root()

    def _grad_hook(self, b: Bucket):
        offsets = {id(q): off for (_, q), off in zip(b.params, b.offsets)}

        def hook(p: Tensor) -> None:
            if b.grad is None:
                b.grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
            off = offsets[id(p)]
            b.grad[off:off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
            b.ready += 1
            if b.ready == len(b.params):
                b.ready = 0
                b.rounds += 1
                self._round_done(b)
        return hook

    def _round_done(self, b: Bucket) -> None:
        """All of a bucket's gradients of one microbatch are in: reduce now if this stage does."""
        if self.stage == 3 and b.unit is not None:
            b.in_backward = False
            if self.reshard_after_forward:
                self._free(b)
        if b.deferred:
            return
        last = b.rounds == self.microbatches
        if self.stage == 0 and last:
            b.pending.append((self.grid.dp_comm.all_reduce(b.grad, tag="grad", async_op=True), None))
        elif self.stage == 1 and last:
            out = torch.empty(b.shard, dtype=self.grad_dtype, device=self.device)
            b.pending.append((self.grid.dp_comm.reduce_scatter_into(out, b.grad, tag="grad", async_op=True), out))
        elif self.stage >= 2:
            out = torch.empty(b.shard, dtype=self.grad_dtype, device=self.device)
            b.pending.append((self.grid.dp_comm.reduce_scatter_into(out, b.grad, tag="grad", async_op=True), out))
            b.grad = None  # the full gradient of this microbatch is no longer needed once sent

    def _finish(self) -> None:
        """Wait for the reductions started in backward; reduce the deferred buckets now."""
        for b in self.buckets:
            if b.rounds != self.microbatches or b.ready:  # else the dp ranks would silently drift apart
                raise RuntimeError(
                    f"ZeRO: a gradient is missing for one of {', '.join(n for n, _ in b.params)} "
                    f"({b.rounds} of {self.microbatches} microbatches complete): every parameter given to the "
                    f"ZeroOptimizer must take part in every microbatch's loss")
            for work, out in b.pending:
                if work is not None:
                    work.wait()
                if out is not None:
                    b.shard_grad.add_(out)
            b.pending.clear()
            if b.deferred:
                if b.grad is None:
                    b.grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
                for (name, p), off in zip(b.params, b.offsets):
                    if name == "embed.tokens.weight" and self.tied_embedding:  # sum the tied copies
                        self.grid.embed_comm.all_reduce(b.grad[off:off + p.numel()], tag="grad")
                if self.stage == 0:
                    self.grid.dp_comm.all_reduce(b.grad, tag="grad")
                else:
                    out = torch.empty(b.shard, dtype=self.grad_dtype, device=self.device)
                    self.grid.dp_comm.reduce_scatter_into(out, b.grad, tag="grad")
                    b.shard_grad.add_(out)
                    if self.stage >= 2:
                        b.grad = None
            elif self.stage == 1:
                b.grad.zero_()

    def _range_grad(self, b: Bucket) -> Tensor:
        return b.grad if self.stage == 0 else b.shard_grad

    def _sequence_parallel_sum(self) -> None:
        """Sequence-parallel parameters saw 1/tp of the tokens on each tp rank: sum their gradients."""
        tp = self.grid.tp_comm
        if tp.size == 1:
            return
        parts = [(b, self._range_grad(b)) for b in self.buckets if b.sp_index is not None]
        if not parts:
            return
        flat = torch.cat([g.index_select(0, b.sp_index) for b, g in parts])
        tp.all_reduce(flat, tag="grad")
        start = 0
        for b, g in parts:
            n = b.sp_index.numel()
            g.index_copy_(0, b.sp_index, flat[start:start + n])
            start += n

    def reduce(self) -> None:
        """Complete this step's gradient reduction (waits for what backward started)."""
        self.settle_gathers()
        self._finish()
        self._sequence_parallel_sum()

    def full_gradients(self) -> dict[str, Tensor]:
        """Stage 0: every parameter's reduced gradient, by name (for inspection and tests)."""
        assert self.stage == 0, "only stage 0 keeps whole gradients"
        return {n: b.grad[off:off + p.numel()].view(p.shape)
                for b in self.buckets for (n, p), off in zip(b.params, b.offsets)}
