"""Document-masked causal attention with no (seq, seq) tensor, for the CPU: ``kernels.attention`` "blocks".

A packed sample's tokens attend only within their own document. The dense path builds a (batch, 1, s, s) mask
(a float one inside torch's attention: 256 MiB a sample at s = 8192, 64 GiB at 131072). Here the queries go in
blocks of ``BLOCK`` rows; since documents are contiguous and attention is causal, a block's visible keys are one
range, from the start of the first document it touches to its own last row (its *span*). Each block runs torch's
fused CPU attention (FlashAttention's tiling, Dao et al. 2022 §3.1) over its span with a (block × span) additive
mask, and the backward recomputes each mask, so what the pass keeps is q, k, v, the output and its log-sum-exp.
A block's temporaries: its float mask and three boolean ones over block × span pairs, and its span of k/v copied
and widened to the query heads (span: the block plus the longest document behind it, at most s).
"""
from __future__ import annotations

import torch
from torch import Tensor

# query rows a block: its mask is BLOCK x span floats. Forward + backward at seq 8192, 4 heads of 64, documents of
# 100-2,000 tokens, one thread (medians of 3): 0.36 s at 128, 0.41 at 256, 0.49 at 512, 0.80 at 1024 (a larger
# block computes more masked pairs); the dense mask's SDPA: 3.7 s
BLOCK = 256

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def spans(host_documents: Tensor, block: int = BLOCK) -> list[tuple[int, int, int]]:
    """(first row, end row, first key) of each query block: its keys are [first key, end row). ``host_documents``
    (batch, s): each token's document id, non-decreasing along s; the first key is the earliest start, over the
    batch, of the document holding the block's first row."""
    s = host_documents.shape[1]
    starts = torch.arange(0, s, block)
    first_docs = host_documents[:, starts].contiguous()
    keys = torch.searchsorted(host_documents.contiguous(), first_docs).amin(0)  # each row's document start
    return [(int(i), min(s, int(i) + block), int(j)) for i, j in zip(starts, keys)]


def visible_bias(q_doc: Tensor, k_doc: Tensor, causal_offset: int | None, dtype: torch.dtype) -> Tensor:
    """(b, 1, sq, sk) additive mask, 0 where query i sees key j (the same document and, with a causal offset o,
    j <= i + o), −inf elsewhere: the fused CPU op takes a mask of the query's dtype only."""
    keep = q_doc[:, None, :, None] == k_doc[:, None, None, :]
    if causal_offset is not None:
        keep = keep & torch.ones(q_doc.shape[1], k_doc.shape[1], dtype=torch.bool).tril(causal_offset)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))


def expand_heads(k: Tensor, group: int) -> Tensor:
    """Grouped-query k/v to the query heads, for the ops that take equal heads (a local copy only)."""
    return k if group == 1 else k.repeat_interleave(group, dim=1)


def fold_heads(dk: Tensor, group: int) -> Tensor:
    """The inverse of ``expand_heads`` for a gradient: each k/v head sums its group's query heads."""
    if group == 1:
        return dk
    b, h, s, d = dk.shape
    return dk.view(b, h // group, group, s, d).sum(2)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(out, log-sum-exp in fp32 or wider) of one block under an additive mask; k/v may be grouped-query. A row
    that sees no key comes out 0 with log-sum-exp −inf (the op itself reports 0)."""
    group = q.shape[1] // k.shape[1]
    out, lse = _forward(q.contiguous(), expand_heads(k, group).contiguous(), expand_heads(v, group).contiguous(),
                        0.0, False, attn_mask=bias)
    blind = torch.isinf(bias).all(-1)  # (b, 1, sq)
    return out, lse.masked_fill(blind, float("-inf")) if bool(blind.any()) else lse


def masked_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One block's (dq, dk, dv) from the rows' final out and log-sum-exp (FlashAttention-2's backward, Dao 2023
    §3.1.2), k/v gradients folded back to their grouped heads."""
    group = q.shape[1] // k.shape[1]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).contiguous()  # blind rows: p = 0 anyway
    dq, dk, dv = _backward(dout.contiguous(), q.contiguous(), expand_heads(k, group).contiguous(),
                           expand_heads(v, group).contiguous(), out.contiguous(), safe, 0.0, False, attn_mask=bias)
    return dq, fold_heads(dk, group), fold_heads(dv, group)


def masked_rows(q: Tensor, k: Tensor, v: Tensor, q_doc: Tensor, k_doc: Tensor, causal: bool,
                block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``masked_attention`` of one block of a split attention (a cp ring's), ``block`` query rows at a time, so
    that its mask is never larger than block x keys. ``causal``: q and k are the same positions."""
    outs, lses = [], []
    for r0 in range(0, q.shape[2], block):
        r1 = min(q.shape[2], r0 + block)
        bias = visible_bias(q_doc[:, r0:r1], k_doc, r0 if causal else None, q.dtype)
        out, lse = masked_attention(q[:, :, r0:r1], k, v, bias)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def masked_rows_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_doc: Tensor,
                         k_doc: Tensor, causal: bool, block: int = BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``masked_rows``: dq row block by row block, dk and dv summed over them in fp32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dqs, dk, dv = [], torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for r0 in range(0, q.shape[2], block):
        r1 = min(q.shape[2], r0 + block)
        bias = visible_bias(q_doc[:, r0:r1], k_doc, r0 if causal else None, q.dtype)
        gq, gk, gv = masked_attention_backward(dout[:, :, r0:r1], q[:, :, r0:r1], k, v, out[:, :, r0:r1],
                                               lse[:, :, r0:r1], bias)
        dqs.append(gq)
        dk += gk
        dv += gv
    return torch.cat(dqs, 2), dk.to(k.dtype), dv.to(v.dtype)


class DocumentAttention(torch.autograd.Function):
    """Causal document-masked attention over query blocks and their key spans (module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, documents: Tensor, block: int) -> Tensor:
        plan = spans(documents, block)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))  # the op's
        for i0, i1, j0 in plan:
            bias = visible_bias(documents[:, i0:i1], documents[:, j0:i1], i0 - j0, q.dtype)
            out[:, :, i0:i1], lse[:, :, i0:i1] = masked_attention(q[:, :, i0:i1], k[:, :, j0:i1], v[:, :, j0:i1],
                                                                  bias)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, documents = ctx.saved_tensors
        acc = torch.promote_types(q.dtype, torch.float32)  # spans overlap on keys: their k/v gradients add in fp32
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for i0, i1, j0 in ctx.plan:
            bias = visible_bias(documents[:, i0:i1], documents[:, j0:i1], i0 - j0, q.dtype)
            gq, gk, gv = masked_attention_backward(dout[:, :, i0:i1], q[:, :, i0:i1], k[:, :, j0:i1],
                                                   v[:, :, j0:i1], out[:, :, i0:i1], lse[:, :, i0:i1], bias)
            dq[:, :, i0:i1] = gq
            dk[:, :, j0:i1] += gk
            dv[:, :, j0:i1] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Tensor, block: int = BLOCK) -> Tensor:
    """Causal attention within documents, on the CPU: q (b, heads, s, d), k/v (b, kv_heads, s, d), documents
    (b, s) non-decreasing ids."""
    assert q.device.type == "cpu" and documents.device.type == "cpu", "the blocks path runs torch's CPU op"
    return DocumentAttention.apply(q, k, v, documents, block)
