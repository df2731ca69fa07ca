"""Tensor-parallel regions: the Megatron f/g autograd functions over a :class:`parallel.comm.Comm`.

The autograd functions are the conjugate pairs of Megatron-LM (Shoeybi et al.
2019, §3) and of sequence parallelism (Korthikanti et al. 2022, §4.2.2):

=========================  ======================  ======================
function                   forward                 backward
=========================  ======================  ======================
copy_to_region (f)         identity                all-reduce
reduce_from_region (g)     all-reduce              identity
gather_from_region         all-gather, last dim    split, last dim
scatter_to_region          split, last dim         all-gather, last dim
gather_from_sequence       all-gather, seq dim     reduce-scatter, seq dim
reduce_scatter_to_sequence reduce-scatter, seq dim all-gather, seq dim
=========================  ======================  ======================

Each is the identity when the group has one rank (or is None). The
column-parallel linears do gather_from_sequence's work themselves
(``parallel.tensor.sequence_gathered_linear``), keeping only the shard for
backward. f and g sum in place, nothing cloned: their inputs are fresh matmul
outputs and gradients that nothing else reads. A :class:`Pending` carries a
collective launched in one autograd node to the later node that waits for it
(``parallel.tp_overlap``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from parallel.comm import SEQ_DIM, Comm, Pending


class _CopyToRegion(torch.autograd.Function):
    """f: every rank uses the same input, so its gradient is the sum of theirs.

    The sum is taken in place: f's output feeds column-parallel matmuls only, whose input gradient is a fresh
    tensor no other node holds. With ``pending`` it is left in flight there, for a later node to wait."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, pending: Optional[Pending]) -> Tensor:
        ctx.comm, ctx.pending = comm, pending
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        if ctx.pending is None:
            return ctx.comm.all_reduce(grad), None, None
        ctx.pending.put(ctx.comm.all_reduce(grad, async_op=True))
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: partial sums from every rank are added; each rank's gradient is the whole one.

    In place on its input (a matmul's or an embedding's fresh output, which autograd does not keep), unless
    that is not contiguous and a contiguous copy is summed instead."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        y = x.contiguous()
        if y is x:
            ctx.mark_dirty(x)
        return comm.all_reduce(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return comm.all_gather(x, dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.split(grad, dim=grad.dim() - 1), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return comm.split(x, dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.all_gather(grad, dim=grad.dim() - 1), None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence-parallel region -> tensor-parallel region (before a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return comm.all_gather(x, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.reduce_scatter(grad, dim=SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Tensor-parallel partial sums -> sequence-parallel region (after a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return comm.reduce_scatter(x, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.comm.all_gather(grad, dim=SEQ_DIM), None


def _active(comm: Optional[Comm]) -> bool:
    return comm is not None and comm.size > 1


def copy_to_region(x: Tensor, comm: Optional[Comm], pending: Optional[Pending] = None) -> Tensor:
    """f; with ``pending``, backward's all-reduce is launched and left there to be waited by a later node."""
    return _CopyToRegion.apply(x, comm, pending) if _active(comm) else x


def reduce_from_region(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _ReduceFromRegion.apply(x, comm) if _active(comm) else x


def gather_from_region(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _GatherFromRegion.apply(x, comm) if _active(comm) else x


def scatter_to_region(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _ScatterToRegion.apply(x, comm) if _active(comm) else x


def gather_from_sequence(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _GatherFromSequence.apply(x, comm) if _active(comm) else x


def reduce_scatter_to_sequence(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _ReduceScatterToSequence.apply(x, comm) if _active(comm) else x
