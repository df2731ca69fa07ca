"""Where each megazero parameter lives in a Hugging Face folder, and how its layout differs: GPT-2, Llama, Qwen3
(Llama with ``model.qk_norm``), and the mixtures of experts Mixtral and Qwen3-MoE (``model.moe``).

The tables are each architecture's spec's (``models.gpt2_spec``, ``models.llama_hf``: ``ModelSpec.hf``); this module
is the machinery around them. One table serves both directions (``megazero.interop.export`` writes it,
``megazero.interop.hf_import`` reads it), so an export and an import cannot drift apart. A :class:`Link` names the
HF tensor of one megazero parameter and the one layout change between them:

* ``copy``: same tensor (every Llama weight: our rotary embedding uses HF's halves layout and frequencies,
  so q and k need no permutation);
* ``t``: transposed (GPT-2's Conv1D stores weights (in, out));
* ``qkv`` / ``qkv_bias``: GPT-2's fused attention, ours grouped per head [q_h; k_h; v_h] (so a tp slice
  is whole heads), HF's [all q; all k; all v] (and transposed for the weight);
* ``vocab``: our rows are padded to ``padded_vocab``; HF has exactly ``vocab_size``;
* ``positions``: our ``seq_len`` position rows are HF's first ``seq_len`` of ``n_positions``;
* ``experts``: our stack of E experts' matrices (E, out, in) is E HF tensors, one per expert, each the same
  (out, in) matrix (``{e}`` in the name is the expert). That is what transformers' save_pretrained writes
  (per expert, ``block_sparse_moe.experts.E.w1`` for Mixtral, ``mlp.experts.E.gate_proj`` for Qwen3-MoE) and
  what an export writes; transformers 5's own modules stack them instead (``mlp.experts.gate_up_proj``
  (E, 2f, h), gate rows first, and ``mlp.experts.down_proj``; a Mixtral router as ``mlp.gate``), which
  from_pretrained also reads: a folder holding those is read through ``Link.alt``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from megazero.models.config import ModelConfig, MoeConfig
from megazero.models.hf import Link, expert_keys  # noqa: F401 (the tables' row type, re-exported)
from megazero.models.registry import hf_classes

HF_ARCHITECTURES = MappingProxyType(hf_classes())  # model_type -> class, every architecture's (its spec's hf)


def model_config(model_cfg: Any) -> ModelConfig:
    """A resolved copy of ``model_cfg`` (a ModelConfig, or a checkpoint's model section as a dict): the
    architecture's meaning of auto/unset bias, tie_embeddings and ffn_hidden filled in, as a config load
    does, so callers compare and shape with concrete values."""
    from megazero.config.resolve import resolve_arch

    if isinstance(model_cfg, Mapping):
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        m = ModelConfig(**{k: v for k, v in model_cfg.items() if k in names})
    else:
        m = dataclasses.replace(model_cfg)
    if isinstance(m.moe, Mapping):  # a stored section's model.moe
        keys = {f.name for f in dataclasses.fields(MoeConfig)}
        m.moe = MoeConfig(**{k: v for k, v in m.moe.items() if k in keys})
    resolve_arch(m)
    return m


def hf_type(m: ModelConfig, where: str = "the model config") -> str:
    """The Hugging Face model_type a resolved config is written as (its spec's: gpt2; llama, or qwen3 with
    model.qk_norm; with model.moe, mixtral or qwen3_moe). What no HF class of it holds is refused, naming the
    key."""
    return m.spec.hf.model_type(m, where)


def links(model_cfg: ModelConfig, kind: str | None = None) -> dict[str, Link]:
    """Every parameter of the whole model (all stages, tp=1 shapes; an expert stack whole) -> its :class:`Link`,
    for a resolved config (see :func:`model_config`) written as HF model_type ``kind`` (default
    :func:`hf_type`'s): the spec's table, and the untied head."""
    m = model_cfg
    kind = hf_type(m) if kind is None else kind
    out = m.spec.hf.links(m, kind)
    if not m.tie_embeddings:
        out["head.weight"] = Link((m.padded_vocab, m.hidden), "lm_head.weight", "vocab")
    return out


def hf_shape(link: Link, model_cfg: ModelConfig, n_positions: int = 0) -> tuple[int, ...]:
    """The shape of ``link``'s tensor in the HF folder (``n_positions``: GPT-2's position rows there)."""
    if link.kind in ("t", "qkv"):
        return tuple(reversed(link.shape))
    if link.kind == "vocab":
        return (model_cfg.vocab_size, link.shape[1])
    if link.kind == "positions":
        return (n_positions or link.shape[0], link.shape[1])
    if link.kind == "experts":
        return link.shape[1:]  # each expert's
    return link.shape


def stacked_shape(link: Link) -> tuple[int, ...]:
    """The shape of ``link.alt``'s tensor: an expert stack (gate and up in one), or the same as ``link.hf``'s."""
    if link.kind != "experts":
        return link.shape
    E, rows, cols = link.shape
    return (E, 2 * rows, cols) if link.part >= 0 else link.shape


def _regroup(t: Tensor, heads: int, to_hf: bool) -> Tensor:
    """Rows [q_h; k_h; v_h] per head (ours) <-> [all q; all k; all v] (HF), each head-major."""
    d = t.shape[0] // (3 * heads)
    split = (heads, 3, d) if to_hf else (3, heads, d)
    return t.reshape(*split, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def hf_tensors(t: Tensor, link: Link, model_cfg: ModelConfig) -> dict[str, Tensor]:
    """Our full tensor as the HF tensors it is written as: one, or an expert stack's E."""
    if link.kind == "experts":
        return dict(zip(expert_keys(link), t.unbind(0)))
    return {link.hf: to_hf(t, link, model_cfg)}


def to_hf(t: Tensor, link: Link, model_cfg: ModelConfig) -> Tensor:
    """Our full tensor in HF's layout (padded vocab rows dropped; an expert stack: :func:`hf_tensors`)."""
    assert link.kind != "experts", link
    if link.kind == "t":
        return t.t()
    if link.kind == "qkv":
        return _regroup(t, model_cfg.heads, to_hf=True).t()
    if link.kind == "qkv_bias":
        return _regroup(t, model_cfg.heads, to_hf=True)
    if link.kind == "vocab":
        return t[:model_cfg.vocab_size]
    return t


def from_hf(t: Tensor, link: Link, model_cfg: ModelConfig) -> Tensor:
    """HF's tensor in our layout, float32; padded vocab rows zero, ``positions`` already cut to seq_len (an
    ``experts`` link's: one expert's matrix, as it is)."""
    t = t.float()
    if link.kind == "t":
        return t.t().contiguous()
    if link.kind == "qkv":
        return _regroup(t.t(), model_cfg.heads, to_hf=False).contiguous()
    if link.kind == "qkv_bias":
        return _regroup(t, model_cfg.heads, to_hf=False).contiguous()
    if link.kind == "vocab":
        padded = torch.zeros(link.shape, dtype=torch.float32)
        padded[: t.shape[0]] = t
        return padded
    return t.contiguous()
