"""The head's matmul and the vocabulary-parallel cross entropy together, a chunk of tokens at a time, so that a
microbatch's logits never exist whole (the fused linear cross entropy of Liger-Kernel, Hsu et al. 2024, §3.1,
over Megatron-LM's vocabulary-parallel loss, Shoeybi et al. 2019, §3).

Unchunked, the loss keeps the fp32 softmax of every token over this rank's vocabulary slice for the backward:
at seq 8192 and a 128k vocabulary that is 4.2 GB per sequence on one rank, more than the layers' activations.
Here the forward keeps three numbers per token (the row maximum, the sum of exponentials, the target's logit),
and the backward computes each chunk's logits again from the head's input and weight (a third head matmul) to
form its softmax, its input gradient and its share of the weight gradient. The logits that exist at any moment
are one chunk's: ``chunk`` tokens x V/tp, in the matmul's dtype and in fp32.

Across the tensor-parallel group the statistics of all chunks are exchanged at once, as the unchunked loss
exchanges them: one all-reduce (max) of the row maxima, one of [target logit, sum of exponentials] (each rank's
sums rescaled to the global maximum first). The result equals the unchunked loss to fp32 rounding.

Costs beside the third matmul: under sequence parallelism the head's input is kept gathered (b x s x h, small
next to the logits it replaces); under zb1p the loss is one node that B and W both run whole
(parallel/weight_grad.py cannot split a custom function), so its backward's matmuls run twice there.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megazero.parallel.comm import Comm


def _chunk_logits(h: Tensor, weight: Tensor, vocab_start: int, real_vocab_size: int) -> Tensor:
    """fp32 logits of one chunk of tokens (rows of ``h``) over this rank's vocabulary slice, padding ids at -inf
    (in place: the fp32 copy, or an fp32 matmul's own output, is this function's)."""
    logits = F.linear(h, weight).float()
    width = logits.shape[-1]
    if vocab_start + width > real_vocab_size:
        logits[:, max(0, real_vocab_size - vocab_start):] = -math.inf
    return logits


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, vocab_start: int, real_vocab_size: int,
                tp: Optional[Comm], ignore_index: int, chunk: int) -> Tensor:
        rows = h.reshape(-1, h.shape[-1])
        flat = targets.reshape(-1)
        n, width = flat.numel(), weight.shape[0]
        ignored = flat == ignore_index
        local_t = flat - vocab_start
        here = (local_t >= 0) & (local_t < width) & ~ignored
        local_t = local_t.masked_fill(~here, 0)
        row_max = torch.empty(n, dtype=torch.float32, device=h.device)
        shift = torch.empty(n, dtype=torch.float32, device=h.device)  # the maximum, 0 on a slice of padding only
        stats = torch.empty(2, n, dtype=torch.float32, device=h.device)  # [target logit, sum of exponentials]
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            logits = _chunk_logits(rows[lo:hi], weight, vocab_start, real_vocab_size)
            m = logits.max(dim=-1).values
            row_max[lo:hi] = m
            shift[lo:hi] = m.masked_fill(m == -math.inf, 0.0)
            stats[0, lo:hi] = logits.gather(-1, local_t[lo:hi].unsqueeze(-1)).squeeze(-1).masked_fill(~here[lo:hi], 0)
            stats[1, lo:hi] = logits.sub_(shift[lo:hi].unsqueeze(-1)).exp_().sum(dim=-1)
            del logits
        if tp is not None:
            local_max = row_max.clone()
            tp.all_reduce(row_max, op=dist.ReduceOp.MAX, tag="loss")
            # each rank's sum taken to the global maximum; a slice of padding only (local -inf) adds 0, whatever
            # the global maximum (exp(shift - max) could overflow against a sum of 0)
            stats[1].mul_((local_max - row_max).exp_())
            tp.all_reduce(stats, tag="loss")
        target_logit, sum_exp = stats[0], stats[1]
        loss = (sum_exp.log() + row_max - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(h, weight, local_t, here, ignored, row_max, sum_exp)
        ctx.vocab = (vocab_start, real_vocab_size)
        ctx.chunk = chunk
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        h, weight, local_t, here, ignored, row_max, sum_exp = ctx.saved_tensors
        rows = h.reshape(-1, h.shape[-1])
        scale = (grad_loss.reshape(-1) * ~ignored).float()
        dtype = rows.dtype  # the forward's matmul dtype (autocast's cast of the input, or the input's own)
        w = weight.to(dtype)
        grad_rows = torch.empty_like(rows)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, rows.shape[0], ctx.chunk):
            hi = min(rows.shape[0], lo + ctx.chunk)
            logits = _chunk_logits(rows[lo:hi], w, *ctx.vocab)
            grad = logits.sub_(row_max[lo:hi].unsqueeze(-1)).exp_().div_(sum_exp[lo:hi].unsqueeze(-1))  # softmax
            grad.scatter_add_(-1, local_t[lo:hi].unsqueeze(-1), -here[lo:hi].unsqueeze(-1).float())
            grad = grad.mul_(scale[lo:hi].unsqueeze(-1)).to(dtype)
            grad_rows[lo:hi] = grad.matmul(w)
            if dtype == torch.float32:  # no weight-sized temporary
                grad_w.addmm_(grad.t(), rows[lo:hi])
            else:
                grad_w.add_(grad.t().matmul(rows[lo:hi]))
            del logits, grad
        return grad_rows.view_as(h), grad_w.to(weight.dtype), None, None, None, None, None, None


def chunked_head_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, vocab_start: int, real_vocab_size: int,
                               tp: Optional[Comm], chunk: int, ignore_index: int = -100) -> Tensor:
    """Per-token loss (float32, shape of ``targets``) of the logits ``h @ weight.T`` without making them whole:
    ``h`` (..., hidden) is the head's input as every tp rank sees it (the whole sequence: copied, or gathered
    under sequence parallelism, by the caller), ``weight`` this rank's vocabulary rows [vocab_start, +V/tp),
    ``chunk`` the tokens whose logits exist at once. The value of
    ``vocab_parallel_cross_entropy(F.linear(h, weight), ...)`` to fp32 rounding."""
    assert h.shape[:-1] == targets.shape and chunk >= 1, (h.shape, targets.shape, chunk)
    if tp is not None and tp.size == 1:
        tp = None
    if torch.is_autocast_enabled(h.device.type):  # the matmul's dtype, as autocast would cast F.linear's inputs
        h = h.to(torch.get_autocast_dtype(h.device.type))
    return _ChunkedHeadCrossEntropy.apply(h, weight, targets, vocab_start, real_vocab_size, tp, ignore_index,
                                          max(1, min(chunk, targets.numel())))
