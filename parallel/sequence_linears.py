"""Column-parallel linears on a sequence-parallel input, and the GEMMs every linear runs (plain or FP8).

Under sequence parallelism a column-parallel linear's input is this rank's sequence shard: all-gathered for the
matmul, reduce-scattered on the way back (Korthikanti et al. 2022, §4.2.2). ``linear`` is ``F.linear`` or its
FP8 GEMMs under ``train.fp8``'s recipe (``kernels.fp8``), for every column- and row-parallel linear.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megazero.kernels.fp8 import E4M3, E5M2, fp8_linear, scaled_matmul
from megazero.parallel.comm import SEQ_DIM, Comm, Pending


def linear(x: Tensor, w: Tensor, b: Optional[Tensor], fp8: Optional[str] = None) -> Tensor:
    """``F.linear``, or its FP8 GEMMs under a recipe (``kernels.fp8``)."""
    return F.linear(x, w, b) if fp8 is None else fp8_linear(x, w, b, fp8)


def _gemm(a: Tensor, b: Tensor, fp8: Optional[str], out_dtype: torch.dtype) -> Tensor:
    """A backward GEMM, a gradient (a) times an activation or weight (b): in FP8 under a recipe."""
    if fp8 is None:
        return a.matmul(b)
    return scaled_matmul(a.reshape(-1, a.shape[-1]), b, fp8, E5M2, E4M3, out_dtype).view(*a.shape[:-1], b.shape[-1])


class _SequenceGatheredLinears(torch.autograd.Function):
    """ys_i = all_gather_seq(x) W_i^T + b_i that keeps only this rank's sequence shard x for backward.

    Saving the gathered input, as autograd would for ``F.linear(gather(x))``, would keep a full-sequence
    activation per column-parallel linear and undo sequence parallelism's 1/tp activation memory. Backward
    gathers x again, overlapped with dX = sum_i dY_i W_i, and reduce-scatters dX overlapped with
    dW_i = dY_i^T X (Korthikanti et al. 2022, §4.2.2; Megatron-LM's linear with async communication).
    Several weights share the one gather and the one reduce-scatter; with ``pending`` the reduce-scatter is
    left in flight for a later node to wait (``parallel.tp_overlap``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, pending: Optional[Pending], has_bias: tuple, fp8: Optional[str],
                *weights_and_biases: Tensor):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # gather in the dtype the matmul will read, as autocast would cast
            x = x.to(torch.get_autocast_dtype(device))
        total = comm.all_gather(x, dim=SEQ_DIM)
        n = len(has_bias)
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.save_for_backward(x, *weights)
        ctx.comm, ctx.pending, ctx.has_bias, ctx.fp8 = comm, pending, has_bias, fp8
        # under autocast: the cached low-precision weight, as any linear
        return tuple(linear(total, w, b if hb else None, fp8) for w, b, hb in zip(weights, biases, has_bias))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        x, *weights = ctx.saved_tensors
        comm = ctx.comm
        dtype = next(g.dtype for g in grads if g is not None)
        x = x.to(dtype)  # the compute dtype of the forward (autocast's, or the input's)
        moved = x.movedim(SEQ_DIM, 0).contiguous()  # collectives concatenate along dim 0
        gathered = moved.new_empty((comm.size * moved.shape[0],) + moved.shape[1:])
        work = comm.all_gather_into(gathered, moved, tag="activation_regather", async_op=True)
        grad_total = None
        for g, w in zip(grads, weights):
            if g is not None:
                part = _gemm(g, w.to(g.dtype), ctx.fp8, g.dtype)
                grad_total = part if grad_total is None else grad_total.add_(part)
        grad_moved = grad_total.movedim(SEQ_DIM, 0).contiguous()
        work.wait()
        grad_x = grad_moved.new_empty((grad_moved.shape[0] // comm.size,) + grad_moved.shape[1:])
        work = comm.reduce_scatter_into(grad_x, grad_moved, tag="activation", async_op=True)
        total = gathered.movedim(0, SEQ_DIM).reshape(-1, x.shape[-1])
        grad_weights, grad_biases = [], []
        for g, hb in zip(grads, ctx.has_bias):
            flat = None if g is None else g.reshape(-1, g.shape[-1])
            # autograd casts to the weight's dtype
            grad_weights.append(None if flat is None else _gemm(flat.t(), total, ctx.fp8, flat.dtype))
            grad_biases.append(flat.sum(0) if hb and flat is not None else None)
        if ctx.pending is None:
            work.wait()
        else:  # once: zb1p's deferred weight gradients run this node again, and nobody waits for that
            ctx.pending.put(work)
            ctx.pending = None
        return (grad_x.movedim(0, SEQ_DIM), None, None, None, None, *grad_weights, *grad_biases)


def sequence_gathered_linears(x: Tensor, weights: list[tuple[Tensor, Optional[Tensor]]],
                              comm: Optional[Comm], pending: Optional[Pending] = None,
                              fp8: Optional[str] = None) -> list[Tensor]:
    """Column-parallel linears on one sequence-parallel input: gathers the sequence once, keeps only the shard."""
    if comm is None or comm.size == 1:
        return [linear(x, w, b, fp8) for w, b in weights]
    has_bias = tuple(b is not None for _, b in weights)
    ws = [w for w, _ in weights]
    bs = [b if b is not None else x.new_empty(0) for _, b in weights]
    return list(_SequenceGatheredLinears.apply(x, comm, pending, has_bias, fp8, *ws, *bs))


def sequence_gathered_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], comm: Optional[Comm]) -> Tensor:
    """A column-parallel linear on sequence-parallel input: gathers the sequence, keeps only the shard."""
    return sequence_gathered_linears(x, [(weight, bias)], comm)[0]
