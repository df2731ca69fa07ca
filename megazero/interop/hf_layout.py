"""Where each megazero parameter lives in a Hugging Face GPT-2 or Llama folder, and how its layout differs.

One table serves both directions (``megazero.interop.export`` writes it, ``megazero.interop.hf_import`` reads it), so an
export and an import cannot drift apart. A :class:`Link` names the HF tensor of one megazero parameter and
the one layout change between them:

* ``copy``: same tensor (every Llama weight: our rotary embedding uses HF's halves layout and frequencies,
  so q and k need no permutation);
* ``t``: transposed (GPT-2's Conv1D stores weights (in, out));
* ``qkv`` / ``qkv_bias``: GPT-2's fused attention, ours grouped per head [q_h; k_h; v_h] (so a tp slice
  is whole heads), HF's [all q; all k; all v] (and transposed for the weight);
* ``vocab``: our rows are padded to ``padded_vocab``; HF has exactly ``vocab_size``;
* ``positions``: our ``seq_len`` position rows are HF's first ``seq_len`` of ``n_positions``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from megazero.config.schema import ModelConfig

GPT2_BLOCK = MappingProxyType({  # ours -> (HF suffix under transformer.h.{i}., kind)
    "ln1.weight": ("ln_1.weight", "copy"),
    "ln1.bias": ("ln_1.bias", "copy"),
    "attn.qkv.weight": ("attn.c_attn.weight", "qkv"),
    "attn.qkv.bias": ("attn.c_attn.bias", "qkv_bias"),
    "attn.proj.weight": ("attn.c_proj.weight", "t"),
    "attn.proj.bias": ("attn.c_proj.bias", "copy"),
    "ln2.weight": ("ln_2.weight", "copy"),
    "ln2.bias": ("ln_2.bias", "copy"),
    "mlp.fc1.weight": ("mlp.c_fc.weight", "t"),
    "mlp.fc1.bias": ("mlp.c_fc.bias", "copy"),
    "mlp.fc2.weight": ("mlp.c_proj.weight", "t"),
    "mlp.fc2.bias": ("mlp.c_proj.bias", "copy"),
})
LLAMA_BLOCK = MappingProxyType({  # ours -> HF suffix under model.layers.{i}.; every kind is copy
    "ln1.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
})
HF_ARCHITECTURES = MappingProxyType({"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"})


@dataclass(frozen=True)
class Link:
    """One megazero parameter: its full shape here, its HF tensor name, and the layout change (module doc)."""

    shape: tuple[int, ...]
    hf: str
    kind: str = "copy"


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
    resolve_arch(m)
    return m


def _block_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f = m.hidden, m.ffn_hidden
    if m.arch == "llama":
        q, kv = m.heads * m.head_width, m.kv_head_count * m.head_width
        out = {"ln1.weight": (h,), "attn.q.weight": (q, h), "attn.k.weight": (kv, h), "attn.v.weight": (kv, h),
               "attn.proj.weight": (h, q), "ln2.weight": (h,), "mlp.gate.weight": (f, h),
               "mlp.up.weight": (f, h), "mlp.down.weight": (h, f)}
        biases = {"attn.q.bias": (q,), "attn.k.bias": (kv,), "attn.v.bias": (kv,), "attn.proj.bias": (h,),
                  "mlp.gate.bias": (f,), "mlp.up.bias": (f,), "mlp.down.bias": (h,)}
    else:
        out = {"ln1.weight": (h,), "attn.qkv.weight": (3 * h, h), "attn.proj.weight": (h, h),
               "ln2.weight": (h,), "mlp.fc1.weight": (f, h), "mlp.fc2.weight": (h, f)}
        biases = {"ln1.bias": (h,), "attn.qkv.bias": (3 * h,), "attn.proj.bias": (h,), "ln2.bias": (h,),
                  "mlp.fc1.bias": (f,), "mlp.fc2.bias": (h,)}
    return {**out, **biases} if m.bias else out


def links(model_cfg: Any) -> dict[str, Link]:
    """Every parameter of the whole model (all stages, tp=1 shapes) -> its :class:`Link`, for a resolved
    config (see :func:`model_config`)."""
    m = model_cfg
    h, tied = m.hidden, bool(m.tie_embeddings)
    vocab = (m.padded_vocab, h)
    out: dict[str, Link] = {}
    if m.arch == "llama":
        out["embed.tokens.weight"] = Link(vocab, "model.embed_tokens.weight", "vocab")
        for i in range(m.layers):
            for name, shape in _block_shapes(m).items():
                module, _, kind = name.rpartition(".")
                hf = LLAMA_BLOCK[module + ".weight"].removesuffix(".weight") + "." + kind
                out[f"layers.{i}.{name}"] = Link(shape, f"model.layers.{i}.{hf}")
        out["final_norm.weight"] = Link((h,), "model.norm.weight")
    else:
        out["embed.tokens.weight"] = Link(vocab, "transformer.wte.weight", "vocab")
        out["embed.positions.weight"] = Link((m.seq_len, h), "transformer.wpe.weight", "positions")
        for i in range(m.layers):
            for name, shape in _block_shapes(m).items():
                hf, kind = GPT2_BLOCK[name]
                out[f"layers.{i}.{name}"] = Link(shape, f"transformer.h.{i}.{hf}", kind)
        out["final_norm.weight"] = Link((h,), "transformer.ln_f.weight")
        if m.bias:
            out["final_norm.bias"] = Link((h,), "transformer.ln_f.bias")
    if not tied:
        out["head.weight"] = Link(vocab, "lm_head.weight", "vocab")
    return out


def hf_shape(link: Link, model_cfg: Any, n_positions: int = 0) -> tuple[int, ...]:
    """The shape of ``link``'s tensor in the HF folder (``n_positions``: GPT-2's position rows there)."""
    if link.kind in ("t", "qkv"):
        return tuple(reversed(link.shape))
    if link.kind == "vocab":
        return (model_cfg.vocab_size, link.shape[1])
    if link.kind == "positions":
        return (n_positions or link.shape[0], link.shape[1])
    return link.shape


def _regroup(t: Tensor, heads: int, to_hf: bool) -> Tensor:
    """Rows [q_h; k_h; v_h] per head (ours) <-> [all q; all k; all v] (HF), each head-major."""
    d = t.shape[0] // (3 * heads)
    split = (heads, 3, d) if to_hf else (3, heads, d)
    return t.reshape(*split, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def to_hf(t: Tensor, link: Link, model_cfg: Any) -> Tensor:
    """Our full tensor in HF's layout (padded vocab rows dropped)."""
    if link.kind == "t":
        return t.t()
    if link.kind == "qkv":
        return _regroup(t, model_cfg.heads, to_hf=True).t()
    if link.kind == "qkv_bias":
        return _regroup(t, model_cfg.heads, to_hf=True)
    if link.kind == "vocab":
        return t[:model_cfg.vocab_size]
    return t


def from_hf(t: Tensor, link: Link, model_cfg: Any) -> Tensor:
    """HF's tensor in our layout, float32; padded vocab rows zero, ``positions`` already cut to seq_len."""
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
