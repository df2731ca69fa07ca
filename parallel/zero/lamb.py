"""LAMB on this rank's share of the flat buffers: Adam's update scaled per layer by the trust ratio.

You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2: the Adam direction
``u = m_hat / (sqrt(v_hat) + eps) + wd * w`` (decoupled decay, on the matrices only, as AdamW here), then
``w -= lr * (||w|| / ||u||) * u`` per layer, with the ratio 1 where either norm is 0.

"Per layer" is per logical parameter, whatever the layout: one expert of a stacked expert tensor is a layer of
its own, so ep does not change what a norm covers. A rank holds pieces of parameters (its dp slice of a
bucket, its tp shard), so each norm is a sum of squares of pieces: every piece's sums go into one vector,
summed over the shard group (when the states are sharded) and over tp in one all-reduce each, for all
parameters at once. A tp-replicated piece counts on one tp rank (as for the gradient norm); a tied copy counts
where it is, since each stage's copy has its own (equal) norms. The sums are float64: an fp32 sum over 10^6
elements is off by ~1e-5 and would depend on how the buckets are cut.

The states are AdamW's (master, moments), so checkpoints, offload and the ZeRO formulas are unchanged. The
direction is computed twice (for the norms, then for the update) a bucket at a time, rather than kept for
every bucket until the norms are reduced: one bucket's range of fp32 in flight, not a third state.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from kernels.adam_cpu import Run
from parallel.comm import Comm
from parallel.zero.adamw import ShardedAdamW
from parallel.zero.layout import Bucket, BucketLayout, counted_on_tp_rank


class ShardedLamb(ShardedAdamW):
    def __init__(self, layout: BucketLayout, device: torch.device, state_device: torch.device, weight_decay: float,
                 betas: tuple[float, float], eps: float, grad_dtype: torch.dtype, shard: Optional[Comm], tp: Comm):
        """``shard``: the group the states are sharded over (None: every rank holds whole buckets); ``tp``: the
        tensor-parallel group the parameters' shards span."""
        super().__init__(layout, device, state_device, "torch", weight_decay, betas, eps, grad_dtype)
        self.shard, self.tp = shard, tp
        # per bucket: (start, end, layer id, decays) of each layer's piece in the bucket's range
        self.pieces: list[list[tuple[int, int, int, bool]]] = [[] for _ in layout.buckets]
        self.layers = 0
        self.counts: Optional[Tensor] = None  # 1 where this rank's piece of a layer counts, per layer
        self.trust: Optional[Tensor] = None  # the last step's ratios, per layer (metrics)

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        super().add_bucket(b, initial, decay, count)
        lo, hi = self.layout.range(b)
        counts = [] if self.counts is None else self.counts.tolist()
        for (name, p), off in zip(b.params, b.offsets):
            n = p.numel()
            experts = p.shape[0] if getattr(p, "ep_split_dim", None) == 0 else 1  # one layer per expert
            step = n // experts
            for e in range(experts):
                a, z = max(off + e * step, lo) - lo, min(off + (e + 1) * step, hi) - lo
                if a < z:
                    self.pieces[b.index].append((a, z, self.layers, p.dim() >= 2))
                self.layers += 1
                counts.append(float(counted_on_tp_rank(p, self.tp.rank)))
        self.counts = torch.tensor(counts, dtype=torch.float64, device=self.device)

    def _direction(self, i: int, bc1: float, bc2_sqrt: float) -> Tensor:
        """Adam's bias-corrected direction plus the decoupled decay, over bucket i's range (fp32, a new tensor)."""
        u = self.exp_avg[i] / bc1
        u.div_((self.exp_avg_sq[i].sqrt() / bc2_sqrt).add_(self.eps))
        if self.weight_decay:
            for a, z, _, decays in self.pieces[i]:
                if decays:
                    u[a:z].add_(self.master[i][a:z], alpha=self.weight_decay)
        return u

    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        """One LAMB step of every bucket's range; ``grad_scale`` folds loss-scale unscaling and clipping."""
        self.step_count += 1
        b1, b2 = self.betas
        bc1, bc2_sqrt = 1.0 - b1 ** self.step_count, math.sqrt(1.0 - b2 ** self.step_count)
        grads = self.state_grads(grads, resend)
        assert self.counts is not None, "a partition has parameters"
        sums = torch.zeros(2, max(self.layers, 1), dtype=torch.float64, device=self.state_device)
        for b, grad in zip(self.layout.buckets, grads):
            i = b.index
            g = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
            self.exp_avg[i].lerp_(g, 1.0 - b1)
            self.exp_avg_sq[i].mul_(b2).addcmul_(g, g, value=1.0 - b2)
            del g
            u = self._direction(i, bc1, bc2_sqrt)
            for a, z, layer, _ in self.pieces[i]:
                sums[0, layer] += torch.linalg.vector_norm(self.master[i][a:z], dtype=torch.float64).square()
                sums[1, layer] += torch.linalg.vector_norm(u[a:z], dtype=torch.float64).square()
        sums = sums.to(self.device) * self.counts
        if self.shard is not None:
            self.shard.all_reduce(sums, tag="lamb_norms")
        self.tp.all_reduce(sums, tag="lamb_norms")
        w_norm, u_norm = sums.sqrt()
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        self.trust = trust
        step = (-lr * trust).float().to(self.state_device)
        for b in self.layout.buckets:
            i = b.index
            u = self._direction(i, bc1, bc2_sqrt)
            for a, z, layer, _ in self.pieces[i]:
                self.master[i][a:z].add_(u[a:z] * step[layer])
            if not self.master_is_param[i]:
                target = self.target(b)
                target.copy_(self.master[i], non_blocking=target.device.type == "cuda")

    def trust_range(self) -> Optional[Tensor]:
        """(smallest, largest) trust ratio of the last step, on the device (None before the first)."""
        if self.trust is None or self.layers == 0:
            return None
        return torch.stack([self.trust.min(), self.trust.max()])
