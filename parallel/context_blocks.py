"""One block of a split attention: (out, log-sum-exp) forward, (dq, dk, dv) backward, and the merge of blocks.

Ring attention (``parallel.context``) computes a rank's queries against one source's K/V at a time and merges
the partial results by their log-sum-exp, as FlashAttention does across key tiles (Dao et al. 2022 §3.1). A
block may carry document ids (``data.document_mask``): query i sees key j only within its own document. A
query row that sees no key of the block gets out 0 and lse −inf, which the merge treats as absent.

``impl`` "torch" (or "blocks") is torch's CPU flash-attention op (it returns the log-sum-exp and takes it back
in its backward); with documents, the same op under the block's additive mask, a few hundred query rows at a
time (``kernels.document_attention``: no block's scores are kept, and no mask of the whole block exists). "triton" is
``kernels.flash_attention``, whose forward and backward take the documents and skip fully masked tiles; on
CUDA the blocks always run it (torch's CUDA attention ops that return the log-sum-exp are not plugged in).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megazero.kernels.document_attention import expand_heads, fold_heads, masked_rows, masked_rows_backward
from megazero.kernels.flash_attention import flash_backward, flash_forward


def block_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, impl: str, q_doc: Optional[Tensor] = None,
                    k_doc: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(softmax(q kᵀ/√d) v, its log-sum-exp per query row) for one block; k/v may be grouped-query.
    ``q_doc``/``k_doc`` (b, sq)/(b, sk): the tokens' documents (None: no document mask)."""
    if impl == "triton" or q.device.type == "cuda":  # on CUDA the Triton kernel is the op that returns the lse
        docs = {} if q_doc is None else {"q_doc": q_doc, "k_doc": k_doc}
        return flash_forward(q, k, v, causal, **docs)[:2]
    assert impl in ("torch", "blocks") and q.device.type == "cpu", f"ring attention blocks: impl {impl!r} on {q.device}"
    group = q.shape[1] // k.shape[1]
    if q_doc is not None:
        return masked_rows(q, k, v, q_doc, k_doc, causal)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, expand_heads(k, group), expand_heads(v, group), 0.0, causal)[:2]
    return out, lse


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             causal: bool, impl: str, q_doc: Optional[Tensor] = None,
                             k_doc: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """One block's (dq, dk, dv) given the *merged* out and lse of q's rows, so contributions add up
    (FlashAttention-2's backward, Dao 2023 §3.1.2: dS = P ∘ (dP − rowsum(dO ∘ O)))."""
    if impl == "triton" or q.device.type == "cuda":
        docs = {} if q_doc is None else {"q_doc": q_doc, "k_doc": k_doc}
        return flash_backward(q, k, v, out, lse.float(), dout, causal, **docs)[:3]
    if q_doc is not None:
        return masked_rows_backward(dout, q, k, v, out, lse, q_doc, k_doc, causal)
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, expand_heads(k, group), expand_heads(v, group), out, lse, 0.0, causal)
    return dq, fold_heads(dk, group), fold_heads(dv, group)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs, log-sum-exps and gradients add up in fp32 (fp64 for fp64 inputs)."""
    return torch.promote_types(dtype, torch.float32)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions over disjoint keys, as one (in the accumulators' dtype). ``lse`` is finite (the
    first block is a rank's own causal chunks: every token sees itself); a block row at −inf adds nothing."""
    block_out, block_lse = block_out.to(out.dtype), block_lse.to(lse.dtype)
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1), new
