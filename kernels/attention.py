"""Attention entry point for the model.

One function so the model never chooses a backend: today it is torch's
scaled_dot_product_attention (which picks FlashAttention, Dao et al. 2022, or
memory-efficient kernels where available); a Triton flash-attention kernel
can be put behind the same signature.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v on (batch, heads, seq, head_dim) tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
