"""GPT-2's parts (Radford et al. 2019; Brown et al. 2020): LayerNorm, causal multi-head self-attention over one
fused qkv projection, and a tanh-GELU MLP, built from tensor-parallel layers.

The block that holds them is ``models.block.Block``; the learned position table is the stage's
(``models.stage.Embedding``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megazero.kernels.norm import layer_norm_triton
from megazero.models.arch import ffn_hidden, has_bias
from megazero.models.split import Split
from megazero.parallel.sequence import SequenceInfo
from megazero.parallel.tp_overlap import Entry
from megazero.parallel.tp_random import ShardedDropout
from megazero.parallel.tensor import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

LN_EPS = 1e-5


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output has autocast's dtype.

    CUDA autocast computes layer_norm in fp32 (as it should) but also returns fp32, and the tensor-parallel
    collectives right after a norm (sequence parallelism's all-gather, the column-parallel input's backward
    all-reduce) would then move twice the bytes of a bf16 run. Megatron's fused norm returns the input
    dtype; this returns the autocast dtype. Outside autocast it is nn.LayerNorm. ``impl`` (kernels.norm):
    torch's layer_norm, or one Triton kernel each way (kernels/norm.py).
    """

    def __init__(self, *args, impl: str = "torch", **kwargs):
        super().__init__(*args, **kwargs)
        self.impl = impl

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        if self.impl == "triton":  # float32 out: cast as torch's path comes out
            y = layer_norm_triton(x, self.weight, self.bias, self.eps)
            return y.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype)
        y = super().forward(x)
        if torch.is_autocast_enabled(device):
            y = y.to(torch.get_autocast_dtype(device))
        return y


def layer_norm(cfg: ModelConfig, par: Split) -> LayerNorm:
    norm = LayerNorm(cfg.hidden, eps=getattr(cfg, "norm_eps", LN_EPS), bias=has_bias(cfg), impl=par.norm_impl)
    if par.sp:
        mark_sequence_parallel(norm)
    return norm


class Attention(nn.Module):
    """Causal multi-head self-attention; this tp rank computes heads/tp whole heads."""

    def __init__(self, cfg: ModelConfig, par: Split):
        super().__init__()
        assert cfg.hidden % cfg.heads == 0 and cfg.heads % par.size == 0, (cfg.hidden, cfg.heads, par.size)
        self.local_heads = cfg.heads // par.size
        self.head_dim = cfg.hidden // cfg.heads
        # Output rows are grouped per head, [q_h; k_h; v_h], so a contiguous tp slice is whole heads.
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=par.sp)
        self.impl, self.par = par.attention_impl, par

    @property
    def output(self) -> RowParallelLinear:
        return self.proj

    def forward(self, x: Tensor, entry: Optional[Entry] = None, info: Optional[SequenceInfo] = None) -> Tensor:
        """With ``entry`` (one half under ``parallel.tp_overlap``): proj's partial sums, reduced by the caller.
        ``info``: the tokens' documents (``parallel.sequence``); the positions were added by the embedding."""
        qkv = self.qkv(x, entry)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (b, heads, s, d)
        y = self.par.attend(q, k, v, info)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj.partial(y) if entry is not None else self.dropout(self.proj(y))


class MLP(nn.Module):
    """fc2(gelu(fc1 x)) with the tanh approximation GPT-2 uses: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, cfg: ModelConfig, par: Split):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden, ffn_hidden(cfg), has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.fc2 = RowParallelLinear(ffn_hidden(cfg), cfg.hidden, has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=par.sp)

    @property
    def output(self) -> RowParallelLinear:
        return self.fc2

    def forward(self, x: Tensor, entry: Optional[Entry] = None) -> Tensor:
        """With ``entry`` (one half under ``parallel.tp_overlap``): fc2's partial sums, reduced by the caller."""
        y = F.gelu(self.fc1(x, entry), approximate="tanh")
        return self.fc2.partial(y) if entry is not None else self.dropout(self.fc2(y))
