"""Expert parallelism: each token's copies to the ranks that hold its experts and back (GShard, Lepikhin et al.
2020, §2.2; Megatron-core's all-to-all token dispatcher), dropless and unpadded.

The E experts are split over the ep ranks of an ep group (``parallel.topology``: ep carved out of dp), rank r
holding experts [r·E/ep, (r+1)·E/ep). A layer's dispatch for one microbatch:

1. the token copies arrive sorted by expert (``models.moe``: a stable sort of the top-k choices), with their
   per-expert counts;
2. the counts are exchanged first (an all-to-all of E integers), and read on the host once: they are the
   splits of the all-to-all and the group sizes of the grouped matmul (the step's one sync per layer and
   microbatch, as Megatron's dispatcher; backward reuses them);
3. one ``all_to_all_single`` with uneven splits carries the rows to their experts' rank: no padding to
   E × capacity, so its buffers are the microbatch's tokens × top_k × hidden, whatever E;
4. the received rows, ordered (source rank, expert), are permuted to (expert, source rank) for the grouped
   matmul, and back after it; a second all-to-all returns them (``combine``).

Every step of it is differentiable (the all-to-all's backward is the all-to-all with the splits swapped), so
the gradients of the expert weights stay on their rank and are reduced over its edp group like any other.
Under fake tensors (``--simulate``) no count can be read: the plan assumes perfectly balanced routing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megazero.parallel.comm import Comm


@dataclass
class DispatchPlan:
    """One layer's routing of one microbatch over the ep group (host integers, and the permutations)."""

    send: list[int]  # rows this rank sends to each ep rank
    recv: list[int]  # rows it receives from each
    per_expert: list[int]  # rows each local expert computes, in (expert, source) order
    order: Optional[Tensor]  # received (source, expert) order -> (expert, source) order; None: the same
    inverse: Optional[Tensor]

    @property
    def rows(self) -> int:
        return sum(self.recv)


def is_fake(t: Tensor) -> bool:
    """A tensor of ``--simulate``'s fake mode: shapes without values."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(t)


def plan_dispatch(counts: Tensor, rows: int, ep: Comm, local_experts: int) -> DispatchPlan:
    """The splits of a dispatch from this rank's per-expert row counts (E integers, experts in global order,
    ``rows`` in all)."""
    size = ep.size
    experts = counts.numel()
    assert experts == size * local_experts, (experts, size, local_experts)
    if is_fake(counts):  # --simulate: perfectly balanced routing (no value can be read)
        return balanced_plan(rows, size, local_experts)
    if size == 1:
        per_expert = counts.tolist()
        return DispatchPlan([sum(per_expert)], [sum(per_expert)], per_expert, None, None)
    split = [local_experts] * size  # each rank's counts for the experts another holds
    received = ep.all_to_all(counts, split, split, tag="expert_counts")  # E integers, apart from the rows' "experts"
    host = torch.cat([counts, received]).tolist()  # the one host read
    mine, theirs = host[:experts], host[experts:]
    send = [sum(mine[r * local_experts:(r + 1) * local_experts]) for r in range(size)]
    recv = [sum(theirs[r * local_experts:(r + 1) * local_experts]) for r in range(size)]
    grid = torch.tensor(theirs, dtype=torch.long).view(size, local_experts)  # rows by (source, local expert)
    per_expert = grid.sum(0).tolist()
    if local_experts == 1:
        return DispatchPlan(send, recv, per_expert, None, None)
    starts = (grid.flatten().cumsum(0) - grid.flatten()).view(size, local_experts)
    lengths = grid.t().flatten()  # blocks in (expert, source) order
    block_starts = starts.t().flatten()
    offsets = torch.repeat_interleave(block_starts - (lengths.cumsum(0) - lengths), lengths)
    order = (offsets + torch.arange(int(lengths.sum()))).to(counts.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return DispatchPlan(send, recv, per_expert, order, inverse)


def balanced_plan(rows: int, size: int, local_experts: int) -> DispatchPlan:
    """The plan of perfectly balanced routing: what a simulated step assumes (and what plans count)."""
    per_rank = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    total = sum(per_rank)
    per_expert = [total // local_experts + (1 if e < total % local_experts else 0) for e in range(local_experts)]
    return DispatchPlan(per_rank, per_rank, per_expert, None, None)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, ep: Comm, out_splits: list[int], in_splits: list[int]) -> Tensor:
        ctx.ep, ctx.out_splits, ctx.in_splits = ep, out_splits, in_splits
        return ep.all_to_all(x, out_splits, in_splits, tag="experts")

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.ep.all_to_all(grad.contiguous(), ctx.in_splits, ctx.out_splits, tag="experts"), None, None, None


def dispatch(rows: Tensor, plan: DispatchPlan, ep: Comm) -> Tensor:
    """This rank's expert-sorted rows -> the rows of its local experts, in (expert, source rank) order."""
    if ep.size == 1:
        return rows
    out = _AllToAll.apply(rows, ep, plan.recv, plan.send)
    return out if plan.order is None else out.index_select(0, plan.order)


def combine(rows: Tensor, plan: DispatchPlan, ep: Comm) -> Tensor:
    """The local experts' outputs -> back to the ranks their tokens came from, in the sent order."""
    if ep.size == 1:
        return rows
    if plan.inverse is not None:
        rows = rows.index_select(0, plan.inverse)
    return _AllToAll.apply(rows, ep, plan.send, plan.recv)
