"""The model's section of the config: ``model.*`` and ``model.moe.*``, beside the models that read them.

``megazero.config.schema`` lists these dataclasses in its SECTIONS table (each field's comment is its line in
docs/config.md); what ``model.arch`` names is its spec (:attr:`ModelConfig.spec`, ``models.registry``).
Nothing here imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from megazero.models.spec import ModelSpec

# a value fixed later: by resolve (parallel.dp, parallel.pp_layers, zero.reshard_after_forward, kernels.*) or
# at launch
AUTO = "auto"


@dataclass
class MoeConfig:
    """``model.moe``: a mixture of experts in place of the MLP of some layers (llama only; docs/moe.md).

    Off while ``experts`` is 0. Layer i is a mixture of experts when i >= dense_layers and
    (i - dense_layers) % every == 0."""

    experts: int = 0  # routed experts E; 0 = a dense model
    top_k: int = 2  # experts each token is sent to
    expert_hidden: Union[int, None] = None  # each expert's SwiGLU width; None -> the model's ffn_hidden
    shared_experts: int = 0  # always-on, ungated experts (DeepSeek's), one SwiGLU of shared_experts*expert_hidden
    dense_layers: int = 0  # the first k layers keep a dense MLP (DeepSeek-V3: 3)
    every: int = 1  # a mixture of experts every n layers after the dense ones
    router: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3: bias-selected top-k)
    norm_topk_prob: bool = True  # renormalise the k gate weights to sum to 1
    routed_scaling_factor: float = 1.0  # the routed experts' output is multiplied by it (DeepSeek-V3: 2.5)
    # training settings (may change on a resume):
    bias_update_rate: float = 0.001  # sigmoid: DeepSeek-V3's gamma, bias_e += gamma*sign(mean load - load_e)
    aux_loss: float = 0.0  # the Switch/GShard load-balancing loss's coefficient, per sequence
    z_loss: float = 0.0  # the router z-loss's coefficient (Zoph et al. 2022), per token
    capacity_factor: float = 0.0  # 0: dropless; else tokens past capacity*tokens*top_k/E per expert are dropped

    ARCHITECTURE = ("experts", "top_k", "expert_hidden", "shared_experts", "dense_layers", "every", "router",
                    "norm_topk_prob", "routed_scaling_factor")

    def is_moe_layer(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.dense_layers and (layer - self.dense_layers) % self.every == 0


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention)
    layers: int = 2  # transformer blocks
    hidden: int = 64  # the residual stream's width
    heads: int = 4  # attention (query) heads
    seq_len: int = 64  # tokens per sample
    vocab_size: int = 512  # the tokenizer's ids; the embedding is padded to model.vocab_pad_multiple
    ffn_hidden: Union[int, None] = None  # None -> 4 * hidden (gpt2); 8/3 * hidden rounded up to 256 (llama)
    kv_heads: Union[int, None] = None  # grouped-query attention: k/v heads, dividing heads; None -> heads
    # llama: the width of each q/k/v head; None -> hidden / heads (Qwen3: 128 beside hidden 2048 and 32 heads, so
    # q is 4096 wide and the output projection maps 4096 back to 2048)
    head_dim: Union[int, None] = None
    bias: Union[bool, str] = AUTO  # auto: true for gpt2, false for llama
    tie_embeddings: Union[bool, str] = AUTO  # output head = token embedding; auto: true for gpt2, false for llama
    norm_eps: float = 1e-5  # the LayerNorm / RMSNorm epsilon
    rope_theta: float = 10000.0  # llama: the base of the rotary position frequencies (Su et al. 2021)
    # llama: none | llama3, Llama 3.1's frequency scaling for long context (the four keys below, as its
    # config.json's rope_scaling): frequencies whose wavelength exceeds original_positions/low_freq_factor are
    # divided by rope_factor, those below original_positions/high_freq_factor kept, the band between blended
    rope_scaling: str = "none"
    rope_factor: float = 8.0  # llama3 scaling: low frequencies are divided by it
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths past original_positions/this are scaled
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original_positions/this are kept
    rope_original_positions: int = 8192  # llama3 scaling: the context the model was first trained at
    # llama: an RMSNorm over each head's features of q and of k, before the rotation (Qwen3's q_norm, k_norm)
    qk_norm: bool = False
    dropout: float = 0.0  # after attention and MLP (and the embedding); 0 in modern pretraining
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward instead of keeping them
    # with activation_checkpointing: recompute only the first k layers of each model chunk (Megatron's
    # --recompute-num-layers, block method), trading memory for compute in steps; 0: every layer
    checkpoint_layers: int = 0
    init_std: float = 0.02  # the normal std of the weights (output projections scaled by 1/sqrt(2*layers), GPT-2)
    vocab_pad_multiple: int = 128  # embedding rows are vocab_size rounded up to a multiple of this (independent of tp)
    moe: MoeConfig = field(default_factory=MoeConfig)  # a mapping: model.moe.experts, ... (above)

    # The keys that define the network a checkpoint holds; the others (dropout, activation checkpointing,
    # init_std) may change between a save and a resume.
    ARCHITECTURE = ("arch", "layers", "hidden", "heads", "kv_heads", "head_dim", "seq_len", "vocab_size", "ffn_hidden", "bias",
                    "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor", "rope_original_positions", "vocab_pad_multiple", "qk_norm", "moe")

    @property
    def padded_vocab(self) -> int:
        """Embedding rows: vocab_size rounded up to a multiple of vocab_pad_multiple (128).

        Independent of tp, so a checkpoint moves between tensor-parallel sizes
        (Megatron pads to 128*tp, which ties checkpoints to tp); tp must divide
        it, which config validation checks.
        """
        multiple = self.vocab_pad_multiple
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def head_width(self) -> int:
        """Each attention head's width: ``head_dim``, or hidden / heads when unset."""
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_head_count(self) -> int:
        """k/v heads: ``kv_heads``, or every head (multi-head attention) when unset."""
        return self.kv_heads or self.heads

    @property
    def spec(self) -> "ModelSpec":
        """The architecture's spec (``models.registry``): its modules, what auto means for its keys, its counts,
        Hugging Face tables and rules. Imported when asked, so the modules that read a config need no registry."""
        from megazero.models.registry import spec_of

        return spec_of(self)
