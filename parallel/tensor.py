"""Tensor-parallel layers: the Megatron-LM vocabulary (Shoeybi et al. 2019, arXiv:1909.08053).

A transformer block needs only two collectives per sub-layer when its first
linear is split by output columns and its second by input rows: the input of
the column-parallel layer is copied to every rank (``f``: identity forward,
all-reduce backward) and the output of the row-parallel layer is summed over
ranks (``g``: all-reduce forward, identity backward). The embedding and the
tied output head split the vocabulary, and the cross entropy is computed on the
vocabulary shards without ever gathering full-vocabulary logits.

Every parameter carries ``tp_split_dim`` (the dimension split over the tensor
parallel group, or None when replicated) and every layer knows ``tp_rank`` and
``tp_size``: initialisation and checkpoints build or read the full tensor and
keep this rank's slice, so a model is the same at any tensor-parallel size.

``tp_group=None`` means a tensor-parallel size of 1: the layers are then plain
``nn.Linear``/``nn.Embedding`` arithmetic and never touch torch.distributed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) inside the tensor-parallel group; (0, 1) without one."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _divide(total: int, parts: int, what: str) -> int:
    assert total % parts == 0, f"{what}={total} is not divisible by tensor-parallel size {parts}"
    return total // parts


# --- Megatron f/g autograd collectives --------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    """``f``: the input is used by every rank, so its gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """``g``: partial sums from every rank are added; each rank's gradient is the full one."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """Concatenate last-dim shards from every rank; backward keeps this rank's shard."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's last-dim shard; backward gathers the shards again."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None


def copy_to_tp_region(x: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    return x if tp_group is None else _CopyToRegion.apply(x, tp_group)


def reduce_from_tp_region(x: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    return x if tp_group is None else _ReduceFromRegion.apply(x, tp_group)


def gather_from_tp_region(x: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    return x if tp_group is None else _GatherFromRegion.apply(x, tp_group)


def scatter_to_tp_region(x: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    return x if tp_group is None else _ScatterToRegion.apply(x, tp_group)


# --- layers -------------------------------------------------------------------------------------


def _param(shape: tuple[int, ...], tp_split_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape))
    p.tp_split_dim = tp_split_dim
    return p


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows (the vocabulary) split over the tensor-parallel group.

    Rank r holds ids [vocab_start, vocab_end); ids outside give zero vectors and
    the all-reduce fills them in from the rank that owns them.
    """

    def __init__(self, num_embeddings: int, dim: int, tp_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
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
        return reduce_from_tp_region(out, self.tp_group)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split over ranks (weight shape (out/tp, in)).

    The output stays split unless ``gather_output``; a following
    RowParallelLinear consumes it split.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = _param((per_rank, in_features), tp_split_dim=0)
        self.bias = _param((per_rank,), tp_split_dim=0) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(copy_to_tp_region(x, self.tp_group), self.weight, self.bias)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_rank}/{self.tp_size}"


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over ranks (weight shape (out, in/tp)).

    Each rank computes a partial product on its input shard; the sum over ranks
    is the output. The bias is replicated and added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = _param((out_features, per_rank), tp_split_dim=1)
        self.bias = _param((out_features,), tp_split_dim=None) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp_rank}/{self.tp_size}"


# --- vocabulary-parallel cross entropy ----------------------------------------------------------


def mask_padded_vocab(logits_shard: Tensor, vocab_start: int, real_vocab_size: int) -> Tensor:
    """Set logits of padding ids (global id >= real_vocab_size) to -inf so they are never predicted."""
    width = logits_shard.shape[-1]
    if vocab_start + width <= real_vocab_size:
        return logits_shard
    ids = torch.arange(vocab_start, vocab_start + width, device=logits_shard.device)
    return logits_shard.masked_fill(ids >= real_vocab_size, -math.inf)


def _all_reduce(x: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split along the vocabulary (Megatron-LM, section 3).

    Ranks exchange three (batch, seq) tensors — the max, the sum of
    exponentials and the target logit — instead of full-vocabulary logits.
    Computed in float32 whatever the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, real_vocab_size: int,
                group: dist.ProcessGroup | None, ignore_index: int) -> Tensor:
        x = mask_padded_vocab(logits.float(), vocab_start, real_vocab_size)
        width = x.shape[-1]
        local_max = x.max(dim=-1).values
        x = x - _all_reduce(local_max, dist.ReduceOp.MAX, group).unsqueeze(-1)

        ignored = targets == ignore_index
        local_t = targets - vocab_start
        here = (local_t >= 0) & (local_t < width) & ~ignored
        local_t = local_t.masked_fill(~here, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)

        exp = x.exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, here, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_t, here, ignored = ctx.saved_tensors
        grad = softmax.clone()
        onehot = F.one_hot(local_t, grad.shape[-1]).to(grad.dtype) * here.unsqueeze(-1)
        grad.sub_(onehot).mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    vocab_start: int,
    real_vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """Per-token loss (float32, shape of ``targets``, 0 where ``targets == ignore_index``).

    ``logits_shard`` (..., V/tp) holds global vocabulary ids
    [vocab_start, vocab_start + V/tp); ids >= real_vocab_size are padding and
    take no probability mass.
    """
    assert logits_shard.shape[:-1] == targets.shape, (logits_shard.shape, targets.shape)
    return _VocabParallelCrossEntropy.apply(
        logits_shard, targets, vocab_start, real_vocab_size, tp_group, ignore_index
    )
