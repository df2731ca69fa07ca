"""Tensor-parallel layers: the Megatron-LM vocabulary (Shoeybi et al. 2019, arXiv:1909.08053).

A transformer block needs only two collectives per sub-layer when its first
linear is split by output columns and its second by input rows: the input of
the column-parallel layer is copied to every rank (``f``) and the output of
the row-parallel layer is summed over ranks (``g``). With sequence parallelism
(Korthikanti et al. 2022) the activations between blocks are split along the
sequence instead of replicated, and f/g become all-gather / reduce-scatter
along the sequence: the same bytes, but norms and dropout work on 1/tp of the
tokens. The embedding and the tied output head split the vocabulary, and the
cross entropy is computed on the vocabulary shards without ever gathering
full-vocabulary logits.

Every parameter carries ``tp_split_dim`` (the dimension split over the tensor
parallel group, or None when replicated) and ``sequence_parallel`` (True when
it is replicated but sees only this rank's tokens, so its gradient must be
summed over the tp group). Initialisation and checkpoints build or read the
full tensor and keep this rank's slice, so a model is the same at any
tensor-parallel size.

``tp=None`` (or a group of one rank) means plain ``nn.Linear``/``nn.Embedding``
arithmetic that never touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallel.comm import (
    SEQ_DIM,
    Comm,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)


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
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp: Optional[Comm] = None,
                 gather_output: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp_rank_and_size(tp)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = _param((per_rank, in_features), tp_split_dim=0)
        self.bias = _param((per_rank,), tp_split_dim=0) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            y = sequence_gathered_linear(x, self.weight, self.bias, self.tp)
        else:
            y = F.linear(copy_to_region(x, self.tp), self.weight, self.bias)
        return gather_from_region(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_rank}/{self.tp_size}"


class _SequenceGatheredLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b that keeps only this rank's sequence shard x for backward.

    Saving the gathered input, as autograd would for ``F.linear(gather(x))``, would keep a full-sequence
    activation per column-parallel linear and undo sequence parallelism's 1/tp activation memory. Backward
    gathers x again, overlapped with dX = dY W, and reduce-scatters dX overlapped with dW = dY^T X
    (Korthikanti et al. 2022, §4.2.2; Megatron-LM's linear with async communication).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], comm: Comm) -> Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # gather in the dtype the matmul will read, as autocast would cast
            x = x.to(torch.get_autocast_dtype(device))
        total = comm.all_gather(x, dim=SEQ_DIM)
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(total, weight, bias)  # under autocast: the cached low-precision weight, as any linear

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        x = x.to(grad.dtype)  # the compute dtype of the forward (autocast's, or the input's)
        moved = x.movedim(SEQ_DIM, 0).contiguous()  # collectives concatenate along dim 0
        gathered = moved.new_empty((comm.size * moved.shape[0],) + moved.shape[1:])
        work = comm.all_gather_into(gathered, moved, tag="activation_regather", async_op=True)
        grad_total = grad.matmul(weight.to(grad.dtype))
        grad_moved = grad_total.movedim(SEQ_DIM, 0).contiguous()
        work.wait()
        grad_x = grad_moved.new_empty((grad_moved.shape[0] // comm.size,) + grad_moved.shape[1:])
        work = comm.reduce_scatter_into(grad_x, grad_moved, tag="activation", async_op=True)
        total = gathered.movedim(0, SEQ_DIM).reshape(-1, x.shape[-1])
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat_grad.t().matmul(total)  # autograd casts it to the weight's dtype
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        work.wait()
        return grad_x.movedim(0, SEQ_DIM), grad_weight, grad_bias, None


def sequence_gathered_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], comm: Optional[Comm]) -> Tensor:
    """A column-parallel linear on sequence-parallel input: gathers the sequence, keeps only the shard."""
    if comm is None or comm.size == 1:
        return F.linear(x, weight, bias)
    return _SequenceGatheredLinear.apply(x, weight, bias, comm)


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

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.tp)
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sequence(y, self.tp) if self.sequence_parallel else reduce_from_region(y, self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_rank}/{self.tp_size}"


# --- RNG ----------------------------------------------------------------------------------------


def _get_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TPRandom:
    """A second random stream, different on every tp rank (Megatron's RNG tracker).

    Dropout on activations replicated over tp uses the default generator,
    seeded identically on every rank of the tp group, so the replicas stay
    identical. Dropout on tensors that are split over tp (sequence-parallel
    activations) runs inside ``fork()``, which swaps in this rank's own stream.
    Under activation checkpointing, ``checkpoint_contexts`` replays the
    stream so recomputation draws the same masks.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.state: Optional[Tensor] = None

    def seed(self, seed: int) -> None:
        outer = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.state = _get_state(self.device)
        _set_state(outer, self.device)

    @contextlib.contextmanager
    def fork(self):
        if self.state is None:
            self.seed(0)
        outer = _get_state(self.device)
        _set_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(outer, self.device)

    def checkpoint_contexts(self):
        """``context_fn`` for torch.utils.checkpoint: recomputation restarts from the forward's stream."""
        snapshot: dict[str, Tensor] = {}
        tracker = self

        @contextlib.contextmanager
        def forward():
            # the state tensor is replaced, never written in place, so holding it is a snapshot (no clone: a
            # clone under --simulate's fake tensors would hold no bytes to restore)
            snapshot["state"] = tracker.state
            yield

        @contextlib.contextmanager
        def recompute():
            after = tracker.state
            tracker.state = snapshot["state"]
            try:
                yield
            finally:
                tracker.state = after

        return forward(), recompute()


class ShardedDropout(nn.Module):
    """Dropout whose input is split over tp: masks come from the per-rank stream when split."""

    def __init__(self, p: float, rng: Optional[TPRandom], split: bool):
        super().__init__()
        self.p, self.rng, self.split = p, rng, split

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.split and self.rng is not None:
            with self.rng.fork():
                return F.dropout(x, self.p, True)
        return F.dropout(x, self.p, True)


# --- vocabulary-parallel cross entropy ----------------------------------------------------------


def mask_padded_vocab(logits_shard: Tensor, vocab_start: int, real_vocab_size: int) -> Tensor:
    """Set logits of padding ids (global id >= real_vocab_size) to -inf so they are never predicted."""
    width = logits_shard.shape[-1]
    if vocab_start + width <= real_vocab_size:
        return logits_shard
    ids = torch.arange(vocab_start, vocab_start + width, device=logits_shard.device)
    return logits_shard.masked_fill(ids >= real_vocab_size, -math.inf)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split along the vocabulary (Megatron-LM, §3).

    Ranks exchange per-token statistics, never logits: one all-reduce (max) of
    the row maxima, then one all-reduce of [target logit, sum of exponentials]
    fused into a single tensor. Backward is local: softmax minus one-hot on the
    owning shard. Computed in float32 whatever the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, real_vocab_size: int,
                tp: Optional[Comm], ignore_index: int) -> Tensor:
        x = mask_padded_vocab(logits.float(), vocab_start, real_vocab_size)
        width = x.shape[-1]
        row_max = x.max(dim=-1).values
        if tp is not None:
            tp.all_reduce(row_max, op=dist.ReduceOp.MAX, tag="loss")
        x = x - row_max.unsqueeze(-1)

        ignored = targets == ignore_index
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < width) & ~ignored
        local_t = local_t.masked_fill(~here, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        exp = x.exp_()
        stats = torch.stack([target_logit, exp.sum(dim=-1)])
        if tp is not None:
            tp.all_reduce(stats, tag="loss")
        target_logit, sum_exp = stats[0], stats[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, here, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_t, here, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -here.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, targets: Tensor, vocab_start: int, real_vocab_size: int,
                                 tp: Optional[Comm] = None, ignore_index: int = -100) -> Tensor:
    """Per-token loss (float32, shape of ``targets``, 0 where ``targets == ignore_index``).

    ``logits_shard`` (..., V/tp) holds global vocabulary ids
    [vocab_start, vocab_start + V/tp); ids >= real_vocab_size are padding and
    take no probability mass.
    """
    assert logits_shard.shape[:-1] == targets.shape, (logits_shard.shape, targets.shape)
    if tp is not None and tp.size == 1:
        tp = None
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, vocab_start, real_vocab_size, tp, ignore_index)
