"""Context parallelism: each sample's sequence split over the cp ranks, and causal attention across the split.

**Head-tail split.** The sequence is cut into 2·cp equal chunks and cp rank i holds chunks i and 2·cp−1−i.
Under a causal mask a chunk's work grows with its position, so pairing an early chunk with a late one gives
every rank the same attention work (the load balance of Megatron-core's context parallelism).

**Ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"). The K/V of each rank travel around
the cp ring, at their own (grouped-query) width; each step's transfer is posted before the step's attention
runs, so it proceeds underneath. Partial results merge by the log-sum-exp rule of FlashAttention (Dao et al.
2022 §3.1): out = Σ_b exp(lse_b − lse)·out_b with lse = log Σ_b exp(lse_b). With the head-tail split every
step after the first is half a block of unmasked work: from an earlier rank's K/V, all local queries read its
first chunk; from a later rank's, the local second chunk reads both of its chunks.

The backward recomputes each block's probabilities from the merged out and lse, which makes every block's
dQ, dK, dV a plain sum of contributions. K/V go around the ring again, each carrying the fp32 dK/dV
accumulated for it so far; after the last step one more hop brings each rank its own gradients. K and V
travel stacked in one buffer (dK and dV in another), so a hop is one send and one receive: on gloo each
message costs ~0.5 ms of latency whatever its size at these widths.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from megazero.parallel.comm import Comm
from megazero.parallel.context_blocks import accumulator_dtype, block_attention, block_attention_backward, merge


def head_tail_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that cp rank ``rank`` holds."""
    assert 0 <= rank < cp, (rank, cp)
    return rank, 2 * cp - 1 - rank


def head_tail_positions(seq: int, cp: int, rank: int) -> Tensor:
    """The positions in the whole sequence of this rank's tokens, in the order it holds them."""
    assert seq % (2 * cp) == 0, (seq, cp)
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in head_tail_chunks(cp, rank)])


def head_tail_split(x: Tensor, dim: int, cp: int, rank: int) -> Tensor:
    """This rank's two chunks of a whole sequence along ``dim``, concatenated (a copy)."""
    if cp == 1:
        return x
    assert x.shape[dim] % (2 * cp) == 0, (x.shape, dim, cp)
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = head_tail_chunks(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def head_tail_join(parts: list[Tensor], dim: int) -> Tensor:
    """The whole sequence from every rank's ``head_tail_split`` (rank order): the inverse, for tests and export."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: list[Optional[Tensor]] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = head_tail_chunks(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def ring_plan(cp: int, rank: int, sampled: bool) -> list[tuple[int, int]]:
    """(step, how many steps it stands for) of the ring's walk. Every step, once each, on real tensors. Sampled
    (``--simulate`` on fake tensors, ``Comm.sampled_rings``): one step of each kind, which hold the same shapes
    and send the same bytes: the first (its own K/V, causal), the first from an earlier rank and the first from a
    later one (``_block_plan``), and the last (nothing is sent on from it). A ring of 1,024 ranks is then 4
    steps a layer, not 1,024 (the figures equal the full walk's: tests/plan/test_simulate_context.py)."""
    if not sampled:
        return [(step, 1) for step in range(cp)]
    earlier = [s for s in range(1, cp - 1) if (rank - s) % cp < rank]  # steps 1..rank: an earlier rank's K/V
    later = [s for s in range(1, cp - 1) if (rank - s) % cp > rank]
    return sorted([(0, 1)] + [(g[0], len(g)) for g in (earlier, later) if g] + ([(cp - 1, 1)] if cp > 1 else []))


def _ring_steps(comm: Comm, kv: Tensor, sampled: bool = False):
    """Yield (step, source rank, k, v, steps it stands for) around the ring, each next transfer posted before
    the step is used. ``kv``: k and v stacked (2, b, kv_heads, s/cp, d), so that a hop is one send and one
    receive. ``sampled``: ``ring_plan``'s steps of each kind only."""
    cp, rank = comm.size, comm.rank
    cur = kv
    del kv  # the generator's frame would keep the first buffer alive beside cur and nxt
    for step, times in ring_plan(cp, rank, sampled):
        works, nxt = [], None
        if step < cp - 1:
            nxt = torch.empty_like(cur)
            works = comm.exchange([("send", cur, (rank + 1) % cp, "context_kv"),
                                   ("recv", nxt, (rank - 1) % cp, "context_kv")], times)
        yield step, (rank - step) % cp, cur[0], cur[1], times
        for w in works:
            w.wait()
        if nxt is not None:
            cur = nxt


def _block_plan(step: int, source: int, rank: int, chunk: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) this rank computes against the source rank's K/V (head-tail split), as
    blocks of equal query and key length (what the Triton kernel takes)."""
    first, second = slice(0, chunk), slice(chunk, 2 * chunk)
    if step == 0:
        return [(slice(0, 2 * chunk), slice(0, 2 * chunk), True)]  # its own chunks, in order: the plain mask
    if source < rank:  # the source's first chunk precedes both local chunks, its second follows them
        return [(first, first, False), (second, first, False)]
    return [(second, first, False), (second, second, False)]  # both precede only the local second chunk


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's head-tail queries over the whole sequence's keys (module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, comm: Comm, impl: str,
                documents: Optional[Documents]) -> Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # gloo sends contiguous tensors only
        chunk = q.shape[2] // 2
        out = lse = None
        sampled = comm.sampled_rings and documents is None  # a document mask skips blocks by their documents
        for step, source, ck, cv, _ in _ring_steps(comm, torch.stack([k, v]), sampled):
            for rows, keys, causal in _blocks(documents, step, source, comm.rank, chunk):
                block_out, block_lse = block_attention(q[:, :, rows].contiguous(), ck[:, :, keys].contiguous(),
                                                       cv[:, :, keys].contiguous(), causal, impl,
                                                       *_block_documents(documents, comm, source, rows, keys))
                if out is None:
                    acc = accumulator_dtype(q.dtype)
                    out, lse = block_out.to(acc), block_lse.to(acc)
                else:
                    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], block_out,
                                                             block_lse)
        # laid out (b, s, h, d) as torch's attention returns it: the model's (b, s, h*d) view of it is then the
        # tensor the output projection keeps, not a second copy
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.impl, ctx.documents = comm, impl, documents
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        comm = ctx.comm
        cp, rank, chunk = comm.size, comm.rank, q.shape[2] // 2
        dout = dout.contiguous()
        dtype = accumulator_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=dtype)
        acc = None  # the (dk, dv) carried with the K/V this rank holds, or in flight to it, stacked as k and v
        pending: list = []
        sampled = comm.sampled_rings and ctx.documents is None
        for step, source, ck, cv, times in _ring_steps(comm, torch.stack([k, v]), sampled):
            grads = []
            for rows, keys, causal in _blocks(ctx.documents, step, source, rank, chunk):
                grads.append((rows, keys, block_attention_backward(
                    dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(), ck[:, :, keys].contiguous(),
                    cv[:, :, keys].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), causal,
                    ctx.impl, *_block_documents(ctx.documents, comm, source, rows, keys))))
            for w in pending:  # the accumulator for these K/V, sent by the previous rank during this block
                w.wait()
            if acc is None:
                acc = torch.zeros((2, *ck.shape), dtype=dtype, device=ck.device)
            for rows, keys, (bq, bk, bv) in grads:
                dq[:, :, rows] += bq
                acc[0][:, :, keys] += bk
                acc[1][:, :, keys] += bv
            incoming = torch.empty_like(acc)
            pending = comm.exchange([("send", acc, (rank + 1) % cp, "context_grad"),
                                     ("recv", incoming, (rank - 1) % cp, "context_grad")], times)
            acc = incoming
        for w in pending:  # the last hop: each rank's own K/V gradients come home
            w.wait()
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None


def context_attention(q: Tensor, k: Tensor, v: Tensor, comm: Comm, impl: str = "torch",
                      documents: Optional[Tensor] = None, host_documents: Optional[Tensor] = None) -> Tensor:
    """Causal attention over a sequence split head-tail over ``comm`` (cp): q (batch, heads, s/cp, d), k and v
    (batch, kv_heads, s/cp, d), each rank's two chunks concatenated. ``impl``: "torch" | "triton".
    ``documents`` (batch, s): every token's document in the whole sample, on q's device, and
    ``host_documents`` the same on the host (which blocks to skip is decided there, with no device sync)."""
    assert comm.size > 1, "at cp 1 the model calls kernels.attention"
    docs = None if documents is None else Documents(documents, host_documents)
    return RingAttention.apply(q, k, v, comm, impl, docs)


class Documents(NamedTuple):
    device: Tensor  # (b, s) int: the document of every token of the whole sample
    host: Tensor  # the same on the host


def _blocks(documents: Optional[Documents], step: int, source: int, rank: int, chunk: int):
    """``_block_plan``'s blocks less those where no query shares a document with any key (skipped whole,
    forward and backward). The first block (every token sees itself) is never skipped."""
    plan = _block_plan(step, source, rank, chunk)
    if documents is None or step == 0:
        return plan
    cp = documents.host.shape[1] // (2 * chunk)
    mine, theirs = head_tail_split(documents.host, 1, cp, rank), head_tail_split(documents.host, 1, cp, source)
    kept = []
    for rows, keys, causal in plan:
        q_doc, k_doc = mine[:, rows], theirs[:, keys]
        # ids rise along the sequence: the ranges overlap iff neither ends before the other begins
        overlap = (k_doc[:, -1] >= q_doc[:, 0]) & (k_doc[:, 0] <= q_doc[:, -1])
        if bool(overlap.any()):
            kept.append((rows, keys, causal))
    return kept


def _block_documents(documents: Optional[Documents], comm: Comm, source: int, rows: slice,
                     keys: slice) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The block's query and key documents (None, None without a document mask)."""
    if documents is None:
        return None, None
    mine = head_tail_split(documents.device, 1, comm.size, comm.rank)
    theirs = head_tail_split(documents.device, 1, comm.size, source)
    return mine[:, rows].contiguous(), theirs[:, keys].contiguous()
