"""0/1 Adam on this rank's share of the flat buffers (Lu et al. 2022, "Maximizing Communication Efficiency for
Large-scale Training via 0/1 Adam", Algorithm 1), on 1-bit Adam's compressed all-reduce (``parallel.onebit``).

Steps of T_v (``parallel.zero.zero_one_policy``) reduce the gradients in full precision into both moments, as
AdamW. Every other step folds the local gradient into the momentum (``n * g``, as 1-bit Adam); up to
``var_freeze_step`` the momentum is then averaged compressed. Past it each rank steps alone, sending nothing: its
weights are ``anchor * D - u / d`` (the anchor the fp32 master at the last synchronisation, ``u = sum r_k m_k``
with ``r_k = lr_k / (1 - beta1^k)``, ``D = prod(1 - lr_k wd)`` since then, ``d`` the frozen ``sqrt(v_hat) + eps``).
A synchronisation of T_u (by the step schedule or the learning rate; the run's last step one) averages ``u``
compressed and sets the momentum to ``u_bar / sum r_k``, the master to ``anchor * D - u_bar / d`` on every rank.
Three departures from DeepSpeed's, each measured (docs/optimizers.md): the errors scaled by ``r`` at the freeze
into u's units; Adam's bias correction (v's by its updates so far); a scale group per parameter.

Stages 0 and 1 (1-bit Adam's reasons). Stage 1 gathers the momentum slices after a T_v step and, past the freeze,
keeps the whole denominator, decay mask and an fp32 copy of the synchronised weights (the anchor; at stage 0 the
master). An fp32 master that was the parameter becomes a copy at the freeze. A checkpoint keeps per rank what
the local steps made its own (momentum, ``u``, sums, error buffers: ``rank_state``); a load rebuilds the weights.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

from megazero.parallel.comm import Comm
from megazero.parallel.onebit import compressed_allreduce, group_layout
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.onebit_adam import ShardedOnebitAdam
from megazero.parallel.zero.update import Record
from megazero.parallel.zero.zero_one_policy import (LocalSteps, silent_steps, updates_variance, variance_interval,
                                                   variance_updates)

if TYPE_CHECKING:
    from megazero.parallel.zero.registry import ZeroOneAdamSection
    from megazero.parallel.zero.update import UpdateContext


def make_zero_one_adam(section: "ZeroOneAdamSection", ctx: "UpdateContext") -> "ShardedZeroOneAdam":
    """The registry's factory: 0/1 Adam over one partition, synchronised over the partition's group."""
    assert ctx.state_device == ctx.device, "0/1 Adam's states stay on the device"
    tp = ctx.grid.tp_comm
    return ShardedZeroOneAdam(ctx.layout, ctx.device, ctx.weight_decay, section, ctx.grad_dtype, ctx.comm, tp.rank,
                              tp.size, ctx.last_step, ctx.run_step, ctx.peak_lr)


class ShardedZeroOneAdam(ShardedOnebitAdam):
    def __init__(self, layout: BucketLayout, device: torch.device, weight_decay: float,
                 section: "ZeroOneAdamSection", grad_dtype: torch.dtype, comm: Comm, tp_rank: int, tp_size: int,
                 last_step: int, run_step: Callable[[], int] = lambda: 0, peak_lr: float = 0.0):
        """``last_step``: train.steps, synchronised when the train step ``run_step()`` reaches it (0: never)."""
        s = section
        super().__init__(layout, device, weight_decay, (s.beta1, s.beta2), s.eps, grad_dtype, comm, tp_rank,
                         tp_size, s.var_freeze_step)
        self.kappa = s.var_update_scaler
        self.local_steps = LocalSteps(s.var_freeze_step, s.local_step_scaler, s.local_step_clipper,
                                      s.local_step_policy == "lr", peak_lr)
        self.last_step, self.run_step = last_step, run_step
        self.interval = 1  # T_u's interval at the last step
        self.silent = torch.zeros((), dtype=torch.float64)  # the local steps so far that sent nothing
        n = len(layout.buckets)
        self.accum: list[Optional[Tensor]] = [None] * n  # u: sum of r_k * m_k since the last sync (whole)
        self.denom: list[Optional[Tensor]] = [None] * n  # the frozen sqrt(v) + eps, whole (past the freeze)
        self.anchor: list[Optional[Tensor]] = [None] * n  # stage 1: the synchronised parameters, whole, fp32
        self.decay_whole: list[Optional[Tensor]] = [None] * n  # stage 1: the decay mask, whole
        self.sums = torch.tensor([0.0, 1.0], dtype=torch.float64)  # (sum of lr_k, prod of 1 - lr_k * wd)
        self.prepared_for = ""  # "sync" or "local": what _prepare last built
        self.momentum_stale = False  # stage 1: only this rank's slice of the momentum is current (a T_v step)
        self.anchor_stale = True  # stage 1: the anchor is refreshed from the gathered parameters when next read
        self.wrote_whole = False  # the last step wrote this rank's own whole parameters (no gather after it)
        self._loaded_momentum: dict[int, Tensor] = {}  # a load's per-rank momenta, taken by states_loaded

    # ----- the policies, derived state -----------------------------------------------------------------------------
    def exact(self, t: int) -> bool:
        return updates_variance(t, self.freeze_step, self.kappa)

    def compressing(self) -> bool:  # the next step reads local gradients (it is not one of T_v)
        return not self.exact(self.step_count + 1)

    def wrote_whole_params(self) -> bool:
        return self.wrote_whole

    def _whole(self, b: Bucket, mine: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """A bucket-long (padded) tensor from this rank's range: gathered over dp at stage 1."""
        out = torch.zeros(self.momentum[b.index].numel(), dtype=dtype, device=self.device)
        if self.layout.policy.shard_optimizer:
            self.comm.all_gather_into(out[:b.numel], mine.to(dtype), tag="zero_one_prepare")
        else:
            out[:b.numel] = mine
        return out

    def _prepare(self, local: bool) -> None:
        """From the current variance: the mask (sqrt(v_hat) <= eps left out), the groups, the whole momentum (stage
        1 after T_v), error buffers; past the freeze the whole denominator, decay mask, anchor and accumulator."""
        n, sharded = self.comm.size, self.layout.policy.shard_optimizer
        for b in self.layout.buckets:
            i = b.index
            root = self.exp_avg_sq[i].sqrt().div_(self._bc2(self.step_count + 1))  # sqrt(v_hat)
            live = self._whole(b, root > self.eps, torch.uint8)
            m = self.momentum[i]
            if self.momentum_stale and sharded:
                self.comm.all_gather_into(m[:b.numel], self.exp_avg[i].clone(), tag="zero_one_prepare")
            m.mul_(live)
            groups, self.group_counts[i] = self._param_groups(b)
            self.groups[i] = groups.mul_(live)
            self.group_layouts[i] = group_layout(self.groups[i], n, self.group_counts[i])
            if self.worker[i] is None:
                self.worker[i] = torch.zeros_like(m)
                self.server[i] = torch.zeros(m.numel() // n, dtype=torch.float32, device=self.device)
            if not local:
                continue
            self.denom[i] = self._whole(b, root.add_(self.eps))[:b.numel]
            if self.master_is_param[i]:  # the master is the anchor now: the local steps write the parameters
                self.master[i], self.master_is_param[i] = self.master[i].clone(), False
            if sharded:
                self.decay_whole[i] = torch.zeros(b.numel, dtype=torch.bool, device=self.device)
                for a, z, on in self.layout.mask_runs(b, self.tp_rank, whole=True)[0]:
                    self.decay_whole[i][a:z] = on
                self.anchor[i] = b.full.to(torch.float32, copy=True)
            if self.accum[i] is None:
                self.accum[i] = torch.zeros_like(m)
        self.anchor_stale = False
        self.momentum_stale = False
        self.prepared_for = "local" if local else "sync"

    def states_loaded(self) -> None:
        """The checkpoint wrote the masters (and the parameters from them: the last synchronisation's) and the
        moments; past the freeze this rank's momentum and accumulator came from its own state, and its
        parameters are rebuilt from them."""
        self.prepared_for, self.momentum_stale, self.anchor_stale = "", True, True
        local = self.step_count > self.freeze_step
        if not local:  # a rollback in the same process keeps nothing of the later steps' own state
            self._loaded_momentum.clear()
            self.accum = [None] * len(self.accum)
            self.sums.copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
            self.silent.zero_()
            if not self._compressed_by(self.step_count):  # the checkpoint holds no error feedback yet
                self.worker = [None] * len(self.worker)
                self.server = [None] * len(self.server)
            return
        for i, m in self._loaded_momentum.items():
            self.momentum[i].copy_(m)
        self.momentum_stale = not self._loaded_momentum
        self._loaded_momentum.clear()
        self._prepare(local=True)
        if self.sums[0] > 0:  # within an interval: the local parameters
            for b in self.layout.buckets:
                self._write_local(b)

    def _compressed_by(self, step: int) -> bool:
        """A compressed step has run by optimizer step ``step`` (the first is at most kappa + 2)."""
        return any(not self.exact(t) for t in range(1, min(step, self.kappa + 2, self.freeze_step + 1) + 1))

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """This rank's own state as of optimizer step ``step``: none before the first compressed step (the states
        are then AdamW's, layout-free); the error buffers after it; past the freeze also the momentum (a copy:
        a load's is taken by ``states_loaded``), the accumulator and the sums."""
        if not self._compressed_by(step):
            return {}
        out = super().rank_state(max(step, self.freeze_step + 1))  # the error buffers, allocated where absent
        if step <= self.freeze_step:
            return out
        out["sums"], out["silent"] = self.sums, self.silent
        for b in self.layout.buckets:
            i = b.index
            if self.accum[i] is None:
                self.accum[i] = torch.zeros_like(self.momentum[i])
            self._loaded_momentum[i] = self.momentum[i].clone()
            out[f"{i}/momentum"], out[f"{i}/accum"] = self._loaded_momentum[i], self.accum[i]
        return out

    def rebuild_rank_state(self, key: str, step: int) -> bool:
        """``silent`` (a metric's count, saved since the learning-rate rule came) under the step rule: its closed
        form. A checkpoint older than it never held the learning-rate rule."""
        if key != "silent" or self.local_steps.by_lr:
            return False
        self.silent.fill_(float(silent_steps(step, self.local_steps)))
        return True

    # ----- the step -------------------------------------------------------------------------------------------------
    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        t = self.step_count + 1
        self._loaded_momentum.clear()  # a save's copies
        self.wrote_whole = False
        before = self._sent_so_far()
        if self.exact(t):
            self._exact_step(grads, lr, grad_scale, t)
        else:
            local = t > self.freeze_step
            if self.prepared_for != ("local" if local else "sync"):
                self._prepare(local)
            if t == self.freeze_step + 1:  # the errors measured the momentum; from here u, r_t times it
                for e in self.worker + self.server:
                    e.mul_(lr / (1.0 - self.betas[0] ** t))
            self._compressed_step(grads, lr, grad_scale, t, local)
        self.step_count = t
        self.sent = self._sent_so_far() - before

    def _decay(self, master: Tensor, mask: Tensor, factor: float) -> None:
        if self.weight_decay:
            master.mul_(torch.where(mask, factor, 1.0))  # the factor a kernel argument: no host copy

    def _bc2(self, t: int) -> float:
        """sqrt(1 - beta2^k), k the variance's updates by step t: its bias correction."""
        return math.sqrt(1.0 - self.betas[1] ** max(variance_updates(t, self.freeze_step, self.kappa), 1))

    def _exact_step(self, grads: list[Tensor], lr: float, grad_scale: float, t: int) -> None:
        """T_v: both moments from the reduced gradient, Adam's bias-corrected step."""
        b1, b2 = self.betas
        for b, g in zip(self.layout.buckets, grads):
            i = b.index
            g = g.float() * grad_scale
            self.exp_avg[i].mul_(b1).add_(g, alpha=1.0 - b1)
            self.exp_avg_sq[i].mul_(b2).addcmul_(g, g, value=1.0 - b2)
            self._decay(self.master[i], self.decay_mask[i], 1.0 - lr * self.weight_decay)
            denom = self.exp_avg_sq[i].sqrt().div_(self._bc2(t)).add_(self.eps)
            self.master[i].addcdiv_(self.exp_avg[i], denom, value=-lr / (1.0 - b1 ** t))
            self._copy_out(b)
        self.momentum_stale = self.layout.policy.shard_optimizer
        self.prepared_for = ""  # the variance moved: the mask is rebuilt at the next compressed step

    def _copy_out(self, b: Bucket) -> None:
        if not self.master_is_param[b.index]:
            self.target(b).copy_(self.master[b.index])

    def _compressed_step(self, grads: list[Tensor], lr: float, grad_scale: float, t: int, local: bool) -> None:
        b1, n = self.betas[0], self.comm.size
        self.interval = self.local_steps.interval(t, lr)
        sync = not local or self.run_step() == self.last_step or t % self.interval == 0
        self.silent += not sync
        rate = lr / (1.0 - b1 ** t)  # the momentum's bias correction folded into the rate
        if local:
            self.sums[0] += rate
            self.sums[1] *= 1.0 - lr * self.weight_decay
        for b, g in zip(self.layout.buckets, grads):
            i = b.index
            m = self.momentum[i]
            m[:b.numel].mul_(b1).add_(g, alpha=(1.0 - b1) * n * grad_scale)
            m.masked_fill_(self.groups[i] == 0, 0.0)
            if not local:  # up to the freeze: the momentum averaged, Adam's step with the current variance
                m.copy_(self._average(m, i))
                self._decay(self.master[i], self.decay_mask[i], 1.0 - lr * self.weight_decay)
                lo, hi = self.layout.range(b)
                denom = self.exp_avg_sq[i].sqrt().div_(self._bc2(t)).add_(self.eps)
                self.master[i].addcdiv_(m[lo:hi], denom, value=-rate)
                self._copy_out(b)
                continue
            u = self.accum[i]
            u.add_(m, alpha=rate)
            if not sync:
                self._write_local(b)
                continue
            u.copy_(self._average(u, i))
            m.copy_(u).div_(float(self.sums[0]))
            lo, hi = self.layout.range(b)
            self._decay(self.master[i], self.decay_mask[i], float(self.sums[1]))
            self.master[i].sub_(u[lo:hi] / self.denom[i][lo:hi])
            self._copy_out(b)
            u.zero_()
        if local and sync:
            self.sums.copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
            self.anchor_stale = True
        self.wrote_whole = local and not sync

    def _average(self, x: Tensor, i: int) -> Tensor:
        if self.comm.size == 1:  # the experts' group at ep = dp: nothing to exchange, nothing to compress
            return x
        return compressed_allreduce(x, self.worker[i], self.server[i], self.comm, tag="zero_one", groups=self.groups[i],
                                    group_count=self.group_counts[i], layout=self.group_layouts[i])

    def _write_local(self, b: Bucket) -> None:
        """This rank's parameters within an interval: the anchor decayed, less its own u / (sqrt(v) + eps)."""
        i = b.index
        if not self.layout.policy.shard_optimizer:
            anchor, mask = self.master[i], self.decay_mask[i]
        else:
            if self.anchor_stale:  # the parameters gathered after the last synchronisation
                self.anchor[i].copy_(b.full)
            anchor, mask = self.anchor[i], self.decay_whole[i]
        x = anchor.clone()
        self._decay(x, mask, float(self.sums[1]))
        b.full.copy_(x.sub_(self.accum[i][:b.numel] / self.denom[i]))
        if b.index == len(self.layout.buckets) - 1:
            self.anchor_stale = False

    # ----- accounting -----------------------------------------------------------------------------------------------
    def extra_kinds(self) -> list[list[Optional[Tensor]]]:
        return super().extra_kinds() + [self.accum, self.denom, self.anchor, self.decay_whole]

    def record(self) -> Record:
        """The update's bytes last step (summed over the partitions); the share of silent steps, T_u's interval at
        the last step and T_v's at the next (every partition's the same)."""
        t = self.step_count
        values = [self.sent, float(self.silent) / max(t, 1), float(self.interval),
                  float(variance_interval(t + 1, self.freeze_step, self.kappa))]
        return Record(torch.tensor(values, dtype=torch.float64), "local",
                      lambda v: {"optim/compressed_bytes": v[0], "optim/silent_share": v[1],
                                 "optim/sync_interval": v[2], "optim/var_interval": v[3]},
                      per_value=("sum", "max", "max", "max"))
