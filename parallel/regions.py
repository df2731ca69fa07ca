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
(``parallel.sequence_linears.sequence_gathered_linear``), keeping only the shard for
backward. f and g sum in place, nothing cloned: their inputs are fresh matmul
outputs and gradients that nothing else reads. A :class:`Pending` carries a
collective launched in one autograd node to the later node that waits for it
(``parallel.tp_overlap``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from megazero.parallel.comm import SEQ_DIM, Comm, Pending


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


class _Conjugate(torch.autograd.Function):
    """A collective (or split) whose backward is its conjugate over the same dim: all-gather / split along the
    last dim (gather_from_region, scatter_to_region), all-gather / reduce-scatter along the sequence
    (gather_from_sequence, reduce_scatter_to_sequence). ``dim`` None: the last dim."""

    @staticmethod
    def forward(ctx, x: Tensor, forward: Callable, backward: Callable, dim: Optional[int]) -> Tensor:
        ctx.backward_op, ctx.dim = backward, dim
        return forward(x, dim=x.dim() - 1 if dim is None else dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.backward_op(grad, dim=grad.dim() - 1 if ctx.dim is None else ctx.dim), None, None, None


def _active(comm: Optional[Comm]) -> bool:
    return comm is not None and comm.size > 1


def copy_to_region(x: Tensor, comm: Optional[Comm], pending: Optional[Pending] = None) -> Tensor:
    """f; with ``pending``, backward's all-reduce is launched and left there to be waited by a later node."""
    return _CopyToRegion.apply(x, comm, pending) if _active(comm) else x


def reduce_from_region(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _ReduceFromRegion.apply(x, comm) if _active(comm) else x


def gather_from_region(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _Conjugate.apply(x, comm.all_gather, comm.split, None) if _active(comm) else x


def scatter_to_region(x: Tensor, comm: Optional[Comm]) -> Tensor:
    return _Conjugate.apply(x, comm.split, comm.all_gather, None) if _active(comm) else x


def gather_from_sequence(x: Tensor, comm: Optional[Comm]) -> Tensor:
    """Sequence-parallel region -> tensor-parallel region (before a column-parallel linear)."""
    return _Conjugate.apply(x, comm.all_gather, comm.reduce_scatter, SEQ_DIM) if _active(comm) else x


def reduce_scatter_to_sequence(x: Tensor, comm: Optional[Comm]) -> Tensor:
    """Tensor-parallel partial sums -> sequence-parallel region (after a row-parallel linear)."""
    return _Conjugate.apply(x, comm.reduce_scatter, comm.all_gather, SEQ_DIM) if _active(comm) else x


def split_to_sequence(x: Tensor, comm: Optional[Comm]) -> Tensor:
    """A tensor every tp rank holds whole -> this rank's part of the sequence (no communication); backward
    all-gathers the parts' gradients, so every rank gets the whole, as each held the whole."""
    return _Conjugate.apply(x, comm.split, comm.all_gather, SEQ_DIM) if _active(comm) else x


def gather_to_whole(x: Tensor, comm: Optional[Comm]) -> Tensor:
    """Each tp rank's part of the sequence -> the whole sequence on every rank; backward keeps this rank's part
    of the (equal) gradients: :func:`split_to_sequence`'s conjugate."""
    return _Conjugate.apply(x, comm.all_gather, comm.split, SEQ_DIM) if _active(comm) else x
