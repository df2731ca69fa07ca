"""Cross entropy over vocabulary-parallel logits (Megatron-LM, Shoeybi et al. 2019, §3).

The last stage's logits stay split over the tp group by vocabulary rows (``parallel.tensor``'s
VocabParallelEmbedding and column-parallel head): the loss is computed from per-token statistics exchanged
between ranks, so no rank ever holds full-vocabulary logits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megazero.parallel.comm import Comm


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
