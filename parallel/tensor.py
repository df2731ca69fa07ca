"""Tensor-parallel layers: the Megatron-LM vocabulary (Shoeybi et al. 2019, arXiv:1909.08053).

A transformer block needs only two collectives per sub-layer when its first
linear is split by output columns and its second by input rows: the input of
the column-parallel layer is copied to every rank (``f``) and the output of
the row-parallel layer is summed over ranks (``g``). With sequence parallelism
(Korthikanti et al. 2022) the activations between blocks are split along the
sequence instead of replicated, and f/g become all-gather / reduce-scatter
along the sequence: the same bytes, but norms and dropout work on 1/tp of the
tokens. The embedding and the tied output head split the vocabulary, and the
cross entropy (``parallel.cross_entropy``) is computed on the vocabulary
shards without ever gathering full-vocabulary logits.

Every parameter carries ``tp_split_dim`` (the dimension split over the tensor
parallel group, or None when replicated), ``tp_replicas`` (consecutive tp ranks
holding the same piece of a split parameter: 1, or more for k/v heads fewer than
tp ranks) and ``sequence_parallel`` (True when it is replicated but sees only
this rank's tokens, so its gradient must be summed over the tp group). Initialisation and checkpoints build or read the
full tensor and keep this rank's slice, so a model is the same at any
tensor-parallel size.

``tp=None`` (or a group of one rank) means plain ``nn.Linear``/``nn.Embedding``
arithmetic that never touches torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megazero.parallel.comm import Comm
from megazero.parallel.regions import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)
from megazero.parallel.sequence_linears import linear, sequence_gathered_linears

if TYPE_CHECKING:
    from megazero.parallel.tp_overlap import Entry


def tp_rank_and_size(tp: Optional[Comm]) -> tuple[int, int]:
    """(rank, size) inside the tensor-parallel group; (0, 1) without one."""
    return (0, 1) if tp is None else (tp.rank, tp.size)


def _divide(total: int, parts: int, what: str) -> int:
    assert total % parts == 0, f"{what}={total} is not divisible by tensor-parallel size {parts}"
    return total // parts


def _param(shape: tuple[int, ...], tp_split_dim: Optional[int], sequence_parallel: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape))
    p.tp_split_dim = tp_split_dim
    p.sequence_parallel = sequence_parallel
    p.tp_replicas = 1  # tp ranks holding the same piece (ColumnParallelLinear's replicas)
    return p


def mark_sequence_parallel(module: nn.Module) -> None:
    """Parameters of a module that runs on sequence shards (LayerNorm): grads need a tp all-reduce."""
    for p in module.parameters():
        p.sequence_parallel = True


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows (the vocabulary) split over the tensor-parallel group.

    Rank r holds ids [vocab_start, vocab_end); ids outside give zero vectors
    and the reduction fills them in from the owning rank — an all-reduce, or a
    reduce-scatter straight into the sequence-parallel layout.
    """

    def __init__(self, num_embeddings: int, dim: int, tp: Optional[Comm] = None, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp_rank_and_size(tp)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.num_embeddings, self.dim = num_embeddings, dim
        per_rank = _divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = _param((per_rank, dim), tp_split_dim=0)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp)
        return reduce_from_region(out, self.tp)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split over ranks (weight (out/tp, in)).

    Input: replicated (f: copy), or sequence-sharded with ``sequence_parallel``
    (all-gather along the sequence). The output stays split over the feature
    dimension unless ``gather_output``; a RowParallelLinear consumes it split.

    ``replicas``: the group of consecutive tp ranks that hold the same rows, for outputs split into fewer
    pieces than tp ranks (grouped-query attention's k/v heads when kv_heads < tp, replicated as in
    Megatron-LM): rows are split into tp/replicas pieces, tp rank r holds piece r // replicas, and the
    weight's gradient is summed over the group, each replica having seen only its own ranks' query heads.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp: Optional[Comm] = None,
                 gather_output: bool = False, sequence_parallel: bool = False, replicas: Optional[Comm] = None):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp_rank_and_size(tp)
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        n_replicas = 1 if self.replicas is None else self.replicas.size
        assert not (gather_output and self.replicas), "a replicated output is not gathered"
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        per_rank = _divide(out_features, _divide(self.tp_size, n_replicas, "replicas"), "output features")
        self.weight = _param((per_rank, in_features), tp_split_dim=0)
        self.bias = _param((per_rank,), tp_split_dim=0) if bias else None
        for p in self.parameters():
            p.tp_replicas = n_replicas
        self.fp8: Optional[str] = None  # train.fp8's recipe for this linear's GEMMs (megazero.engine.fp8_layers)

    def forward(self, x: Tensor, entry: Optional["Entry"] = None,
                consume: Optional[Callable[[Tensor, Tensor], Tensor]] = None) -> Tensor:
        """``consume(input, weight)``: returned instead of the output, from the input as every rank sees it and
        this rank's weight (the chunked head loss: the output never whole), through the module for ZeRO's hooks."""
        if consume is None:
            return column_parallel_linears(x, [self], entry)[0]
        assert entry is None and self.bias is None and self.replicas is None
        whole = gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_region(x, self.tp)
        return consume(whole, self.weight)

    def weights(self) -> tuple[Tensor, Optional[Tensor]]:
        """(weight, bias) as the forward uses them: through the replica gradient sum when replicated."""
        return sum_over_replicas(self.weight, self.replicas), sum_over_replicas(self.bias, self.replicas)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_rank}/{self.tp_size}"


def column_parallel_linears(x: Tensor, linears: list[ColumnParallelLinear],
                            entry: Optional["Entry"] = None) -> list[Tensor]:
    """Several column-parallel linears of one input (q, k, v; SwiGLU's gate and up) with one collective.

    Separate parameters keep the logical (layout-free) shapes that checkpoints and Hugging Face use, while the
    input is copied, or gathered along the sequence, once for all of them: one all-gather forward and one
    reduce-scatter backward under sequence parallelism, as a fused weight would need.

    ``entry`` (``parallel.tp_overlap``): one half of a microbatch enters here; the backward collective on the
    input's gradient is left in flight in ``entry.pending``, and the weights are shared with the other half."""
    first = linears[0]
    assert all(lin.tp is first.tp and lin.sequence_parallel == first.sequence_parallel for lin in linears)
    weights = [lin.weights() if entry is None else entry.weights(lin) for lin in linears]
    pending = None if entry is None else entry.pending
    assert all(lin.fp8 == first.fp8 for lin in linears), "one recipe for the linears of one input"
    if first.sequence_parallel:
        ys = sequence_gathered_linears(x, weights, first.tp, pending, first.fp8)
    else:
        x = copy_to_region(x, first.tp, pending)
        ys = [linear(x, w, b, first.fp8) for w, b in weights]
    return [gather_from_region(y, lin.tp) if lin.gather_output else y for y, lin in zip(ys, linears)]


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks that hold the same replicated piece."""

    @staticmethod
    def forward(ctx, w: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, tag="grad")
        return grad, None


def sum_over_replicas(w: Optional[Tensor], comm: Optional[Comm]) -> Optional[Tensor]:
    """``w`` whose gradient is summed over ``comm`` (the identity without a group of two or more)."""
    if w is None or comm is None or comm.size == 1:
        return w
    return _SumOverReplicas.apply(w, comm)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over ranks (weight (out, in/tp)).

    Each rank multiplies its input shard; the sum over ranks (g: all-reduce, or
    a reduce-scatter along the sequence with ``sequence_parallel``) is the
    output. The bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp: Optional[Comm] = None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp_rank_and_size(tp)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = _param((out_features, per_rank), tp_split_dim=1)
        self.bias = _param((out_features,), None, self.sequence_parallel) if bias else None
        self.fp8: Optional[str] = None  # as ColumnParallelLinear's

    def forward(self, x: Tensor) -> Tensor:
        y = self.partial(x)
        y = reduce_scatter_to_sequence(y, self.tp) if self.sequence_parallel else reduce_from_region(y, self.tp)
        return y if self.bias is None else y + self.bias

    def partial(self, x: Tensor) -> Tensor:
        """This rank's partial sums, before the reduction over ranks and the bias (``parallel.tp_overlap``
        reduces them asynchronously)."""
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.tp)
        return linear(x, self.weight, None, self.fp8)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_rank}/{self.tp_size}"
