"""GPT (Radford et al. 2019; Brown et al. 2020) as one pipeline stage built from tensor-parallel layers.

``model.arch: gpt2``: pre-LayerNorm blocks, learned positions, tanh-GELU, causal
self-attention and an output head tied to the token embedding. ``llama``
(Touvron et al. 2023): RMSNorm, rotary positions, grouped-query attention,
SwiGLU, no position table, and by default an untied vocab-parallel ``head``.
Both are ``models.block.Block`` over the parts ``models.parts`` names. A ``GPT``
holds only the layers of its pipeline stage, keyed by their *global* index, so a
parameter is called ``layers.17.mlp.fc1.weight`` on whichever stage holds it.

What data parallelism needs of a stage it reads from two declarations, not from
parameter names: ``sharding_units()`` (the blocks, gathered and freed one at a time
under ZeRO-3) and ``tied_parameters()``.

Tied embeddings across stages: when the first and last stages differ, both hold
``embed.tokens.weight`` (the first for the input lookup, the last for the
head). They start equal because initial values depend only on (seed, name);
whoever runs the pipeline must sum their gradients over the two stages
(Megatron's embedding group) to keep them equal, and count them once in the
gradient norm: ``tied_parameters()`` says which copy counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megazero.models.arch import tied
from megazero.models.parts import parts_of
from megazero.models.split import Split
from megazero.parallel.comm import Comm
from megazero.parallel.cross_entropy import mask_padded_vocab, vocab_parallel_cross_entropy
from megazero.parallel.head_loss import chunked_head_cross_entropy
from megazero.parallel.regions import copy_to_region, gather_from_sequence
from megazero.parallel.sequence import SequenceInfo
from megazero.parallel.tp_random import ShardedDropout, TPRandom
from megazero.parallel.sequence_linears import sequence_gathered_linear
from megazero.parallel.tensor import ColumnParallelLinear, VocabParallelEmbedding, mark_sequence_parallel

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig


class TiedParameter(NamedTuple):
    """A parameter whose gradient is summed with another stage's copy (over the embedding group)."""

    name: str  # its global name, the same on both stages
    param: nn.Parameter
    counted: bool  # this copy counts toward the gradient norm (exactly one of the copies does)


class Embedding(nn.Module):
    """Token (vocab-parallel) and, on the first stage, learned position embeddings."""

    def __init__(self, cfg: ModelConfig, par: Split, positions: bool):
        super().__init__()
        self.tokens = VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, par.tp, sequence_parallel=par.sp)
        # given its (empty) weight, nn.Embedding skips its own init: models/init.py sets every value, and a
        # random init on the meta device would import torch._dynamo (~1 s) in every process that plans
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden, _weight=torch.empty(cfg.seq_len, cfg.hidden)) \
            if positions else None
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
        cfg: ModelConfig,
        tp: Optional[Comm] = None,
        layer_ids: range | None = None,
        first_stage: bool = True,
        last_stage: bool = True,
        sequence_parallel: bool = False,
        attention_impl: str = "torch",
        kv_replicas: Optional[Comm] = None,
        tp_overlap: bool = False,
        ep: Optional[Comm] = None,
        cp: Optional[Comm] = None,
        cp_mode: str = "ring",
        loss_chunk: int = 0,
        norm_impl: str = "torch",
    ):
        super().__init__()
        self.cfg = cfg
        self.loss_chunk = loss_chunk  # > 0: the head and loss this many tokens at a time (parallel.head_loss)
        self.rng = TPRandom()
        self.par = Split(tp, sequence_parallel, self.rng, attention_impl, kv_replicas, tp_overlap, ep, cp, cp_mode,
                         norm_impl)
        self.tp, self.tp_rank, self.tp_size = tp, self.par.rank, self.par.size
        self.sequence_parallel = self.par.sp
        self.layer_ids = range(cfg.layers) if layer_ids is None else layer_ids
        assert all(0 <= i < cfg.layers for i in self.layer_ids), (self.layer_ids, cfg.layers)
        self.first_stage, self.last_stage = first_stage, last_stage
        self.activation_checkpointing = cfg.activation_checkpointing
        # the first k layers of this chunk are recomputed in backward (all of them when k is 0)
        self.checkpointed = cfg.checkpoint_layers or len(self.layer_ids)

        parts = parts_of(cfg)
        self.tied = tied(cfg)
        positions = first_stage and cfg.spec.learned_positions
        self.embed = Embedding(cfg, self.par, positions) if first_stage or (last_stage and self.tied) else None
        self.embed_dropout = ShardedDropout(cfg.dropout, self.rng, split=self.par.sp) if first_stage else None
        self.layers = nn.ModuleDict({str(i): parts.block(cfg, self.par, i) for i in self.layer_ids})
        self.final_norm = parts.norm(cfg, self.par) if last_stage else None
        # the untied output head: vocab-parallel rows, as the embedding's
        self.head = (ColumnParallelLinear(cfg.hidden, cfg.padded_vocab, False, tp, sequence_parallel=self.par.sp)
                     if last_stage and not self.tied else None)
        mark_replicated(self)

    @property
    def shares_embedding_across_stages(self) -> bool:
        """True on the first and last stage when they differ: ``embed.tokens.weight`` grads must be summed."""
        return self.first_stage != self.last_stage and self.tied

    # ----- what data parallelism asks of the stage -----------------------------------------------------------
    def sharding_units(self) -> list[tuple[str, nn.Module]]:
        """The modules whose parameters are gathered and freed together under sharded parameters (ZeRO-3), in
        forward order, each with its global name prefix: the blocks. The stage's other parameters (embeddings,
        final norm, head) are its root, gathered for the whole step."""
        return [(f"layers.{i}", layer) for i, layer in self.layers.items()]

    def tied_parameters(self) -> list[TiedParameter]:
        """The parameters another stage holds a copy of, to be summed with it: the token embedding when the
        first and last stages differ and the head is tied. The first stage's copy counts toward the norm."""
        if not self.shares_embedding_across_stages:
            return []
        return [TiedParameter("embed.tokens.weight", self.embed.tokens.weight, counted=self.first_stage)]

    def moe_layers(self) -> list[tuple[int, nn.Module]]:
        """(global layer index, its mixture-of-experts MLP) for this stage's mixture-of-experts layers: their
        statistics are summed over the ranks and their routers' biases moved after each step."""
        moe = getattr(self.cfg, "moe", None)
        if moe is None:
            return []
        return [(i, self.layers[str(i)].mlp) for i in self.layer_ids if moe.is_moe_layer(i)]

    def set_loss_weight(self, weight: float) -> None:
        """d(loss)/d(an auxiliary loss summed over tokens), for the forwards that follow: the loss scale over
        the global batch's tokens, as the main loss is weighted (``parallel.pipeline``)."""
        self.par.aux_weight.value = weight

    def recomputed_parameters(self) -> list[nn.Parameter]:
        """The parameters of the layers recomputed in backward (activation checkpointing): a split backward
        (zb1p) takes their gradients with the input's, as a second recomputation would cost more."""
        if not self.activation_checkpointing:
            return []
        layers = list(self.layers.values())[:self.checkpointed]
        return [p for layer in layers for p in layer.parameters() if p.requires_grad]

    # ----- forward -----------------------------------------------------------------------------------------------
    def _embed(self, ids: Tensor, info: SequenceInfo) -> Tensor:
        s = ids.shape[1] * self.par.cp.size
        assert s <= self.cfg.seq_len, f"sequence length {s} exceeds model.seq_len={self.cfg.seq_len}"
        x = self.embed.tokens(ids)  # (b, s/cp/tp, h) under sequence parallelism
        if self.embed.positions is not None:
            positions = info.positions
            if self.sequence_parallel:  # this tp rank's part of the rank's sequence
                local = x.shape[1]
                positions = positions[..., self.tp_rank * local:(self.tp_rank + 1) * local]
            x = x + self.embed.positions(positions)
        return self.embed_dropout(x)

    def forward(self, x: Tensor, targets: Tensor | None = None, info: Optional[SequenceInfo] = None) -> Tensor:
        """``info``: this rank's positions (and documents) of the microbatch; default whole sequences from 0."""
        if info is None:
            assert self.par.cp.size == 1, "under context parallelism the caller says which tokens these are"
            s = x.shape[1] * (self.tp_size if self.sequence_parallel and not self.first_stage else 1)
            info = SequenceInfo(torch.arange(s, device=x.device))
        if self.first_stage:
            x = self._embed(x, info)
        for i, layer in enumerate(self.layers.values()):
            if self.activation_checkpointing and torch.is_grad_enabled() and i < self.checkpointed:
                x = checkpoint(layer, x, info, use_reentrant=False, context_fn=self.rng.checkpoint_contexts)
            else:
                x = layer(x, info)
        if not self.last_stage:
            return x
        h = self.final_norm(x)
        if targets is not None and self.loss_chunk:
            return self._chunked_loss(h, targets)
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

    def _chunked_loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """The per-token loss without the microbatch's logits: the head's matmul and the loss a chunk of tokens
        at a time, from the head's input as every tp rank sees it."""
        def loss(whole: Tensor, weight: Tensor, vocab_start: int) -> Tensor:
            return chunked_head_cross_entropy(whole, weight, targets, vocab_start, self.cfg.vocab_size, self.tp,
                                              self.loss_chunk)

        if self.head is not None:
            start = self.tp_rank * self.head.weight.shape[0]
            return self.head(h, consume=lambda whole, weight: loss(whole, weight, start))
        tokens = self.embed.tokens
        whole = gather_from_sequence(h, self.tp) if self.sequence_parallel else copy_to_region(h, self.tp)
        return loss(whole, tokens.weight, tokens.vocab_start)


def mark_replicated(model: nn.Module) -> None:
    """Give every parameter without a ``tp_split_dim`` the value None (replicated over tp)."""
    for p in model.parameters():
        if not hasattr(p, "tp_split_dim"):
            p.tp_split_dim = None
        if not hasattr(p, "sequence_parallel"):
            p.sequence_parallel = False
        if not hasattr(p, "tp_replicas"):
            p.tp_replicas = 1
