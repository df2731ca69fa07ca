"""One block of a split attention: (out, log-sum-exp) forward, (dq, dk, dv) backward, and the merge of blocks.

Ring attention (``parallel.context``) computes a rank's queries against one source's K/V at a time and merges
the partial results by their log-sum-exp, as FlashAttention does across key tiles (Dao et al. 2022 §3.1). A
block may carry document ids (``data.document_mask``): query i sees key j only within its own document. A
query row that sees no key of the block gets out 0 and lse −inf, which the merge treats as absent.

``impl`` "torch" is torch's CPU flash-attention op (it returns the log-sum-exp and takes it back in its
backward); with documents, the explicit masked softmax below (one block's scores at a time). "triton" is
``kernels.flash_attention``, whose forward and backward take the documents and skip fully masked tiles; on
CUDA the blocks always run it (torch's CUDA attention ops that return the log-sum-exp are not plugged in).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from megazero.kernels.flash_attention import flash_backward, flash_forward


def _expand(k: Tensor, group: int) -> Tensor:
    """Grouped-query k/v to the query heads, for the block ops that take equal heads (a local copy only)."""
    return k if group == 1 else k.repeat_interleave(group, dim=1)


def _fold(dk: Tensor, group: int) -> Tensor:
    """The inverse of ``_expand`` for a gradient: each k/v head sums its group's query heads."""
    if group == 1:
        return dk
    b, h, s, d = dk.shape
    return dk.view(b, h // group, group, s, d).sum(2)


def _visible(q_doc: Tensor, k_doc: Tensor, causal: bool) -> Tensor:
    """(b, 1, sq, sk): which keys each query sees (the same document; earlier or itself when causal)."""
    mask = q_doc[:, None, :, None] == k_doc[:, None, None, :]
    if causal:
        mask = mask & torch.ones(q_doc.shape[1], k_doc.shape[1], dtype=torch.bool, device=q_doc.device).tril()
    return mask


def _masked_scores(q: Tensor, k: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Scaled scores with hidden keys at −inf, and each row's log-sum-exp (−inf where nothing is visible)."""
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores, torch.logsumexp(scores, dim=-1)


def _probabilities(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores − lse), 0 where the row sees nothing (lse −inf) or the key is hidden."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe.unsqueeze(-1))


def block_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, impl: str, q_doc: Optional[Tensor] = None,
                    k_doc: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(softmax(q kᵀ/√d) v, its log-sum-exp per query row) for one block; k/v may be grouped-query.
    ``q_doc``/``k_doc`` (b, sq)/(b, sk): the tokens' documents (None: no document mask)."""
    if impl == "triton" or q.device.type == "cuda":  # on CUDA the Triton kernel is the op that returns the lse
        docs = {} if q_doc is None else {"q_doc": q_doc, "k_doc": k_doc}
        return flash_forward(q, k, v, causal, **docs)[:2]
    assert impl == "torch" and q.device.type == "cpu", f"ring attention blocks: impl {impl!r} on {q.device}"
    group = q.shape[1] // k.shape[1]
    if q_doc is not None:
        acc = accumulator_dtype(q.dtype)
        scores, lse = _masked_scores(q.to(acc), _expand(k, group).to(acc), _visible(q_doc, k_doc, causal))
        return (_probabilities(scores, lse) @ _expand(v, group).to(acc)).to(q.dtype), lse
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand(k, group), _expand(v, group), 0.0, causal)[:2]
    return out, lse


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             causal: bool, impl: str, q_doc: Optional[Tensor] = None,
                             k_doc: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """One block's (dq, dk, dv) given the *merged* out and lse of q's rows, so contributions add up
    (FlashAttention-2's backward, Dao 2023 §3.1.2: dS = P ∘ (dP − rowsum(dO ∘ O)))."""
    if impl == "triton" or q.device.type == "cuda":
        docs = {} if q_doc is None else {"q_doc": q_doc, "k_doc": k_doc}
        return flash_backward(q, k, v, out, lse.float(), dout, causal, **docs)[:3]
    group = q.shape[1] // k.shape[1]
    if q_doc is not None:
        acc = accumulator_dtype(q.dtype)
        q32, k32, v32 = q.to(acc), _expand(k, group).to(acc), _expand(v, group).to(acc)
        do32 = dout.to(acc)
        scores, _ = _masked_scores(q32, k32, _visible(q_doc, k_doc, causal))
        p = _probabilities(scores, lse.to(acc))
        dv = p.transpose(-1, -2) @ do32
        dp = do32 @ v32.transpose(-1, -2)
        ds = p * (dp - (do32 * out.to(acc)).sum(-1, keepdim=True)) * (1.0 / math.sqrt(q.shape[-1]))
        dq, dk = ds @ k32, ds.transpose(-1, -2) @ q32
        return dq.to(q.dtype), _fold(dk, group).to(k.dtype), _fold(dv, group).to(v.dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _expand(k, group), _expand(v, group), out, lse, 0.0, causal)
    return dq, _fold(dk, group), _fold(dv, group)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs, log-sum-exps and gradients add up in fp32 (fp64 for fp64 inputs)."""
    return torch.promote_types(dtype, torch.float32)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions over disjoint keys, as one (in the accumulators' dtype). ``lse`` is finite (the
    first block is a rank's own causal chunks: every token sees itself); a block row at −inf adds nothing."""
    block_out, block_lse = block_out.to(out.dtype), block_lse.to(lse.dtype)
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1), new
