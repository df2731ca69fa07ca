"""What a model config's keys mean where they are left auto or unset, from its architecture's spec
(``ModelConfig.spec``: GPT-2 has biases and a tied head, Llama neither; each has its MLP width rule).

``megazero.config.resolve.resolve_arch`` fixes these values when a config is resolved; a model config
built directly (tests, benchmarks, a checkpoint's stored section) gets the same meaning here, so the model
never reads the string 'auto' as true. Nothing here imports: the modules use these helpers, and the spec is
reached through the config.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig


def tied(cfg: "ModelConfig") -> bool:
    """The output head is the token embedding: the architecture's default (GPT-2 ties it, Llama not) unless told."""
    tie = cfg.tie_embeddings
    return cfg.spec.tied if tie == "auto" else bool(tie)


def has_bias(cfg: "ModelConfig") -> bool:
    """Biases in linears and norms: the architecture's default (GPT-2 has them, Llama not) unless told."""
    bias = cfg.bias
    return cfg.spec.bias if bias == "auto" else bool(bias)


def ffn_hidden(cfg: "ModelConfig") -> int:
    """The MLP width: ``model.ffn_hidden``, else the architecture's rule (4h for GPT-2; Llama's SwiGLU 8h/3 rounded
    up to a multiple of 256)."""
    if cfg.ffn_hidden:
        return cfg.ffn_hidden
    return cfg.spec.ffn_rule(cfg.hidden)


def head_dim(cfg: "ModelConfig") -> int:
    """Each attention head's width: ``model.head_dim`` (llama), or hidden / heads when unset."""
    return cfg.head_dim or cfg.hidden // cfg.heads


def expert_hidden(cfg: "ModelConfig") -> int:
    """A routed (or shared) expert's SwiGLU width: ``model.moe.expert_hidden``, or the model's ffn width."""
    return cfg.moe.expert_hidden or ffn_hidden(cfg)


def moe_layer_count(cfg: "ModelConfig", layer_ids: range) -> int:
    """How many of ``layer_ids`` (a step-1 range) are mixtures of experts (``MoeConfig.is_moe_layer``): layer i is
    one when i >= dense_layers and (i - dense_layers) % every == 0. Counted, not listed: a plan asks it of
    ranges of a billion layers."""
    moe = cfg.moe
    if not moe.experts or not len(layer_ids):
        return 0
    assert layer_ids.step == 1, layer_ids
    d, n = moe.dense_layers, moe.every
    start, stop = max(layer_ids.start, d), layer_ids.stop
    if start >= stop:
        return 0
    return -(-(stop - d) // n) - -(-(start - d) // n)  # multiples of n in [start - d, stop - d)
