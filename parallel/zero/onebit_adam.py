"""1-bit Adam on this rank's share of the flat buffers (Tang et al. 2021, "1-bit Adam", Algorithm 1).

Steps 1..``freeze_step`` are AdamW's, over gradients reduced in full precision (the warm-up): the variance
settles. From then on the variance is frozen and the gradients are not reduced at all: each rank folds its local
gradient into its momentum and the momenta are averaged by the compressed all-reduce (``parallel.onebit``:
signs 8 per byte, a scale per chunk, error feedback on the worker and the server side), which leaves the same
momentum on every rank; the update is Adam's with that momentum and the frozen variance. The reducer is told
per step (``reads_reduced_gradients``); nothing in it knows which optimizer runs.

Scaling: the loss is normalised by the global batch, so the dp reduction is a sum and a rank's local gradient
is 1/n of its share; the momentum takes ``n * g``, whose mean over ranks is the reduced gradient. Bias
correction is Adam's: 1 - beta1^t for the momentum, 1 - beta2^freeze_step for the frozen variance.

Left out of the compression (``live`` = 0, as if absent): the padding, and every element whose frozen
``sqrt(v_hat)`` is at most eps (a vocabulary row no token reached): its exact momentum is ~0, but a sign would
move it by a whole scale, divided by eps. Its momentum is zeroed, so it moves by weight decay only.

Stages 0 and 1 only. Stage 1 shards the masters and the variance, but the momentum is whole on every rank (each
folds in its whole local gradient); ``exp_avg`` is its own slice, so checkpoints stay AdamW's. Stages 2-3 are
refused: the gradient is never reduced past the warm-up, so there is nothing to shard it into, and every rank
needs the whole local gradient of every bucket. The error buffers belong to the rank and its place in the
layout: a checkpoint keeps them per rank (``rank_state``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from kernels.adam_cpu import Run
from parallel.comm import Comm
from parallel.onebit import compressed_allreduce, padded_length
from parallel.zero.adamw import ShardedAdamW
from parallel.zero.layout import Bucket, BucketLayout


class ShardedOnebitAdam(ShardedAdamW):
    def __init__(self, layout: BucketLayout, device: torch.device, weight_decay: float,
                 betas: tuple[float, float], eps: float, grad_dtype: torch.dtype, comm: Comm, tp_rank: int,
                 freeze_step: int):
        """``comm``: the partition's data-parallel group (the momenta are averaged over it); ``tp_rank``: this
        rank's (the norm's runs over whole buckets count a tp-replicated parameter once); ``freeze_step``: the
        last step of the full-precision warm-up."""
        super().__init__(layout, device, device, "torch", weight_decay, betas, eps, grad_dtype)
        assert freeze_step >= 1, freeze_step
        assert not layout.policy.shard_grads, "1-bit Adam runs at ZeRO stages 0-1"
        self.comm, self.tp_rank, self.freeze_step = comm, tp_rank, freeze_step
        n = len(layout.buckets)
        self.momentum: list[Optional[Tensor]] = [None] * n  # whole bucket, padded to 8 * dp
        self.whole_counted: list[list[Run]] = [[] for _ in range(n)]  # norm runs over the whole bucket
        self.live: list[Optional[Tensor]] = [None] * n
        self.worker: list[Optional[Tensor]] = [None] * n
        self.server: list[Optional[Tensor]] = [None] * n
        self.prepared = False
        self.sent = 0.0  # bytes the last compressed step put on the wire (metrics)

    def compressing(self) -> bool:
        """The next step is past the warm-up."""
        return self.step_count >= self.freeze_step

    def reads_reduced_gradients(self) -> bool:
        return not self.compressing()

    def may_read_local_gradients(self) -> bool:
        return True

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        super().add_bucket(b, initial, decay, count)
        i = b.index
        lo, hi = self.layout.range(b)
        self.momentum[i] = torch.zeros(padded_length(b.numel, self.comm.size), dtype=torch.float32,
                                       device=self.device)
        self.exp_avg[i] = self.momentum[i][lo:hi]  # AdamW's view of it: the warm-up and checkpoints read this
        self.whole_counted[i] = self.layout.mask_runs(b, self.tp_rank, whole=True)[1]

    # ----- the compressed phase -----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Before the first compressed step (and after a resume into one): the live mask from the frozen variance,
        the whole momentum on every rank (stage 1: its slices gathered), zero where not live; error buffers."""
        bc2 = math.sqrt(1.0 - self.betas[1] ** self.freeze_step)
        n = self.comm.size
        for b in self.layout.buckets:
            i = b.index
            mine = (self.exp_avg_sq[i].sqrt() / bc2 > self.eps).float()
            live = torch.zeros_like(self.momentum[i])
            m = self.momentum[i]
            if self.layout.policy.shard_optimizer:
                self.comm.all_gather_into(live[:b.numel], mine, tag="onebit_prepare")
                self.comm.all_gather_into(m[:b.numel], self.exp_avg[i].clone(), tag="onebit_prepare")
            else:
                live[:b.numel] = mine
            m.mul_(live)
            self.live[i] = live
            if self.worker[i] is None:
                self.worker[i] = torch.zeros_like(m)
                self.server[i] = torch.zeros(m.numel() // n, dtype=torch.float32, device=self.device)
        self.prepared = True

    def states_loaded(self) -> None:
        self.prepared = False  # the mask and the whole momentum are rebuilt from what was loaded

    def rank_state(self, saving: bool) -> dict[str, Tensor]:
        """This rank's error buffers by bucket ("<bucket>/worker", "<bucket>/server"), which a checkpoint keeps
        per rank: none while in the warm-up when ``saving``; when loading, allocated to be filled (the loader
        asks for them only for a checkpoint past the warm-up)."""
        if saving and not self.compressing():
            return {}
        n = self.comm.size
        out = {}
        for b in self.layout.buckets:
            i = b.index
            if self.worker[i] is None:
                self.worker[i] = torch.zeros_like(self.momentum[i])
                self.server[i] = torch.zeros(self.momentum[i].numel() // n, dtype=torch.float32, device=self.device)
            out[f"{i}/worker"], out[f"{i}/server"] = self.worker[i], self.server[i]
        return out

    def sq_norm(self, grads: list[Tensor]) -> Tensor:
        """Past the warm-up the gradients are local and whole: their own squares over the whole buckets' runs."""
        if self.compressing() and self.layout.policy.shard_optimizer:
            return self.counted_sq_norm(grads, [self.whole_counted[b.index] for b in self.layout.buckets], "whole")
        return super().sq_norm(grads)

    def first_nonfinite(self, grads: list[Tensor]) -> Optional[str]:
        if not (self.compressing() and self.layout.policy.shard_optimizer):
            return super().first_nonfinite(grads)
        for b, g in zip(self.layout.buckets, grads):
            bad = torch.isfinite(g).logical_not().nonzero()
            if bad.numel():
                return self.layout.name_at(b, int(bad[0, 0]))
        return None

    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """AdamW in the warm-up; then the local momentum, its compressed average, and Adam's step with the frozen
        variance (``grad_scale`` folds unscaling and clipping into the local gradient)."""
        if not self.compressing():
            super().update(grads, lr, grad_scale, resend)
            return
        if not self.prepared:
            self._prepare()
        self.step_count += 1
        b1, b2 = self.betas
        n = self.comm.size
        bc1, bc2 = 1.0 - b1 ** self.step_count, math.sqrt(1.0 - b2 ** self.freeze_step)
        counter = self.comm.counter
        before = counter.sent_bytes().get(self.comm.name, 0.0) if counter is not None else 0.0
        for b, g in zip(self.layout.buckets, grads):
            i = b.index
            m = self.momentum[i]
            m[:b.numel].mul_(b1).add_(g, alpha=(1.0 - b1) * n * grad_scale)
            if n > 1:
                m.copy_(compressed_allreduce(m, self.worker[i], self.server[i], self.comm, tag="onebit",
                                             live=self.live[i]))
            master = self.master[i]
            if self.weight_decay:
                factor = torch.tensor(1.0 - lr * self.weight_decay, dtype=master.dtype, device=master.device)
                master.mul_(torch.where(self.decay_mask[i], factor, torch.ones_like(factor)))
            denom = (self.exp_avg_sq[i].sqrt() / bc2).add_(self.eps)
            master.addcdiv_(self.exp_avg[i], denom, value=-lr / bc1)
            if not self.master_is_param[i]:
                target = self.target(b)
                target.copy_(master, non_blocking=target.device.type == "cuda")
        if counter is not None:
            self.sent = counter.sent_bytes().get(self.comm.name, 0.0) - before

    # ----- accounting -----------------------------------------------------------------------------------------------
    def own_tensors(self) -> list[Tensor]:
        """What this optimizer keeps beyond AdamW's states: the momentum outside the range, the mask, the errors."""
        extra = [m for m in self.momentum if m is not None]
        return extra + [t for kind in (self.live, self.worker, self.server) for t in kind if t is not None]

    def state_bytes(self) -> int:
        """AdamW's states, the momentum beyond its range (the padding, and at stage 1 the other slices), and
        past the warm-up the mask and the error buffers."""
        total = super().state_bytes()
        for b in self.layout.buckets:
            i = b.index
            total += (self.momentum[i].numel() - self.exp_avg[i].numel()) * 4
            total += sum(t[i].numel() * 4 for t in (self.live, self.worker, self.server) if t[i] is not None)
        return total
