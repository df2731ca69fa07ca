"""Tensor-parallel communication hidden behind computation, as Domino does (Wang et al. 2024, arXiv:2409.15241).

A Megatron block (``parallel.tensor``) waits for two collectives per sub-layer pair each way: the row-parallel
output's all-reduce (reduce-scatter under sequence parallelism) in forward and the column-parallel input's
all-reduce (reduce-scatter) in backward. Domino's row split of the input cuts the microbatch along the batch
into halves A and B, which share nothing inside a block, and reduces one half while the other computes:

    forward   A attn ↑a0 | B attn ↑b0 | ↓a0 A mlp ↑a1 | ↓b0 B mlp ↑b1 | ↓a1 ↓b1
    backward  B mlp ↑b1 | A mlp ↑a1 | ↓b1 B attn ↑b0 | ↓a1 A attn ↑a0 | ↓b0 ↓a0

(↑ launch, ↓ wait). Three of a block's four collectives are hidden each way; the last one is waited at the end
of the block, which is not pipelined with the next. The all-gathers of sequence parallelism (the column input's
in forward, the row output gradient's in backward) stay blocking: each is needed right after it starts.

Backward follows the autograd engine, which runs the ready node created last. A half's *segment* (the
element-wise stretch between a row-parallel reduction and the next column-parallel input: bias, dropout,
residual add, norm) must run its backward after the other half's next matmuls, so its autograd node is created
when its reduction is launched, before those matmuls, and its values are computed later, after the wait
(``_Segment.fill``). The segment's own operations are recorded as a graph of their own, run from that node's
backward: first it waits for the collective that the column-parallel entry's backward left in flight on the
norm output's gradient (``Entry.pending``), then it differentiates the segment. The local graph keeps its saved
tensors (norm inputs, dropout masks) outside activation checkpointing, whose recomputation is keyed by the graph
task that unpacks and would run again for each local backward: a checkpointed block keeps those and recomputes
the rest. zb1p's deferred weight gradients run a segment's node a second time: it hands back the parameter
gradients of the first run (a norm's and a bias: small), kept for that.

Dropout masks are drawn for the whole microbatch, in the order a block without overlap draws them, and split:
a run with and without ``parallel.tp_overlap`` uses the same masks.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from megazero.parallel.comm import SEQ_DIM, Pending


class Sublayer(NamedTuple):
    """One residual branch of a pre-norm block: ``x + dropout(row(body(norm(x))))``."""

    norm: nn.Module
    body: nn.Module  # body(u, entry): the row-parallel layer's partial sums (``RowParallelLinear.partial``)
    row: nn.Module  # that RowParallelLinear: its group, layout and bias
    dropout: nn.Module  # a parallel.tp_random.ShardedDropout


class Entry:
    """How one half enters a sub-layer's tensor-parallel region (``column_parallel_linears(x, ..., entry)``)."""

    def __init__(self, shared: dict):
        self.pending = Pending()  # the collective on the entry input's gradient, launched by its backward
        self._shared = shared

    def weights(self, linear: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
        """``linear.weights()``, once for both halves: a replicated k/v weight's gradient is summed once."""
        key = id(linear)
        if key not in self._shared:
            self._shared[key] = linear.weights()
        return self._shared[key]


def _same(t: Tensor) -> Tensor:
    return t


class _Attach(torch.autograd.Function):
    """An input of a segment's local graph: its gradient is read at this node and never flows further, and
    nothing here keeps the input's storage (a detached leaf would)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, None


class _Open(torch.autograd.Function):
    """A segment's node: created when its reduction is launched, values filled in later."""

    @staticmethod
    def forward(ctx, seg: "_Segment", x: Tensor, y: Optional[Tensor], *params: Tensor):
        ctx.seg = seg
        return seg.launch()

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, *ctx.seg.backward(grads))


class _Segment:
    """One half's ``x' = x + dropout(reduce(y) + bias)`` and ``u = norm(x')`` (the first segment of a block has
    no y and outputs u, the last has no norm and outputs x')."""

    def __init__(self, x: Tensor, y: Optional[Tensor], row: Optional[nn.Module], mask: Optional[Tensor],
                 norm: Optional[nn.Module], shared: dict, anchor: Optional[Tensor]):
        assert y is not None or norm is not None
        self.x, self.y, self.mask, self.norm, self.anchor = x, y, mask, norm, anchor
        self.comm = None if y is None else row.tp
        self.sp = y is not None and row.sequence_parallel
        self.bias = None if y is None else row.bias
        self.entry = Entry(shared) if norm is not None else None
        params = ([] if self.bias is None else [self.bias]) + ([] if norm is None else list(norm.parameters()))
        self.params = [p for p in params if p.requires_grad]
        self.graph = torch.is_grad_enabled()
        self.work, self.reduced, self.bufs = None, None, []
        self.in_edges: list = []
        self.out_edges: Optional[list] = None
        self.param_grads: Optional[tuple] = None

    def open(self) -> tuple[Tensor, ...]:
        """Launch the reduction of y; return the outputs (x' if there is a y, u if there is a norm), empty
        until :meth:`fill`."""
        return _Open.apply(self, self.x, self.y, *self.params)

    def launch(self) -> tuple[Tensor, ...]:
        x, y = self.x, self.y
        if y is not None:
            if self.sp:  # reduce-scatter along the sequence (collectives concatenate along dim 0)
                moved = y.movedim(SEQ_DIM, 0).contiguous()
                self.reduced = moved.new_empty((moved.shape[0] // self.comm.size,) + moved.shape[1:])
                self.work = self.comm.reduce_scatter_into(self.reduced, moved, tag="activation", async_op=True)
            else:  # in place: y is the row-parallel matmul's fresh output, read by nobody but fill
                self.reduced = y.contiguous()
                self.work = self.comm.all_reduce(self.reduced, tag="activation", async_op=True)
            dtype = y.dtype if self.bias is None else torch.promote_types(y.dtype, self.bias.dtype)
            if self.mask is not None:
                dtype = torch.promote_types(dtype, self.mask.dtype)
            self.bufs.append(_placeholder(x, torch.promote_types(x.dtype, dtype)))
        if self.norm is not None:
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else (
                self.bufs[0].dtype if self.bufs else x.dtype)
            self.bufs.append(_placeholder(x, dtype))
        return tuple(self.bufs)

    def _input(self, t: Tensor) -> Tensor:
        if not self.graph:
            return t
        t = _Attach.apply(self.anchor, t)
        self.in_edges.append(get_gradient_edge(t))
        return t

    def fill(self) -> None:
        """Wait for the reduction and compute the outputs, recording their graph for backward."""
        if self.work is not None:
            self.work.wait()
        r = self.reduced.movedim(0, SEQ_DIM).contiguous() if self.sp else self.reduced
        outs = []
        with torch.enable_grad() if self.graph else torch.no_grad(), saved_tensors_hooks(_same, _same):
            x = self._input(self.x)
            if r is not None:
                z = self._input(r)
                z = z if self.bias is None else z + self.bias
                z = z if self.mask is None else z * self.mask
                x = x + z
                outs.append(x)
            if self.norm is not None:
                outs.append(self.norm(x))
        for buf, value in zip(self.bufs, outs, strict=True):
            assert buf.shape == value.shape and buf.dtype == value.dtype, (buf.shape, buf.dtype, value.dtype)
            buf.data = value.detach()  # the output node's tensor takes the values' storage: no copy
        if self.graph:
            self.out_edges = [get_gradient_edge(v) for v in outs]
        self.x = self.y = self.reduced = self.work = self.mask = None
        self.bufs = []

    def backward(self, grads: tuple[Tensor, ...]) -> tuple[Optional[Tensor], ...]:
        if self.out_edges is None:  # run again for zb1p's deferred weight gradients: the parameters' share
            assert self.param_grads is not None, "a segment's backward runs after its fill"
            return (None, None, *self.param_grads)
        if self.entry is not None:
            self.entry.pending.wait()  # u's gradient, summed over tp by the next body's entry
        got = torch.autograd.grad(self.out_edges, self.in_edges + self.params, grads, allow_unused=True)
        self.out_edges, self.in_edges = None, []
        grad_x, rest = got[0], got[1:]
        grad_y = None
        if self.comm is not None:
            grad_y, rest = rest[0], rest[1:]
            if self.sp:  # the conjugate of the reduce-scatter
                grad_y = self.comm.all_gather(grad_y, dim=SEQ_DIM)
        self.param_grads = rest
        return (grad_x, grad_y, *rest)


def _placeholder(like: Tensor, dtype: torch.dtype) -> Tensor:
    """An output of the shape of ``like`` whose storage (one element) is replaced when it is filled."""
    return torch.empty_strided(like.shape, (0,) * like.dim(), dtype=dtype, device=like.device)


def _whole_mask(sub: Sublayer, y: Tensor) -> Optional[Tensor]:
    """The dropout mask (scaled by 1/(1-p)) of the whole microbatch after ``sub``, from half A's partial sums
    ``y``: drawn as the block without overlap draws it, over the reduced output's full shape and dtype."""
    d = sub.dropout
    if not d.training or d.p == 0.0:
        return None
    row = sub.row
    seq = y.shape[SEQ_DIM] // row.tp.size if row.sequence_parallel else y.shape[SEQ_DIM]
    shape = (2 * y.shape[0], seq) + tuple(y.shape[2:])
    dtype = y.dtype if row.bias is None else torch.promote_types(y.dtype, row.bias.dtype)
    return d(torch.ones(shape, dtype=dtype, device=y.device))


def overlapped_block(x: Tensor, sublayers: Sequence[Sublayer]) -> Tensor:
    """``x`` through pre-norm residual sub-layers (``x = x + dropout(row(body(norm(x))))`` each) as two halves
    of its batch, each half's reductions hidden behind the other half's matmuls, forward and backward."""
    assert x.shape[0] % 2 == 0, f"tp_overlap splits the microbatch in two halves: batch {x.shape[0]} is odd"
    anchor = x.new_zeros((), requires_grad=True) if torch.is_grad_enabled() else None
    shared: list[dict] = [{} for _ in sublayers]
    xs = list(x.chunk(2, dim=0))
    # both halves' first norms come before any matmul: their nodes run last in backward
    segs, us = [], []
    for h in range(2):
        seg = _Segment(xs[h], None, None, None, sublayers[0].norm, shared[0], anchor)
        (u,) = seg.open()
        seg.fill()
        segs.append(seg)
        us.append(u)
    for k, sub in enumerate(sublayers):
        last = k + 1 == len(sublayers)
        norm = None if last else sublayers[k + 1].norm
        masks: Optional[tuple[Tensor, ...]] = None
        for h in range(2):
            if k > 0:
                segs[h].fill()  # waits for this half's reduction, hidden behind the other half's body
            y = sub.body(us[h], segs[h].entry)
            if h == 0:
                mask = _whole_mask(sub, y)
                masks = None if mask is None else mask.chunk(2, dim=0)
            segs[h] = _Segment(xs[h], y, sub.row, None if masks is None else masks[h], norm,
                               {} if last else shared[k + 1], anchor)
            outs = segs[h].open()
            xs[h] = outs[0]
            if not last:
                us[h] = outs[1]
    for seg in segs:
        seg.fill()
    return torch.cat(xs, dim=0)
