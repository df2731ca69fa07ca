"""1-bit LAMB on this rank's share of the flat buffers (Li et al. 2021, "1-bit LAMB: Communication Efficient
Large-Scale Large-Batch Training with LAMB's Convergence Speed", Algorithm 1).

Steps 1..``freeze_step`` are megazero's LAMB (``parallel.zero.lamb``) over gradients reduced in full precision;
they also keep each layer's trust ratio as an exponential average (``coeff_beta``; a ratio of exactly 1, a layer
with a zero norm, is left out), the frozen trust ratio, and at the last of them a copy of the variance, the
"fresh" variance. From then on, as 1-bit Adam (``parallel.zero.onebit_adam``, whose compression, scale groups and
error feedback this reuses): the variance is frozen, each rank folds its local gradient into the whole momentum
and the momenta are averaged compressed. Before the compression each layer's momentum is scaled by 1 / its RMS at
the end of the warm-up (and back after), so that the layers sharing a chunk's one scale are of one magnitude
(the paper's united scale over this RMS: the common factor cancels in a compression, which is linear in its
input, and dropping it keeps a copy of a tied layer on two stages bit-identical).

The trust ratio past the warm-up is the frozen one times a factor from the reconstructed state: the gradient is
rebuilt from the averaged momentum, ``g = (m_t - beta1 m_{t-1}) / (1 - beta1)``, and folded into the fresh
variance; the factor is the largest ``(sqrt(v_hat) + eps) / (sqrt(v_fresh_hat) + eps)`` over the layer, blended
towards 1 by the share of the update the decay makes (``min(1, ||m/d|| / ||m/d + wd w||)``), clipped to
[``factor_min``, ``factor_max``] and to within ``factor_threshold`` of the last step's. The update is LAMB's
direction with the frozen variance, ``w -= lr * coeff * (m_hat / (sqrt(v_hat) + eps) + wd w)``.

Stages 0 and 1 (1-bit Adam's reasons). The per-layer figures (the frozen ratios, the last factors, the momentum
scales) and the fresh variance belong to the layout: a checkpoint keeps them per rank (``rank_state``), from the
first step, and a resume keeps the layout.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from megazero.kernels.adam_cpu import Run
from megazero.parallel.comm import Comm
from megazero.parallel.onebit import compressed_allreduce
from megazero.parallel.zero.lamb import ShardedLamb
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.onebit_adam import ShardedOnebitAdam
from megazero.parallel.zero.update import Record

if TYPE_CHECKING:
    from megazero.parallel.zero.registry import OnebitLambSection
    from megazero.parallel.zero.update import UpdateContext


def make_onebit_lamb(section: "OnebitLambSection", ctx: "UpdateContext") -> "ShardedOnebitLamb":
    """The registry's factory: 1-bit LAMB over one partition, its momenta averaged over the partition's group."""
    assert ctx.state_device == ctx.device, "1-bit LAMB's states stay on the device"
    return ShardedOnebitLamb(ctx.layout, ctx.device, ctx.weight_decay, section, ctx.grad_dtype, ctx.comm,
                             ctx.grid.tp_comm)


class ShardedOnebitLamb(ShardedOnebitAdam, ShardedLamb):
    """1-bit Adam's compressed phase and states, LAMB's warm-up and per-layer norms (the method order puts
    ShardedLamb's update behind 1-bit Adam's: the warm-up)."""

    def __init__(self, layout: BucketLayout, device: torch.device, weight_decay: float,
                 section: "OnebitLambSection", grad_dtype: torch.dtype, comm: Comm, tp: Comm):
        s = section
        ShardedOnebitAdam.__init__(self, layout, device, weight_decay, (s.beta1, s.beta2), s.eps, grad_dtype, comm,
                                   tp.rank, tp.size, s.freeze_step)
        self.init_layers(comm if layout.policy.shard_optimizer else None, tp)
        self.coeff_beta, self.factor_min, self.factor_max = s.coeff_beta, s.factor_min, s.factor_max
        self.factor_threshold = s.factor_threshold
        self.whole_pieces: list[list[tuple[int, int, int]]] = [[] for _ in layout.buckets]  # over whole buckets
        self.layer_numel: list[int] = []  # elements per layer on this rank (its tp shard of it)
        self.per_layer: Optional[Tensor] = None  # (frozen ratio, last factor, momentum scale) per layer, float64
        self.fresh: list[Optional[Tensor]] = [None] * len(layout.buckets)  # the fresh variance, this rank's range
        self.coeff: Optional[Tensor] = None  # the last step's ratios (metrics)

    def add_bucket(self, b: Bucket, initial: Tensor, decay: list[Run], count: list[Run]) -> None:
        first = self.n_groups
        super().add_bucket(b, initial, decay, count)  # 1-bit Adam's, then LAMB's range pieces
        layer = first
        for (_, p), off in zip(b.params, b.offsets):
            experts = p.shape[0] if getattr(p, "ep_split_dim", None) == 0 else 1
            step = p.numel() // experts
            for e in range(experts):
                self.whole_pieces[b.index].append((off + e * step, off + (e + 1) * step, layer))
                self.layer_numel.append(step)
                layer += 1

    def _scale_groups(self, b: Bucket, renumber: dict[int, int]) -> tuple[Tensor, int]:
        """One scale per chunk and way of holding (``_held``), as the paper's one flat buffer: the per-layer
        momentum scaling puts the layers sharing it at one magnitude."""
        return self._held_groups(b, renumber), len(renumber)

    def _layer_state(self) -> Tensor:
        if self.per_layer is None:
            self.per_layer = torch.zeros(3, self.n_groups, dtype=torch.float64, device=self.device)
            self.per_layer[1:] = 1.0
        return self.per_layer

    # ----- the warm-up ------------------------------------------------------------------------------------------------
    def update(self, grads: list[Tensor], lr: float, grad_scale: float, resend: set[int]) -> None:
        if self.compressing():
            self._compressed_step(grads, lr, grad_scale)
            return
        super().update(grads, lr, grad_scale, resend)  # LAMB's step (1-bit Adam's warm-up branch)
        frozen = self._layer_state()[0]
        moved = self.trust != 1.0
        frozen.copy_(torch.where(moved, frozen * self.coeff_beta + (1.0 - self.coeff_beta) * self.trust, frozen))
        self.coeff = self.trust
        if self.step_count == self.freeze_step:
            self.fresh = [v.clone() for v in self.exp_avg_sq]

    # ----- past it ----------------------------------------------------------------------------------------------------
    def _layer_sums(self, source: list[Tensor], pieces: list[list[tuple]], counted: bool) -> Tensor:
        """Per layer, the sum over ``pieces`` (per bucket) of squares of ``source``, counting a tp-replicated
        layer once where ``counted``, summed over tp (and over the shard group for range pieces)."""
        out = torch.zeros(self.n_groups, dtype=torch.float64, device=self.device)
        for b, t in zip(self.layout.buckets, source):
            for a, z, layer, *_ in pieces[b.index]:
                out[layer] += t[a:z].double().square().sum()
        if counted:
            if self.count_weights is None:
                self.count_weights = torch.tensor(self.layer_counts, dtype=torch.float64, device=self.device)
            out.mul_(self.count_weights)
        return out

    def _momentum_scales(self) -> None:
        """Each layer's 1 / RMS of the momentum at the end of the warm-up (whole on every rank: summed over tp)."""
        sums = self._layer_sums(self.momentum, self.whole_pieces, counted=True)
        self.tp.all_reduce(sums, tag="onebit_lamb")
        numel = torch.tensor(self.layer_numel, dtype=torch.float64, device=self.device) * self.count_weights
        self.tp.all_reduce(numel, tag="onebit_lamb")
        rms = (sums / numel.clamp(min=1.0)).sqrt()
        self._layer_state()[2].copy_(torch.where(rms > 0, 1.0 / rms, torch.ones_like(rms)))

    def _scale(self, m: Tensor, b: Bucket, inverse: bool) -> None:
        scales = self.per_layer[2].tolist()
        for a, z, layer in self.whole_pieces[b.index]:
            m[a:z].mul_(1.0 / scales[layer] if inverse else scales[layer])

    def _compressed_step(self, grads: list[Tensor], lr: float, grad_scale: float) -> None:
        """The momenta averaged compressed (each layer at one magnitude), the fresh variance from the rebuilt
        gradient, and LAMB's step with the frozen variance and the adapted trust ratios."""
        if not self.prepared:
            self._prepare()
            if self.step_count == self.freeze_step:  # the first compressed step: the scales, once
                self._momentum_scales()
        self.step_count += 1
        t, n = self.step_count, self.comm.size
        b1, b2 = self.betas
        bc1 = 1.0 - b1 ** t
        bc2, bc2_fresh = math.sqrt(1.0 - b2 ** self.freeze_step), math.sqrt(1.0 - b2 ** t)
        before = self._sent_so_far()
        directions, plain, ratio = [], [], []
        for b, g in zip(self.layout.buckets, grads):
            i = b.index
            m = self.momentum[i]
            lo, hi = self.layout.range(b)
            previous = m[lo:hi].clone()
            m[:b.numel].mul_(b1).add_(g, alpha=(1.0 - b1) * n * grad_scale)
            if n > 1:  # (the experts' group at ep = dp has one rank: nothing to exchange)
                self._scale(m, b, inverse=False)
                m.copy_(compressed_allreduce(m, self.worker[i], self.server[i], self.comm, tag="onebit_lamb",
                                             groups=self.groups[i], group_count=self.group_counts[i],
                                             layout=self.group_layouts[i]))
                self._scale(m, b, inverse=True)
            rebuilt = (m[lo:hi] - previous * b1) / (1.0 - b1)
            self.fresh[i].mul_(b2).addcmul_(rebuilt, rebuilt, value=1.0 - b2)
            denom = self.exp_avg_sq[i].sqrt().div_(bc2).add_(self.eps)
            ratio.append(denom / self.fresh[i].sqrt().div_(bc2_fresh).add_(self.eps))
            u = m[lo:hi] / denom / bc1
            plain.append(u.clone())
            if self.weight_decay:
                for a, z, _, decays in self.pieces[i]:
                    if decays:
                        u[a:z].add_(self.master[i][a:z], alpha=self.weight_decay)
            directions.append(u)
        factor = self._factors(ratio, plain, directions)
        frozen = self.per_layer[0]
        self.coeff = frozen * factor
        step = (-lr * self.coeff).tolist()
        for b, u in zip(self.layout.buckets, directions):
            i = b.index
            for a, z, layer, _ in self.pieces[i]:
                u[a:z].mul_(step[layer])
            self.master[i].add_(u)
            if not self.master_is_param[i]:
                self.target(b).copy_(self.master[i])
        self.sent = self._sent_so_far() - before

    def _factors(self, ratio: list[Tensor], plain: list[Tensor], directions: list[Tensor]) -> Tensor:
        """Each layer's factor: the largest frozen-over-fresh denominator ratio, blended towards 1 by the decay's
        share of the update, clipped to the bounds and to within the threshold of the last step's."""
        largest = torch.zeros(self.n_groups, dtype=torch.float64, device=self.device)
        for b, r in zip(self.layout.buckets, ratio):
            for a, z, layer, _ in self.pieces[b.index]:
                largest[layer] = torch.maximum(largest[layer], r[a:z].max().double())
        if self.shard is not None:
            self.shard.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, tag="onebit_lamb")
        self.tp.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, tag="onebit_lamb")
        factor = largest
        if self.weight_decay:
            sums = torch.stack([self._layer_sums(plain, self.pieces, True),
                                self._layer_sums(directions, self.pieces, True)])
            if self.shard is not None:
                self.shard.all_reduce(sums, tag="onebit_lamb")
            self.tp.all_reduce(sums, tag="onebit_lamb")
            share = torch.where(sums[1] > 0, (sums[0] / sums[1]).sqrt(), torch.ones_like(sums[0])).clamp(max=1.0)
            factor = factor * share + (1.0 - share)
        last = self.per_layer[1]
        factor = factor.clamp(self.factor_min, self.factor_max)
        factor = torch.minimum(torch.maximum(factor, last * (1.0 - self.factor_threshold)),
                               last * (1.0 + self.factor_threshold))
        last.copy_(factor)
        return factor

    # ----- checkpoints and accounting ---------------------------------------------------------------------------------
    def states_loaded(self) -> None:
        super().states_loaded()
        if self.step_count < self.freeze_step:
            self.fresh = [None] * len(self.fresh)

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """The per-layer figures from the first step; past the warm-up's last step also the fresh variance and
        1-bit Adam's error buffers."""
        if step < 1:
            return {}
        out = {"per_layer": self._layer_state(), **super().rank_state(step)}
        if step >= self.freeze_step:
            for b in self.layout.buckets:
                i = b.index
                if self.fresh[i] is None:
                    self.fresh[i] = torch.zeros_like(self.exp_avg_sq[i])
                out[f"{i}/fresh"] = self.fresh[i]
        return out

    def state_tensors(self) -> list[Tensor]:
        return super().state_tensors() + [t for t in self.fresh if t is not None]

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(t.numel() * 4 for t in self.fresh if t is not None)

    def record(self) -> Record:
        """The compressed bytes of the last step, summed over the partitions, and its smallest and largest trust
        ratio over them (-inf where a partition has no layer yet)."""
        trust = [-self.coeff.min().item(), self.coeff.max().item()] if self.coeff is not None else [-math.inf] * 2
        return Record(torch.tensor([self.sent] + trust, dtype=torch.float64), "local",
                      lambda v: {"optim/compressed_bytes": v[0], "optim/trust_min": -v[1], "optim/trust_max": v[2]},
                      per_value=("sum", "max", "max"))
