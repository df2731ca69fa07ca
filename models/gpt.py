"""GPT (Radford et al. 2019; Brown et al. 2020) as one pipeline stage built from tensor-parallel layers.

``model.arch: gpt2``: pre-LayerNorm blocks, learned positions, tanh-GELU, causal
self-attention and an output head tied to the token embedding. ``llama``: the
blocks of ``models.llama`` (RMSNorm, rotary positions, grouped-query attention,
SwiGLU), no position table, and by default an untied vocab-parallel ``head``.
A ``GPT`` holds only the layers of its pipeline stage, keyed by their *global*
index, so a parameter is called ``layers.17.mlp.fc1.weight`` on whichever stage
holds it.

Tied embeddings across stages: when the first and last stages differ, both hold
``embed.tokens.weight`` (the first for the input lookup, the last for the
head). They start equal because initial values depend only on (seed, name);
whoever runs the pipeline must sum their gradients over the two stages
(Megatron's embedding group) to keep them equal — see
``GPT.shares_embedding_across_stages``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kernels import attention
from models.arch import ffn_hidden, has_bias, is_llama, tied
from models.llama import LlamaBlock, rms_norm
from parallel.comm import Comm, copy_to_region
from parallel.tp_overlap import Entry, Sublayer, overlapped_block
from parallel.tp_random import ShardedDropout, TPRandom
from parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    mask_padded_vocab,
    sequence_gathered_linear,
    tp_rank_and_size,
    vocab_parallel_cross_entropy,
)

LN_EPS = 1e-5
RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.fc2.weight", "mlp.down.weight")
NORMS = ("ln1", "ln2", "final_norm")
PARALLEL_ATTRS = ("tp_split_dim", "tp_replicas", "sequence_parallel")  # what the parallel layers mark


class _Parallel:
    """How a stage is split: the tp group, sequence parallelism, the per-rank random stream, the groups
    of tp ranks that share a replicated k/v head (grouped-query attention with kv_heads < tp), and whether
    blocks run their microbatch as two halves that hide each other's tp collectives (``parallel.tp_overlap``)."""

    def __init__(self, tp: Optional[Comm], sequence_parallel: bool, rng: TPRandom, attention_impl: str = "torch",
                 kv_replicas: Optional[Comm] = None, overlap: bool = False):
        self.tp = tp
        self.attention_impl = attention_impl
        self.rank, self.size = tp_rank_and_size(tp)
        self.sp = sequence_parallel and self.size > 1
        self.overlap = overlap and self.size > 1
        self.rng = rng
        self.kv_replicas = kv_replicas


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output has autocast's dtype.

    CUDA autocast computes layer_norm in fp32 (as it should) but also returns fp32, and the tensor-parallel
    collectives right after a norm (sequence parallelism's all-gather, the column-parallel input's backward
    all-reduce) would then move twice the bytes of a bf16 run. Megatron's fused norm returns the input
    dtype; this returns the autocast dtype. Outside autocast it is nn.LayerNorm.
    """

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if torch.is_autocast_enabled(x.device.type):
            y = y.to(torch.get_autocast_dtype(x.device.type))
        return y


def _norm(cfg: Any, par: _Parallel) -> nn.Module:
    if is_llama(cfg):
        return rms_norm(cfg, par)
    norm = LayerNorm(cfg.hidden, eps=getattr(cfg, "norm_eps", LN_EPS), bias=has_bias(cfg))
    if par.sp:
        mark_sequence_parallel(norm)
    return norm


class Attention(nn.Module):
    """Causal multi-head self-attention; this tp rank computes heads/tp whole heads."""

    def __init__(self, cfg: Any, par: _Parallel):
        super().__init__()
        assert cfg.hidden % cfg.heads == 0 and cfg.heads % par.size == 0, (cfg.hidden, cfg.heads, par.size)
        self.local_heads = cfg.heads // par.size
        self.head_dim = cfg.hidden // cfg.heads
        # Output rows are grouped per head, [q_h; k_h; v_h], so a contiguous tp slice is whole heads.
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=par.sp)
        self.impl = par.attention_impl

    def forward(self, x: Tensor, entry: Optional[Entry] = None) -> Tensor:
        """With ``entry`` (one half under ``parallel.tp_overlap``): proj's partial sums, reduced by the caller."""
        qkv = self.qkv(x, entry)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (b, heads, s, d)
        y = attention(q, k, v, causal=True, impl=self.impl)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj.partial(y) if entry is not None else self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: Any, par: _Parallel):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden, ffn_hidden(cfg), has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.fc2 = RowParallelLinear(ffn_hidden(cfg), cfg.hidden, has_bias(cfg), par.tp, sequence_parallel=par.sp)
        self.dropout = ShardedDropout(cfg.dropout, par.rng, split=par.sp)

    def forward(self, x: Tensor, entry: Optional[Entry] = None) -> Tensor:
        """With ``entry`` (one half under ``parallel.tp_overlap``): fc2's partial sums, reduced by the caller."""
        y = F.gelu(self.fc1(x, entry), approximate="tanh")
        return self.fc2.partial(y) if entry is not None else self.dropout(self.fc2(y))


class Block(nn.Module):
    def __init__(self, cfg: Any, par: _Parallel):
        super().__init__()
        self.ln1 = _norm(cfg, par)
        self.attn = Attention(cfg, par)
        self.ln2 = _norm(cfg, par)
        self.mlp = MLP(cfg, par)
        self.overlap = par.overlap

    def forward(self, x: Tensor) -> Tensor:
        if self.overlap:
            return overlapped_block(x, (Sublayer(self.ln1, self.attn, self.attn.proj, self.attn.dropout),
                                        Sublayer(self.ln2, self.mlp, self.mlp.fc2, self.mlp.dropout)))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token (vocab-parallel) and, on the first stage, learned position embeddings."""

    def __init__(self, cfg: Any, par: _Parallel, positions: bool):
        super().__init__()
        self.tokens = VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, par.tp, sequence_parallel=par.sp)
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden) if positions else None
        if par.sp and positions:
            mark_sequence_parallel(self.positions)


class GPT(nn.Module):
    """One pipeline stage of a GPT: embeddings if first, ``layer_ids`` blocks, norm and head if last.

    forward(x, targets):
      x is token ids (b, s) on the first stage, hidden states otherwise
      ((b, s/tp, h) with sequence parallelism, (b, s, h) without).
      Last stage: per-token float32 loss (b, s) when ``targets`` is given (0 where
      targets == -100), else this tp rank's logits shard (b, s, padded_vocab/tp)
      with padding ids set to -inf. Other stages return hidden states.
    """

    def __init__(
        self,
        cfg: Any,
        tp: Optional[Comm] = None,
        layer_ids: range | None = None,
        first_stage: bool = True,
        last_stage: bool = True,
        sequence_parallel: bool = False,
        attention_impl: str = "torch",
        kv_replicas: Optional[Comm] = None,
        tp_overlap: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.rng = TPRandom()
        self.par = _Parallel(tp, sequence_parallel, self.rng, attention_impl, kv_replicas, tp_overlap)
        self.tp, self.tp_rank, self.tp_size = tp, self.par.rank, self.par.size
        self.sequence_parallel = self.par.sp
        self.layer_ids = range(cfg.layers) if layer_ids is None else layer_ids
        assert all(0 <= i < cfg.layers for i in self.layer_ids), (self.layer_ids, cfg.layers)
        self.first_stage, self.last_stage = first_stage, last_stage
        self.activation_checkpointing = cfg.activation_checkpointing
        # the first k layers of this chunk are recomputed in backward (all of them when k is 0)
        self.checkpointed = cfg.checkpoint_layers or len(self.layer_ids)

        self.tied = tied(cfg)
        positions = first_stage and not is_llama(cfg)
        self.embed = Embedding(cfg, self.par, positions) if first_stage or (last_stage and self.tied) else None
        self.embed_dropout = ShardedDropout(cfg.dropout, self.rng, split=self.par.sp) if first_stage else None
        block = LlamaBlock if is_llama(cfg) else Block
        self.layers = nn.ModuleDict({str(i): block(cfg, self.par) for i in self.layer_ids})
        self.final_norm = _norm(cfg, self.par) if last_stage else None
        # the untied output head: vocab-parallel rows, as the embedding's
        self.head = (ColumnParallelLinear(cfg.hidden, cfg.padded_vocab, False, tp, sequence_parallel=self.par.sp)
                     if last_stage and not self.tied else None)
        mark_replicated(self)

    @property
    def shares_embedding_across_stages(self) -> bool:
        """True on the first and last stage when they differ: ``embed.tokens.weight`` grads must be summed."""
        return self.first_stage != self.last_stage and self.tied

    def _embed(self, ids: Tensor) -> Tensor:
        s = ids.shape[1]
        assert s <= self.cfg.seq_len, f"sequence length {s} exceeds model.seq_len={self.cfg.seq_len}"
        x = self.embed.tokens(ids)  # (b, s/tp, h) under sequence parallelism
        if self.embed.positions is not None:
            local = x.shape[1]
            start = self.tp_rank * local if self.sequence_parallel else 0
            x = x + self.embed.positions(torch.arange(start, start + local, device=ids.device))
        return self.embed_dropout(x)

    def recomputed_parameters(self) -> list[nn.Parameter]:
        """The parameters of the layers recomputed in backward (activation checkpointing): a split backward
        (zb1p) takes their gradients with the input's, as a second recomputation would cost more."""
        if not self.activation_checkpointing:
            return []
        layers = list(self.layers.values())[:self.checkpointed]
        return [p for layer in layers for p in layer.parameters() if p.requires_grad]

    def forward(self, x: Tensor, targets: Tensor | None = None) -> Tensor:
        if self.first_stage:
            x = self._embed(x)
        for i, layer in enumerate(self.layers.values()):
            if self.activation_checkpointing and torch.is_grad_enabled() and i < self.checkpointed:
                x = checkpoint(layer, x, use_reentrant=False, context_fn=self.rng.checkpoint_contexts)
            else:
                x = layer(x)
        if not self.last_stage:
            return x
        h = self.final_norm(x)
        if self.head is not None:  # called as a module: ZeRO waits for its parameters' gather in its pre-hook
            logits, vocab_start = self.head(h), self.tp_rank * self.head.weight.shape[0]
        else:
            tokens = self.embed.tokens
            vocab_start = tokens.vocab_start
            if self.sequence_parallel:
                logits = sequence_gathered_linear(h, tokens.weight, None, self.tp)
            else:
                logits = F.linear(copy_to_region(h, self.tp), tokens.weight)
        if targets is None:
            return mask_padded_vocab(logits, vocab_start, self.cfg.vocab_size)
        return vocab_parallel_cross_entropy(logits, targets, vocab_start, self.cfg.vocab_size, self.tp)


def mark_replicated(model: nn.Module) -> None:
    """Give every parameter without a ``tp_split_dim`` the value None (replicated over tp)."""
    for p in model.parameters():
        if not hasattr(p, "tp_split_dim"):
            p.tp_split_dim = None
        if not hasattr(p, "sequence_parallel"):
            p.sequence_parallel = False
        if not hasattr(p, "tp_replicas"):
            p.tp_replicas = 1


# --- initialisation -----------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_value(name: str, full_shape: tuple[int, ...], seed: int, cfg: Any) -> Tensor:
    """The full (unsharded) float32 initial value of the parameter called ``name``.

    GPT-2 scheme: N(0, init_std) for weights and embeddings, residual output
    projections scaled by 1/sqrt(2 * layers) (two residual additions per block),
    zero biases, LayerNorm weight 1. Depends only on (seed, name, shape, cfg).
    """
    module = name.split(".")[-2]
    if name.endswith(".bias"):
        return torch.zeros(full_shape)
    if module in NORMS:
        return torch.ones(full_shape)
    std = cfg.init_std
    if name.endswith(RESIDUAL_PROJECTIONS):
        std = std / math.sqrt(2 * cfg.layers)
    return torch.empty(full_shape).normal_(0.0, std, generator=_generator(seed, name))


InitialValues = Callable[[str, tuple[int, ...]], Tensor]  # (name, full shape) -> the full float32 value


def initial_tp_value(model: GPT, name: str, seed: int | InitialValues) -> Tensor:
    """This tp rank's slice of the initial value of the parameter ``name`` of ``model`` (CPU, float32).

    ``seed``: the seed of :func:`initial_value`, or a function giving each full value (an imported
    Hugging Face model's weights, ``train.init_from``)."""
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    tp_rank, tp_size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
    p = getattr(module, pname)
    dim = p.tp_split_dim
    pieces = tp_size // getattr(p, "tp_replicas", 1)  # replicated k/v heads: tp/replicas distinct pieces
    full_shape = list(p.shape)
    if dim is not None:
        full_shape[dim] *= pieces
    if callable(seed):
        value = seed(name, tuple(full_shape))
        assert tuple(value.shape) == tuple(full_shape), (name, tuple(value.shape), full_shape)
    else:
        value = initial_value(name, tuple(full_shape), seed, model.cfg)
    if dim is not None and pieces > 1:
        value = value.chunk(pieces, dim=dim)[tp_rank * pieces // tp_size]
    return value


@torch.no_grad()
def init_parameters(model: GPT, seed: int | InitialValues) -> None:
    """Set every parameter to its layout-independent initial value (this rank's tp slice of it)."""
    for name, p in model.named_parameters():
        p.copy_(initial_tp_value(model, name, seed))


def build_gpt(
    cfg: Any,
    seed: int | InitialValues,
    device: torch.device | str = "cpu",
    tp: Optional[Comm] = None,
    layer_ids: range | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
    sequence_parallel: bool = False,
    attention_impl: str = "torch",
    materialise: bool = True,
    kv_replicas: Optional[Comm] = None,
    tp_overlap: bool = False,
) -> GPT:
    """Build a stage on the meta device (no memory), materialise it on ``device``, initialise it.

    materialise=False leaves the parameters on the meta device for their owner (ZeRO-3) to create one
    bucket at a time from :func:`initial_tp_value`; the model still computes on ``device``.
    """
    with torch.device("meta"):
        model = GPT(cfg, tp, layer_ids, first_stage, last_stage, sequence_parallel, attention_impl, kv_replicas,
                    tp_overlap)
    model.rng.device = torch.device(device)
    if not materialise:
        return model
    # new Parameter objects on the device, keeping the parallel attributes (not to_empty: it cannot swap the
    # parameters of a model built under fake tensors, which --simulate runs)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                for attr in PARALLEL_ATTRS:
                    setattr(made[id(p)], attr, getattr(p, attr))
            setattr(module, name, made[id(p)])
    init_parameters(model, seed)
    return model


def count_parameters(cfg: Any) -> int:
    """Parameters of the whole model (every stage and tp rank, a tied head counted once).

    The token embedding (and an untied head) count their padded rows because they are stored and
    multiplied like any other. Llama: RMSNorms (no bias), q/o of h x h, k/v of h x kv_heads*head_dim, and
    SwiGLU's three ffn x h matrices; no position table.
    """
    h, f, n_bias = cfg.hidden, ffn_hidden(cfg), int(has_bias(cfg))
    head = 0 if tied(cfg) else cfg.padded_vocab * h
    if is_llama(cfg):
        kv = cfg.kv_head_count * (h // cfg.heads)
        norm = h
        block = 2 * norm + 2 * h * h + 2 * h * kv + n_bias * (2 * h + 2 * kv) + 3 * f * h + n_bias * (2 * f + h)
        return cfg.padded_vocab * h + head + cfg.layers * block + norm
    norm = h * (1 + n_bias)
    block = (
        2 * norm
        + 3 * h * h + n_bias * 3 * h  # qkv
        + h * h + n_bias * h  # attention output projection
        + f * h + n_bias * f  # fc1
        + h * f + n_bias * h  # fc2
    )
    return cfg.padded_vocab * h + head + cfg.seq_len * h + cfg.layers * block + norm
