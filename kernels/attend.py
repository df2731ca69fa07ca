"""Attention for the model: torch SDPA or the Triton FlashAttention-2 kernel behind one function.

``impl="torch"`` is torch's scaled_dot_product_attention; ``impl="triton"`` is
``kernels.flash_attention`` (Dao 2023). ``kernels.attention: auto | triton |
torch`` in the config chooses, through :func:`resolve_impl`. The function is
importable as ``kernels.attention``. Grouped-query attention (Ainslie et al.
2023): k and v may have fewer heads than q, a divisor of them; q head i reads
k/v head i // (q heads / kv heads), with no repeated copy of k or v. Document masks (packed samples):
``documents`` gives each token's document id, and a token attends only to its own document; ``impl="blocks"``
(what ``auto`` resolves to on the CPU under a document mask) runs it without a (seq, seq) tensor
(``kernels.document_attention``) once the sequence is longer than one of its blocks: up to that, SDPA with the
dense mask is the same one block and faster (forward + backward, 2 x 6 heads of 64, one thread: 10.5 ms
against 16.6 at seq 256; the blocks win from ~400 tokens, 0.42x at 1024, 0.24x at 2048).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megazero.kernels.document_attention import BLOCK, document_attention
from megazero.kernels.flash_attention import FlashAttention
from megazero.kernels.flash_blocks import DTYPES, MAX_HEAD_DIM, _interpreting, supports_head_dim, triton
from megazero.kernels.errors import UserError


def document_mask(documents: Tensor, causal: bool) -> Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend key j: same document (and j <= i when causal).

    Boolean rather than an additive float mask (0 / -inf): on this 2-core CPU, SDPA forward+backward with the
    mask built in the call measured ~137 ms (bool) vs ~160 ms (float) at (batch 2, 4 heads, seq 512, d 64), and
    within noise of each other at (1, 8, 1024, 64) (medians 151 vs 139 ms, minima 117 vs 121 ms, 8 runs each);
    bool also holds the mask in a quarter of the memory."""
    s = documents.shape[-1]
    keep = documents[:, :, None] == documents[:, None, :]
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    return keep[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, impl: str = "torch",
              dq_mode: str = "separate", documents: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v on (batch, heads, seq, head_dim) tensors.

    k and v: (batch, kv_heads, seq, head_dim) with kv_heads dividing q's heads (grouped-query attention).

    impl: "torch" (scaled_dot_product_attention), "triton" (FlashAttention-2 above) or "blocks" (the CPU: torch's
    fused attention over query blocks, the same as "torch" without documents);
    :func:`resolve_impl` turns a config value ("auto" | "torch" | "triton") into one.
    dq_mode (triton): how the backward gets dQ, "separate" (deterministic) or "atomic"
    (see ``kernels.flash_backward``).
    documents: (batch, seq) integer document ids of a packed sample, non-decreasing along seq (self-attention:
    q and k are the same tokens); a token attends only to tokens of its own document. None: one document.
    "torch" builds a (batch, 1, seq, seq) boolean mask (:func:`document_mask`); "triton" skips the tiles of
    no shared document (``kernels.flash_attention.flash_forward``); "blocks" keeps no tensor of (seq, seq).
    """
    if documents is not None and tuple(documents.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"documents must be (batch, seq) = {(q.shape[0], q.shape[2])}, got "
                         f"{tuple(documents.shape)}")
    if impl == "blocks" and documents is not None and q.shape[2] > BLOCK:  # one block: SDPA's dense mask, faster
        assert causal, "document spans are causal"
        if torch.is_autocast_enabled(q.device.type):  # as SDPA would compute under autocast
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return document_attention(q, k, v, documents.to(q.device))
    if impl in ("torch", "blocks"):
        gqa = k.shape[1] != q.shape[1]
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents.to(q.device), causal),
                                              enable_gqa=gqa)
    if impl != "triton":
        raise ValueError(f"attention impl must be 'torch', 'triton' or 'blocks', got {impl!r}")
    gqa_shapes = (q.dim() == k.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0]
                  and k.shape[2:] == q.shape[2:] and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0)
    if not gqa_shapes or not supports_head_dim(q.shape[-1]):
        raise ValueError(f"triton attention needs q (batch, heads, seq, head_dim) and k, v (batch, kv_heads, seq, "
                         f"head_dim), kv_heads dividing heads, head_dim <= {MAX_HEAD_DIM}; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in DTYPES or not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(f"triton attention needs q, k, v of one fp16/bf16/fp32 dtype on one device, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype} on {q.device}, {k.device}, {v.device}")
    if triton is None or (q.device.type != "cuda" and not _interpreting()):
        raise ValueError(f"triton attention needs triton and CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
    if documents is None:
        return FlashAttention.apply(q, k, v, causal, dq_mode)
    return FlashAttention.apply(q, k, v, causal, dq_mode, documents, documents)


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA GPU, or TRITON_INTERPRET=1 (CPU interpreter)."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


def resolve_impl(requested: str, device_type: str, head_dim: int | None = None, documents: bool = False) -> str:
    """The attention impl for a run. "auto" -> "torch" (scaled_dot_product_attention), but under a document mask
    (``documents``) a path with no (seq, seq) mask: "blocks" on the CPU, "triton" on a GPU (it skips the tiles of
    no shared document), "torch" with its dense mask only where Triton cannot run the head dim.

    On an H200 (torch 2.11, docs/benchmarks.md) SDPA picks its cuDNN backend, which ran 1.2-1.6x this
    kernel's forward+backward TFLOP/s at every measured size, and a GPT-2-small step 6-8% faster; the
    Triton kernel is there to be chosen ("triton"), not the default. "auto" never picks the interpreter
    either: it is for tests, orders of magnitude slower than SDPA.
    """
    has_head_dim = head_dim is None or supports_head_dim(head_dim)
    if requested == "auto" and documents:
        if device_type == "cpu":
            return "blocks"
        # triton comes with torch's CUDA builds: a plan made on a host without it plans what the GPU runs
        return "triton" if device_type == "cuda" and has_head_dim else "torch"
    if requested in ("torch", "auto"):
        return "torch"
    if requested == "blocks":
        if device_type == "cpu":
            return "blocks"
        raise UserError(f"kernels.attention='blocks' runs torch's CPU attention op, this run is on {device_type}; "
                        "valid here: auto | torch | triton")
    if requested == "triton":
        if not has_head_dim:
            raise UserError(f"kernels.attention='triton' supports head dims up to {MAX_HEAD_DIM} "
                                    f"(model.hidden / model.heads), this model's is {head_dim}; valid here: "
                                    "auto | torch")
        if triton_available() and (device_type == "cuda" or _interpreting()):
            return "triton"
        raise UserError("kernels.attention='triton' needs a CUDA GPU with triton installed (or "
                                "TRITON_INTERPRET=1 to run the kernels on the CPU interpreter); valid here: "
                                "auto | torch")
    raise UserError(f"kernels.attention={requested!r} is not an attention implementation; valid: "
                            "auto | torch | triton | blocks")
