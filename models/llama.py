"""Llama's parts (Touvron et al. 2023): RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP.

Built from the same tensor-parallel layers as GPT-2's parts (``models.gpt2``) and assembled by the same
``models.block.Block`` when ``model.arch`` is llama (the stage, embeddings and head are shared). Parameter
names follow the logical tensors, one per Hugging Face tensor (``attn.q``, ``attn.k``, ``attn.v``,
``mlp.gate``, ``mlp.up``, ``mlp.down``), so checkpoints stay layout-free and conversion is a renaming; the
q, k, v projections (and gate, up) still share one input copy or sequence gather (``column_parallel_linears``).

Grouped-query attention (Ainslie et al. 2023): ``kv_heads`` k/v heads, each read by heads/kv_heads query
heads. With kv_heads >= tp every rank holds kv_heads/tp whole k/v heads beside the query heads that read
them; with fewer, each k/v head is replicated on tp/kv_heads consecutive ranks and its gradient summed over
them (``ColumnParallelLinear(replicas=...)``).

``model.qk_norm`` (Qwen3, Yang et al. 2025): an RMSNorm over each head's features of q and of k (``attn.q_norm``,
``attn.k_norm``, one weight of head_dim shared by every head) before the rotation. Each tp rank normalises its
own heads, so the weights' gradients are partial over tp and summed over it, as a sequence-parallel norm's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megazero.kernels.norm import rms_norm_triton
from megazero.models.arch import ffn_hidden, has_bias, head_dim
from megazero.models.split import Split
from megazero.parallel.sequence import SequenceInfo
from megazero.parallel.tp_overlap import Entry
from megazero.parallel.tp_random import ShardedDropout
from megazero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linears,
    mark_sequence_parallel,
)

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig


class _RMSNormFunction(torch.autograd.Function):
    """y = x / sqrt(mean(x²) + eps) * weight in float32, keeping for backward only the input in its own dtype and
    the per-token 1/rms: autograd through the float32 formula would keep a float32 copy of every norm's input
    (twice a bf16 run's bytes). Backward: dx = r (g - x̂ mean(g x̂)) with g = dy * weight, x̂ = x r."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for a float64 input
        xf = x.to(compute)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return xf * rstd * weight.to(compute)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        grad = grad.to(rstd.dtype)
        grad_weight = (grad * xhat).reshape(-1, x.shape[-1]).sum(0)
        g = grad * weight.to(rstd.dtype)
        grad_x = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight (Zhang & Sennrich 2019), computed in float32.

    Returns autocast's dtype under autocast (as ``models.gpt2.LayerNorm``, for the collectives that follow),
    else the input's."""

    def __init__(self, dim: int, eps: float, impl: str = "torch"):
        super().__init__()
        self.eps, self.impl = eps, impl  # kernels.norm: the torch ops below, or one Triton kernel each way
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.impl == "triton":
            y = rms_norm_triton(x, self.weight, self.eps)
        else:
            y = _RMSNormFunction.apply(x, self.weight, self.eps)
        device = x.device.type
        return y.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype)


def rms_norm(cfg: ModelConfig, par: Split) -> RMSNorm:
    norm = RMSNorm(cfg.hidden, cfg.norm_eps, par.norm_impl)
    if par.sp:
        mark_sequence_parallel(norm)
    return norm


def rotary_tables(seq: int, head_dim: int, theta: float, device: torch.device,
                  scaling: tuple[float, float, float, int] | None = None,
                  positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """cos and sin (seq, head_dim) of RoFormer's rotation (Su et al. 2021), for positions 0..seq-1, or
    (..., head_dim) for the given ``positions`` (a context-parallel rank's chunks, positions per document).

    The frequencies theta^(-2i/d) are computed in float32 exactly as Hugging Face's Llama does, and the
    halves layout (``rotate_half``) is theirs, so imported weights need no permutation. ``scaling`` =
    (factor, low_freq_factor, high_freq_factor, original positions) is Llama 3.1's long-context rescaling
    (Grattafiori et al. 2024, §3.2.2 and its reference code): a frequency whose wavelength is longer than
    original/low_freq_factor is divided by factor, one shorter than original/high_freq_factor is kept, and
    the band between is interpolated linearly in original/wavelength."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is not None:
        factor, low, high, original = scaling
        ratio = original * inv_freq / (2 * math.pi)  # original context / wavelength
        blend = ((ratio - low) / (high - low)).clamp(0.0, 1.0)  # 0: long wavelengths, 1: short ones
        inv_freq = (1 - blend) * inv_freq / factor + blend * inv_freq
    at = torch.arange(seq, device=device) if positions is None else positions
    freqs = at.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rope_scaling(cfg: ModelConfig) -> tuple[float, float, float, int] | None:
    """``rotary_tables``' scaling from the config's rope keys (None without ``model.rope_scaling``)."""
    if getattr(cfg, "rope_scaling", "none") != "llama3":
        return None
    return cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_positions


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (batch, heads, seq, head_dim) by position: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions; this tp rank computes heads/tp query heads
    and the k/v heads they read."""

    def __init__(self, cfg: ModelConfig, par: Split):
        super().__init__()
        tp, kv = par.size, cfg.kv_head_count
        assert cfg.heads % tp == 0 and cfg.heads % kv == 0 and (kv % tp == 0 or tp % kv == 0), (cfg.heads, kv, tp)
        self.head_dim = head_dim(cfg)
        self.local_heads = cfg.heads // tp
        self.local_kv = max(kv // tp, 1)
        self.theta, self.scaling = cfg.rope_theta, rope_scaling(cfg)
        replicas = par.kv_replicas if kv < tp else None
        assert kv >= tp or (replicas is not None and replicas.size == tp // kv), "kv_heads < tp needs its replicas"
        d, h, sp, bias = self.head_dim, cfg.hidden, par.sp, has_bias(cfg)
        self.q = ColumnParallelLinear(h, cfg.heads * d, bias, par.tp, sequence_parallel=sp)
        self.k = ColumnParallelLinear(h, kv * d, bias, par.tp, sequence_parallel=sp, replicas=replicas)
        self.v = ColumnParallelLinear(h, kv * d, bias, par.tp, sequence_parallel=sp, replicas=replicas)
        self.proj = RowParallelLinear(cfg.heads * d, h, bias, par.tp, sequence_parallel=sp)
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=sp)
        self.impl = par.attention_impl
        self.par = par
        self.q_norm = self.k_norm = None
        if getattr(cfg, "qk_norm", False):
            self.q_norm, self.k_norm = (RMSNorm(d, cfg.norm_eps, par.norm_impl) for _ in range(2))
            if tp > 1:  # this rank's heads only: partial gradients, summed over tp
                mark_sequence_parallel(self.q_norm)
                mark_sequence_parallel(self.k_norm)

    @property
    def output(self) -> RowParallelLinear:
        return self.proj

    def forward(self, x: Tensor, entry: Optional[Entry] = None, info: Optional[SequenceInfo] = None) -> Tensor:
        """With ``entry`` (one half under ``parallel.tp_overlap``): proj's partial sums, reduced by the caller.
        ``info``: the tokens' positions (rotary) and documents (default: one sequence from position 0)."""
        q, k, v = column_parallel_linears(x, [self.q, self.k, self.v], entry)
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, self.head_dim)
        k = k.view(b, s, self.local_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, heads, s, d)
        v = v.view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        # this rank's tokens' positions: its cp chunks, or positions restarting at each document
        positions = None if info is None else info.positions
        cos, sin = rotary_tables(s, self.head_dim, self.theta, x.device, self.scaling, positions)
        if cos.dim() == 3:  # (b, s, d): positions per sample, broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        y = self.par.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, info)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj.partial(y) if entry is not None else self.dropout(self.proj(y))


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x) (Shazeer 2020): gate and up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, par: Split, width: Optional[int] = None):
        """width: the hidden width (default the model's ffn_hidden; a mixture of experts' shared experts)."""
        super().__init__()
        h, f, sp, bias = cfg.hidden, width or ffn_hidden(cfg), par.sp, has_bias(cfg)
        self.gate = ColumnParallelLinear(h, f, bias, par.tp, sequence_parallel=sp)
        self.up = ColumnParallelLinear(h, f, bias, par.tp, sequence_parallel=sp)
        self.down = RowParallelLinear(f, h, bias, par.tp, sequence_parallel=sp)
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=sp)

    @property
    def output(self) -> RowParallelLinear:
        return self.down

    def forward(self, x: Tensor, entry: Optional[Entry] = None) -> Tensor:
        """With ``entry`` (one half under ``parallel.tp_overlap``): down's partial sums, reduced by the caller."""
        gate, up = column_parallel_linears(x, [self.gate, self.up], entry)
        y = F.silu(gate) * up
        return self.down.partial(y) if entry is not None else self.dropout(self.down(y))


def kv_replicas_needed(cfg: ModelConfig, tp: int) -> int:
    """How many tp ranks hold each k/v head: tp/kv_heads when there are fewer k/v heads than ranks, else 1."""
    kv = cfg.kv_head_count if cfg.spec.grouped_query else cfg.heads
    return tp // kv if kv < tp else 1

