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

Left out of the compression (group 0, as if absent): the padding, and every element whose frozen ``sqrt(v_hat)``
is at most eps (a vocabulary row no token reached): its exact momentum is ~0, but a sign would move it by a
whole scale, divided by eps. Its momentum is zeroed, so it moves by weight decay only.

Scale groups: each parameter has its own scale in each chunk (``parallel.onebit``), as DeepSpeed compresses each
parameter's tensor apart; one scale over a chunk gives a small parameter its large neighbours' scale over its
own small frozen denominator (on the tiny model, 30 steps at dp 4, the attention biases' largest |weight| was
1.06 in fp32 and 73 in bf16 with a scale per chunk, 0.35 and 31 with one per parameter, AdamW's 0.02; what
remains is the key bias, whose exact gradient is 0: its variance is rounding noise just above eps). Copies
kept equal: a parameter held by other ranks outside this dp group (replicated over tp, a k/v piece on several
tp ranks, an embedding tied to the last pipeline stage's head) must take the same update there. A group never
mixes parameters held differently (split over tp, replicated over all of tp, replicated over some tp ranks),
so a copy's compressed value reads only elements the other ranks hold equally in the same places (the tp
ranks' buckets have equal offsets; a tied copy is a bucket of its own on both stages): it stays bit-identical.

Stages 0 and 1 only. Stage 1 shards the masters and the variance, but the momentum is whole on every rank (each
folds in its whole local gradient); ``exp_avg`` is its own slice, so checkpoints stay AdamW's. Stages 2-3 are
refused: the gradient is never reduced past the warm-up, so there is nothing to shard it into, and every rank
needs the whole local gradient of every bucket. The error buffers belong to the rank and its place in the
layout: a checkpoint keeps them per rank (``rank_state``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn

from megazero.kernels.adam_cpu import Run
from megazero.parallel.comm import Comm
from megazero.parallel.onebit import compressed_allreduce, group_layout, GroupLayout, padded_length
from megazero.parallel.zero.adamw import ShardedAdamW
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.update import Record

if TYPE_CHECKING:
    from megazero.parallel.zero.registry import OnebitAdamSection
    from megazero.parallel.zero.update import UpdateContext


def make_onebit_adam(section: "OnebitAdamSection", ctx: "UpdateContext") -> "ShardedOnebitAdam":
    """The registry's factory: 1-bit Adam over one partition, its momenta averaged over the partition's group."""
    assert ctx.state_device == ctx.device, "1-bit Adam's states stay on the device"
    tp = ctx.grid.tp_comm
    return ShardedOnebitAdam(ctx.layout, ctx.device, ctx.weight_decay, (section.beta1, section.beta2), section.eps,
                             ctx.grad_dtype, ctx.comm, tp.rank, tp.size, section.freeze_step)


class ShardedOnebitAdam(ShardedAdamW):
    def __init__(self, layout: BucketLayout, device: torch.device, weight_decay: float,
                 betas: tuple[float, float], eps: float, grad_dtype: torch.dtype, comm: Comm, tp_rank: int,
                 tp_size: int, freeze_step: int):
        """``comm``: the partition's data-parallel group (the momenta are averaged over it); ``tp_rank`` and
        ``tp_size``: this rank's and the group's (the norm's runs over whole buckets count a tp-replicated
        parameter once; the scale groups); ``freeze_step``: the last step of the full-precision warm-up."""
        # ShardedAdamW's by name: 1-bit LAMB puts ShardedLamb between the two (its warm-up is LAMB's update)
        ShardedAdamW.__init__(self, layout, device, device, "torch", weight_decay, betas, eps, grad_dtype)
        assert freeze_step >= 1, freeze_step
        assert not layout.policy.shard_grads, "1-bit Adam runs at ZeRO stages 0-1"
        self.comm, self.tp_rank, self.tp_size, self.freeze_step = comm, tp_rank, tp_size, freeze_step
        n = len(layout.buckets)
        self.momentum: list[Optional[Tensor]] = [None] * n  # whole bucket, padded to 8 * dp
        self.whole_counted: list[list[Run]] = [[] for _ in range(n)]  # norm runs over the whole bucket
        self.groups: list[Optional[Tensor]] = [None] * n  # uint8 per element: 0 left out, else its scale group
        self.group_layouts: list[Optional[GroupLayout]] = [None] * n  # where the groups lie in the chunks
        self.group_counts = [1] * n  # per bucket: its scale groups
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

    def _held(self, p: nn.Parameter) -> int:
        """The scale group of a parameter, by how other tp ranks hold it: 1 its own shard (or tp = 1), 2 the
        same values on every tp rank, 3 the same piece on some of them (k/v heads fewer than the tp ranks)."""
        if self.tp_size == 1:
            return 1
        if getattr(p, "tp_split_dim", None) is None:
            return 2
        return 3 if getattr(p, "tp_replicas", 1) > 1 else 1

    def _held_groups(self, b: Bucket, renumber: dict[int, int]) -> Tensor:
        """The whole bucket's scale groups by parameter, renumbered to the groups present (the padding 0): filled
        a parameter at a time, with no int64 index as long as the bucket."""
        out = torch.zeros(self.momentum[b.index].numel(), dtype=torch.uint8, device=self.device)
        for (_, p), off in zip(b.params, b.offsets):
            out[off:off + p.numel()] = renumber[self._held(p)]
        return out

    def _scale_groups(self, b: Bucket, renumber: dict[int, int]) -> tuple[Tensor, int]:
        """The bucket's scale groups and their count: a parameter each (``_param_groups``)."""
        return self._param_groups(b)

    def _param_groups(self, b: Bucket) -> tuple[Tensor, int]:
        """Each parameter its own scale group (not a large neighbour's scale over its own small denominator), and
        their count; a copy on another rank (tp, a tied stage) has the same place in its bucket. Past 85
        parameters of one kind (``_held``) in a bucket, neighbours of that kind share a group (85 runs of them,
        so the groups' spans stay apart), never across kinds (copies stay bit-identical)."""
        kinds = [self._held(p) for _, p in b.params]
        of_kind = {k: kinds.count(k) for k in set(kinds)}
        seen = dict.fromkeys(of_kind, 0)
        ids = []
        for k in kinds:
            ids.append(85 * (k - 1) + seen[k] * 85 // max(of_kind[k], 85))
            seen[k] += 1
        renumber = {g: k for k, g in enumerate(sorted(set(ids)), 1)}
        out = torch.zeros(self.momentum[b.index].numel(), dtype=torch.uint8, device=self.device)
        for g, (_, p), off in zip(ids, b.params, b.offsets):
            out[off:off + p.numel()] = renumber[g]
        return out, len(renumber)

    # ----- the compressed phase -----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Before the first compressed step (and after a resume into one): the live mask from the frozen variance,
        the scale groups, the whole momentum on every rank (stage 1: its slices gathered), zero where not live;
        error buffers."""
        bc2 = math.sqrt(1.0 - self.betas[1] ** self.freeze_step)
        n = self.comm.size
        held = {self._held(p) for b in self.layout.buckets for _, p in b.params}
        renumber = {g: k for k, g in enumerate(sorted(held), 1)}  # the groups present, as 1..K
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
            groups, self.group_counts[i] = self._scale_groups(b, renumber)
            self.groups[i] = groups.mul_(live.to(torch.uint8))
            self.group_layouts[i] = group_layout(self.groups[i], n, self.group_counts[i])
            if self.worker[i] is None:
                self.worker[i] = torch.zeros_like(m)
                self.server[i] = torch.zeros(m.numel() // n, dtype=torch.float32, device=self.device)
        self.prepared = True

    def states_loaded(self) -> None:
        self.prepared = False  # the mask and the whole momentum are rebuilt from what was loaded
        if self.step_count <= self.freeze_step:  # a state of the warm-up: no error feedback yet (a rollback into
            self.worker = [None] * len(self.worker)  # it, in the same process, must not keep the later one's)
            self.server = [None] * len(self.server)

    def rank_state(self, step: int) -> dict[str, Tensor]:
        """This rank's error buffers by bucket ("<bucket>/worker", "<bucket>/server"), which a checkpoint keeps
        per rank, as of optimizer step ``step``: none in the warm-up, its last step included (no compressed step
        has run: they are zeros, made at the first), else the buffers (allocated, as zeros, where a load is to
        fill them). A checkpoint of the warm-up's last step is then AdamW's, and resumes at any layout."""
        if step <= self.freeze_step:
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
        before = self._sent_so_far()
        for b, g in zip(self.layout.buckets, grads):
            i = b.index
            m = self.momentum[i]
            m[:b.numel].mul_(b1).add_(g, alpha=(1.0 - b1) * n * grad_scale)
            if n > 1:
                m.copy_(compressed_allreduce(m, self.worker[i], self.server[i], self.comm, tag="onebit",
                                             groups=self.groups[i], group_count=self.group_counts[i],
                                             layout=self.group_layouts[i]))
            master = self.master[i]
            if self.weight_decay:
                master.mul_(torch.where(self.decay_mask[i], 1.0 - lr * self.weight_decay, 1.0))  # no host copy
            denom = (self.exp_avg_sq[i].sqrt() / bc2).add_(self.eps)
            master.addcdiv_(self.exp_avg[i], denom, value=-lr / bc1)
            if not self.master_is_param[i]:
                target = self.target(b)
                target.copy_(master, non_blocking=target.device.type == "cuda")
        self.sent = self._sent_so_far() - before

    def _sent_so_far(self) -> float:
        """Bytes this rank has put on the wire over the partition's group (the comm counter's; 0 without one)."""
        counter = self.comm.counter
        return counter.sent_bytes().get(self.comm.name, 0.0) if counter is not None else 0.0

    # ----- accounting -----------------------------------------------------------------------------------------------
    def state_tensors(self) -> list[Tensor]:
        """AdamW's states, then the momentum (whole buckets), the scale groups and the error buffers."""
        extra = [m for m in self.momentum if m is not None]
        extra += [t for kind in self.extra_kinds() for t in kind if t is not None]
        return super().state_tensors() + extra

    def extra_kinds(self) -> list[list[Optional[Tensor]]]:
        """The per-bucket states beyond AdamW's and the momentum (a subclass adds its own)."""
        return [self.groups, self.worker, self.server]

    def record(self) -> Record:
        """Bytes the last compressed step put on the wire from this rank (summed over the partitions only)."""
        return Record(torch.tensor([self.sent], dtype=torch.float64), "local",
                      lambda v: {"optim/compressed_bytes": v[0]})

    def state_bytes(self) -> int:
        """AdamW's states, the momentum beyond its range (the padding, and at stage 1 the other slices), and
        past the warm-up the scale groups (a byte each) and the error buffers."""
        total = super().state_bytes()
        for b in self.layout.buckets:
            i = b.index
            total += (self.momentum[i].numel() - self.exp_avg[i].numel()) * 4
            total += sum(t[i].numel() * t[i].element_size() for t in self.extra_kinds() if t[i] is not None)
        return total
