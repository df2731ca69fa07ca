"""What ``model.arch`` means for the keys a config may leave as auto or unset.

``megazero.config.resolve.resolve_arch`` fixes these values when a config is resolved; a model config
built directly (tests, benchmarks, a checkpoint's stored section) gets the same meaning here, so the model
never reads the string 'auto' as true.
"""
from __future__ import annotations

from typing import Any


def is_llama(cfg: Any) -> bool:
    return getattr(cfg, "arch", "gpt2") == "llama"


def tied(cfg: Any) -> bool:
    """The output head is the token embedding: GPT-2 ties it, Llama does not (unless told)."""
    tie = getattr(cfg, "tie_embeddings", "auto")
    return (not is_llama(cfg)) if tie == "auto" else bool(tie)


def has_bias(cfg: Any) -> bool:
    """Biases in linears and norms: GPT-2 has them, Llama not (unless told)."""
    bias = getattr(cfg, "bias", "auto")
    return (not is_llama(cfg)) if bias == "auto" else bool(bias)


def ffn_hidden(cfg: Any) -> int:
    """The MLP width: 4h for GPT-2; for Llama's SwiGLU 8h/3 rounded up to a multiple of 256 (Touvron et al.
    2023), keeping about GPT-2's MLP parameters in three matrices."""
    if cfg.ffn_hidden:
        return cfg.ffn_hidden
    return -(-(8 * cfg.hidden // 3) // 256) * 256 if is_llama(cfg) else 4 * cfg.hidden


def head_dim(cfg: Any) -> int:
    """Each attention head's width: ``model.head_dim`` (llama), or hidden / heads when unset."""
    return getattr(cfg, "head_dim", None) or cfg.hidden // cfg.heads


def expert_hidden(cfg: Any) -> int:
    """A routed (or shared) expert's SwiGLU width: ``model.moe.expert_hidden``, or the model's ffn width."""
    return cfg.moe.expert_hidden or ffn_hidden(cfg)


def moe_layer_count(cfg: Any, layer_ids: range) -> int:
    """How many of ``layer_ids`` (a step-1 range) are mixtures of experts (``MoeConfig.is_moe_layer``): layer i is
    one when i >= dense_layers and (i - dense_layers) % every == 0. Counted, not listed: a plan asks it of
    ranges of a billion layers."""
    moe = getattr(cfg, "moe", None)
    if moe is None or not moe.experts or not len(layer_ids):
        return 0
    assert layer_ids.step == 1, layer_ids
    d, n = moe.dense_layers, moe.every
    start, stop = max(layer_ids.start, d), layer_ids.stop
    if start >= stop:
        return 0
    return -(-(stop - d) // n) - -(-(start - d) // n)  # multiples of n in [start - d, stop - d)
