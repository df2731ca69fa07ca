"""Ulysses context parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses", §3): an all-to-all trades the split
of the sequence for a split of the heads around attention, and a second one trades it back.

Each cp rank holds its head-tail chunks of the sequence (``parallel.context``) for all of its tp rank's
heads; after the all-to-all it holds the whole sequence, in order, for heads/cp of them, and runs ordinary
causal attention, so any attention kernel plugs in unchanged. Each all-to-all moves (cp−1)/cp of q, k, v
(and of the output) per rank. The heads must split evenly over cp; grouped-query k/v with fewer heads than
that are repeated up to the least multiple of their count that cp divides (it still divides the query heads),
as DeepSpeed and Megatron-core do.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from megazero.kernels.attend import attention
from megazero.parallel.comm import Comm


def _exchange(blocks: Tensor, comm: Comm) -> Tensor:
    """blocks (cp, ...): block r to rank r, block r of the result from rank r."""
    size = blocks.shape[0]
    flat = blocks.reshape(size, -1)
    out = comm.all_to_all(flat, [1] * size, [1] * size, tag="context_a2a")
    return out.view_as(blocks)


def sequence_to_heads(x: Tensor, comm: Comm) -> Tensor:
    """(b, H, 2c, d) this rank's chunks of every head -> (b, H/cp, 2c·cp, d) the whole sequence in order of
    this rank's share of the heads."""
    cp = comm.size
    b, heads, local, d = x.shape
    c = local // 2
    blocks = x.reshape(b, cp, heads // cp, 2, c, d).transpose(0, 1)  # (cp: head group, b, h, 2, c, d)
    got = _exchange(blocks.contiguous(), comm)  # (cp: source rank, b, h, 2, c, d)
    # source rank r held chunks r and 2cp-1-r: the heads in rank order, the tails in reverse
    chunks = torch.cat([got[:, :, :, 0], got[:, :, :, 1].flip(0)], dim=0)  # (2cp, b, h, c, d) in order
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, 2 * cp * c, d)


def heads_to_sequence(y: Tensor, comm: Comm) -> Tensor:
    """The inverse of ``sequence_to_heads``: (b, H/cp, s, d) -> (b, H, 2c, d)."""
    cp = comm.size
    b, h, s, d = y.shape
    c = s // (2 * cp)
    chunks = y.reshape(b, h, 2 * cp, c, d).permute(2, 0, 1, 3, 4)  # (2cp, b, h, c, d)
    blocks = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=3)  # (cp: destination rank, b, h, 2, c, d)
    got = _exchange(blocks.contiguous(), comm)  # (cp: head group, b, h, 2, c, d)
    return got.permute(1, 0, 2, 3, 4, 5).reshape(b, cp * h, 2 * c, d)


class _SequenceToHeads(torch.autograd.Function):
    """A permutation through an all-to-all: its adjoint is its inverse."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return sequence_to_heads(x, comm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return heads_to_sequence(grad, ctx.comm), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return heads_to_sequence(y, comm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return sequence_to_heads(grad, ctx.comm), None


def kv_heads_for(kv_heads: int, cp: int) -> int:
    """How many k/v heads travel: the least multiple of ``kv_heads`` that cp divides."""
    return kv_heads * cp // math.gcd(kv_heads, cp)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, comm: Comm, impl: str = "torch",
                      documents: Optional[Tensor] = None) -> Tensor:
    """Causal attention over a sequence split head-tail over ``comm`` (cp): q (b, heads, s/cp, d), k and v
    (b, kv_heads, s/cp, d); heads divisible by cp. Returns (b, heads, s/cp, d) in this rank's chunk order.
    ``documents`` (b, s): the whole sample's document ids in sequence order (what the attention sees)."""
    cp, heads, kv = comm.size, q.shape[1], k.shape[1]
    assert cp > 1 and heads % cp == 0, (cp, heads)
    wide = kv_heads_for(kv, cp)
    if wide != kv:  # each k/v head repeated in place: q head i still reads head i // (heads / kv)
        k, v = k.repeat_interleave(wide // kv, dim=1), v.repeat_interleave(wide // kv, dim=1)
    q, k, v = (_SequenceToHeads.apply(t, comm) for t in (q, k, v))
    y = attention(q, k, v, causal=True, impl=impl, **({} if documents is None else {"documents": documents}))
    return _HeadsToSequence.apply(y, comm)
