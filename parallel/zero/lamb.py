"""LAMB on this rank's share of the flat buffers: Adam's update scaled per layer by the trust ratio.

You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2: the Adam direction
``u = m_hat / (sqrt(v_hat) + eps) + wd * w`` (decoupled decay, on the matrices only, as AdamW here), then
``w -= lr * (||w|| / ||u||) * u`` per layer, with the ratio 1 where either norm is 0.

"Per layer" is per logical parameter, whatever the layout: one expert of a stacked expert tensor is a layer of
its own, so ep does not change what a norm covers. A rank holds pieces of parameters (its dp slice of a
bucket, its tp shard), so each norm is a sum of squares of pieces: every piece's sums go into one vector,
summed over the shard group (when the states are sharded) and over tp in one all-reduce each, for all
parameters at once. A tp-replicated piece counts on one tp rank (as for the gradient norm); a tied copy counts
where it is, since each stage's copy has its own (equal) norms. Norms are taken in fp32 over runs of at most
NORM_PIECE elements and added in float64: an fp32 sum over 10^6 elements is off by ~1e-5 and would depend on
how the buckets are cut, a short run's by ~2e-7.

The states are AdamW's (master, moments), so checkpoints, offload and the ZeRO formulas are unchanged. The
direction is written over the reduced fp32 gradient, which the step consumes (as apex's and DeepSpeed's fused
LAMB reuse it), so it is computed once and no third state is held; bf16 or fp16 gradients
(``zero.grad_dtype: model``) get an fp32 buffer per bucket for the step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from megazero.kernels.adam_cpu import Run
from megazero.parallel.comm import Comm
from megazero.parallel.zero.adamw import NORM_PIECE, ShardedAdamW
from megazero.parallel.zero.layout import Bucket, BucketLayout, counted_on_tp_rank
from megazero.parallel.zero.update import Record

if TYPE_CHECKING:
    from megazero.parallel.zero.registry import LambSection
    from megazero.parallel.zero.update import UpdateContext


def make_lamb(section: "LambSection", ctx: "UpdateContext") -> "ShardedLamb":
    """The registry's factory: LAMB over one partition, its norms summed over the shard group when sharded."""
    shard = ctx.comm if ctx.layout.policy.shard_optimizer else None
    return ShardedLamb(ctx.layout, ctx.device, ctx.state_device, ctx.weight_decay, (section.beta1, section.beta2),
                       section.eps, ctx.grad_dtype, shard, ctx.grid.tp_comm)


class ShardedLamb(ShardedAdamW):
    def __init__(self, layout: BucketLayout, device: torch.device, state_device: torch.device, weight_decay: float,
                 betas: tuple[float, float], eps: float, grad_dtype: torch.dtype, shard: Optional[Comm], tp: Comm):
        """``shard``: the group the states are sharded over (None: every rank holds whole buckets); ``tp``: the
        tensor-parallel group the parameters' shards span."""
        # "fused": the parent builds no per-element decay mask, which LAMB does not read (its pieces say it)
        super().__init__(layout, device, state_device, "fused", weight_decay, betas, eps, grad_dtype)
        self.init_layers(shard, tp)

    def init_layers(self, shard: Optional[Comm], tp: Comm) -> None:
        """The per-layer bookkeeping, before the buckets are added (1-bit LAMB calls it from its own init)."""
        layout = self.layout
        self.shard, self.tp = shard, tp
        # per bucket: (start, end, layer id, decays) of each layer's piece in the bucket's range
        self.pieces: list[list[tuple[int, int, int, bool]]] = [[] for _ in layout.buckets]
        self.n_groups = 0
        self.layer_counts: list[float] = []  # 1 where this rank's piece of a layer counts, per layer
        self.count_weights: Optional[Tensor] = None  # the same on the device, built on the first step
        self.trust: Optional[Tensor] = None  # the last step's ratios, per layer (metrics)
        self.piece_layers: Optional[Tensor] = None  # the layer of each norm piece (built on the first step)

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        super().add_bucket(b, initial, decay, count)
        lo, hi = self.layout.range(b)
        counts = self.layer_counts
        for (name, p), off in zip(b.params, b.offsets):
            n = p.numel()
            experts = p.shape[0] if getattr(p, "ep_split_dim", None) == 0 else 1  # one layer per expert
            step = n // experts
            for e in range(experts):
                a, z = max(off + e * step, lo) - lo, min(off + (e + 1) * step, hi) - lo
                if a < z:
                    self.pieces[b.index].append((a, z, self.n_groups, p.dim() >= 2))
                self.n_groups += 1
                counts.append(float(counted_on_tp_rank(p, self.tp.rank)))

    def _direction(self, i: int, grad: Tensor, grad_scale: float, bc1: float, bc2_sqrt: float) -> Tensor:
        """Update bucket i's moments from its reduced gradient and return Adam's bias-corrected direction plus the
        decoupled decay over its range, in fp32: written over the gradient where it is fp32 (the step consumes
        it, as apex's LAMB does), else in a new tensor."""
        b1, b2 = self.betas
        g = grad if grad.dtype == torch.float32 else grad.float()
        if grad_scale != 1.0:
            g.mul_(grad_scale)
        self.exp_avg[i].lerp_(g, 1.0 - b1)
        self.exp_avg_sq[i].mul_(b2).addcmul_(g, g, value=1.0 - b2)
        u = torch.sqrt(self.exp_avg_sq[i], out=g).div_(bc2_sqrt).add_(self.eps)
        torch.div(self.exp_avg[i], u, out=u).div_(bc1)
        if self.weight_decay:
            for a, z, _, decays in self.pieces[i]:
                if decays:
                    u[a:z].add_(self.master[i][a:z], alpha=self.weight_decay)
        return u

    def _norm_pieces(self, directions: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Every layer piece of the weights and of the directions cut to at most NORM_PIECE elements, and each
        cut's layer: fp32 norms of short runs add in float64 to ~2e-7 relative, however the layout cuts them."""
        views, group_ids = [], []
        for source in ([self.master[b.index] for b in self.layout.buckets], directions):
            for b, t in zip(self.layout.buckets, source):
                for a, z, layer, _ in self.pieces[b.index]:
                    for lo in range(a, z, NORM_PIECE):
                        views.append(t[lo:min(lo + NORM_PIECE, z)])
                        group_ids.append(layer + (self.n_groups if source is directions else 0))
        if self.piece_layers is None or self.piece_layers.numel() != len(group_ids):
            self.piece_layers = torch.tensor(group_ids, dtype=torch.long, device=self.state_device)
        return views, self.piece_layers

    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """One LAMB step of every bucket's range; ``grad_scale`` folds loss-scale unscaling and clipping."""
        self.step_count += 1
        b1, b2 = self.betas
        bc1, bc2_sqrt = 1.0 - b1 ** self.step_count, math.sqrt(1.0 - b2 ** self.step_count)
        grads = self.state_grads(grads, resend)
        assert self.n_groups, "a partition has parameters"
        if self.count_weights is None:
            self.count_weights = torch.tensor(self.layer_counts, dtype=torch.float64, device=self.device)
        directions = [self._direction(b.index, g, grad_scale, bc1, bc2_sqrt) for b, g in zip(self.layout.buckets, grads)]
        views, ids = self._norm_pieces(directions)
        sums = torch.zeros(2 * self.n_groups, dtype=torch.float64, device=self.state_device)
        if views:
            norms = torch.stack(torch._foreach_norm(views, 2)).double().square()
            sums.index_add_(0, ids, norms)
        sums = sums.view(2, self.n_groups).to(self.device) * self.count_weights
        if self.shard is not None:
            self.shard.all_reduce(sums, tag="lamb_norms")
        self.tp.all_reduce(sums, tag="lamb_norms")
        w_norm, u_norm = sums.sqrt()
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        self.trust = trust
        step = (-lr * trust).float().to(self.state_device)
        for b, u in zip(self.layout.buckets, directions):
            i = b.index
            for a, z, layer, _ in self.pieces[i]:
                u[a:z].mul_(step[layer])
            self.master[i].add_(u)  # the padding's direction is 0 (zero moments)
            if not self.master_is_param[i]:
                target = self.target(b)
                target.copy_(self.master[i], non_blocking=target.device.type == "cuda")

    def record(self) -> Record:
        """(-smallest, largest) trust ratio of the last step, on the device, for a MAX over every layer of the
        model (-inf before the first step, or where this partition has no layer)."""
        if self.trust is None or self.n_groups == 0:
            both = torch.full((2,), -float("inf"), dtype=torch.float64, device=self.device)
        else:
            both = torch.stack([-self.trust.min(), self.trust.max()]).to(device=self.device, dtype=torch.float64)
        return Record(both, "max", lambda v: {"optim/trust_min": -v[0], "optim/trust_max": v[1]})
