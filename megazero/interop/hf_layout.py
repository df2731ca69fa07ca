"""Where each megazero parameter lives in a Hugging Face folder, and how its layout differs: GPT-2, Llama, Qwen3
(Llama with ``model.qk_norm``), and the mixtures of experts Mixtral and Qwen3-MoE (``model.moe``).

One table serves both directions (``megazero.interop.export`` writes it, ``megazero.interop.hf_import`` reads it), so an
export and an import cannot drift apart. A :class:`Link` names the HF tensor of one megazero parameter and
the one layout change between them:

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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from megazero.config.schema import ModelConfig, MoeConfig
from megazero.errors import UserError

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
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # model.qk_norm (Qwen3)
    "attn.k_norm.weight": "self_attn.k_norm.weight",
})
MOE_BLOCK = MappingProxyType({  # a mixture-of-experts layer's MLP: ours under layers.{i}.mlp. -> HF's under model.layers.{i}.
    "mixtral": MappingProxyType({"router.weight": "block_sparse_moe.gate.weight",
                                 "experts.gate": "block_sparse_moe.experts.{e}.w1.weight",
                                 "experts.up": "block_sparse_moe.experts.{e}.w3.weight",
                                 "experts.down": "block_sparse_moe.experts.{e}.w2.weight"}),
    "qwen3_moe": MappingProxyType({"router.weight": "mlp.gate.weight",
                                   "experts.gate": "mlp.experts.{e}.gate_proj.weight",
                                   "experts.up": "mlp.experts.{e}.up_proj.weight",
                                   "experts.down": "mlp.experts.{e}.down_proj.weight"}),
})
STACKED = MappingProxyType({  # transformers 5's module names (module doc): ours -> (its name, which half of it)
    "router.weight": ("mlp.gate.weight", -1), "experts.gate": ("mlp.experts.gate_up_proj", 0),
    "experts.up": ("mlp.experts.gate_up_proj", 1), "experts.down": ("mlp.experts.down_proj", -1)})
HF_ARCHITECTURES = MappingProxyType({"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                     "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"})


@dataclass(frozen=True)
class Link:
    """One megazero parameter: its full shape here, its HF tensor name, and the layout change (module doc);
    ``alt``: transformers 5's own name of it, where a folder may hold that instead (``experts``: their stack,
    ``part`` 0 or 1 the gate or up half of a stacked gate_up, -1 all of it)."""

    shape: tuple[int, ...]
    hf: str
    kind: str = "copy"
    alt: str = ""
    part: int = -1


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


def hf_type(m: Any, where: str = "the model config") -> str:
    """The Hugging Face model_type a resolved config is written as: gpt2; llama, or qwen3 with model.qk_norm;
    with model.moe, mixtral (no qk_norm) or qwen3_moe (qk_norm). What neither mixture holds (shared experts,
    the sigmoid router, scaled gates, Mixtral's dense layers, a biased MLP) is refused, naming the key."""
    if m.arch == "gpt2":
        return "gpt2"
    moe = m.moe
    if not moe.experts:
        if m.qk_norm and m.bias:
            raise UserError(f"{where}: model.bias=true with model.qk_norm=true cannot be written as Hugging Face's "
                            f"Qwen3ForCausalLM (the one class with q/k norms), whose MLPs have no biases")
        return "qwen3" if m.qk_norm else "llama"
    kind = "qwen3_moe" if m.qk_norm else "mixtral"
    dense = [i for i in range(m.layers) if not moe.is_moe_layer(i)]
    refusals = (("shared_experts", moe.shared_experts, moe.shared_experts != 0, "0 (neither has shared experts)"),
                ("router", moe.router, moe.router != "softmax", "softmax"),
                ("routed_scaling_factor", moe.routed_scaling_factor, moe.routed_scaling_factor != 1.0, "1.0"),
                ("norm_topk_prob", moe.norm_topk_prob, kind == "mixtral" and moe.top_k > 1 and not moe.norm_topk_prob,
                 "true (Mixtral renormalises the top k; Qwen3-MoE, with model.qk_norm=true, may not)"),
                ("top_k", moe.top_k, kind == "mixtral" and moe.top_k == 1,
                 "> 1 (Mixtral renormalises a single gate to 1, megazero's top-1 gate is the router's probability; "
                 "Qwen3-MoE, with model.qk_norm=true, keeps it)"),
                ("dense_layers" if moe.dense_layers else "every", moe.dense_layers or moe.every,
                 kind == "mixtral" and bool(dense), "0 and every=1 (every Mixtral layer is a mixture of experts; "
                 "Qwen3-MoE, with model.qk_norm=true, has dense layers)"))
    for key, value, bad, valid in refusals:
        if bad:
            raise UserError(f"{where}: model.moe.{key}={_shown(value)} cannot be written as a Hugging Face "
                            f"Mixtral or Qwen3-MoE model; valid: {valid}")
    if m.bias and (kind == "mixtral" or dense):
        raise UserError(f"{where}: model.bias=true cannot be written as {HF_ARCHITECTURES[kind]}, whose "
                        f"{'layers have' if kind == 'mixtral' else 'dense MLPs have'} no biases")
    return kind


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _block_shapes(m: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """A block's parameters but a mixture of experts' (:func:`_moe_links`)."""
    h, f = m.hidden, m.ffn_hidden
    if m.arch == "llama":
        q, kv = m.heads * m.head_width, m.kv_head_count * m.head_width
        out = {"ln1.weight": (h,), "attn.q.weight": (q, h), "attn.k.weight": (kv, h), "attn.v.weight": (kv, h),
               "attn.proj.weight": (h, q), "ln2.weight": (h,), "mlp.gate.weight": (f, h),
               "mlp.up.weight": (f, h), "mlp.down.weight": (h, f)}
        if m.qk_norm:
            out.update({"attn.q_norm.weight": (m.head_width,), "attn.k_norm.weight": (m.head_width,)})
        biases = {"attn.q.bias": (q,), "attn.k.bias": (kv,), "attn.v.bias": (kv,), "attn.proj.bias": (h,),
                  "mlp.gate.bias": (f,), "mlp.up.bias": (f,), "mlp.down.bias": (h,)}
        if m.moe.is_moe_layer(layer):
            out, biases = ({k: v for k, v in d.items() if not k.startswith("mlp.")} for d in (out, biases))
    else:
        out = {"ln1.weight": (h,), "attn.qkv.weight": (3 * h, h), "attn.proj.weight": (h, h),
               "ln2.weight": (h,), "mlp.fc1.weight": (f, h), "mlp.fc2.weight": (h, f)}
        biases = {"ln1.bias": (h,), "attn.qkv.bias": (3 * h,), "attn.proj.bias": (h,), "ln2.bias": (h,),
                  "mlp.fc1.bias": (f,), "mlp.fc2.bias": (h,)}
    return {**out, **biases} if m.bias else out


def _moe_links(m: ModelConfig, layer: int, kind: str) -> dict[str, Link]:
    """Layer ``layer``'s router and stacked experts, in the names of HF model_type ``kind``."""
    E, h, f = m.moe.experts, m.hidden, m.moe.expert_hidden or m.ffn_hidden
    where, ours = f"model.layers.{layer}.", f"layers.{layer}.mlp."
    shapes = {"router.weight": (E, h), "experts.gate": (E, f, h), "experts.up": (E, f, h), "experts.down": (E, h, f)}
    out = {}
    for name, shape in shapes.items():
        hf, (alt, part) = where + MOE_BLOCK[kind][name], STACKED[name]
        out[ours + name] = Link(shape, hf, "experts" if "{e}" in hf else "copy",
                                alt="" if where + alt == hf else where + alt, part=part)
    return out


def expert_keys(link: Link) -> list[str]:
    """The HF names of an ``experts`` link's E tensors, expert 0 first."""
    assert link.kind == "experts", link
    return [link.hf.format(e=e) for e in range(link.shape[0])]


def links(model_cfg: Any, kind: str | None = None) -> dict[str, Link]:
    """Every parameter of the whole model (all stages, tp=1 shapes; an expert stack whole) -> its :class:`Link`,
    for a resolved config (see :func:`model_config`) written as HF model_type ``kind`` (default
    :func:`hf_type`'s)."""
    m = model_cfg
    kind = hf_type(m) if kind is None else kind
    h, tied = m.hidden, bool(m.tie_embeddings)
    vocab = (m.padded_vocab, h)
    out: dict[str, Link] = {}
    if m.arch == "llama":
        out["embed.tokens.weight"] = Link(vocab, "model.embed_tokens.weight", "vocab")
        for i in range(m.layers):
            for name, shape in _block_shapes(m, i).items():
                module, _, part = name.rpartition(".")
                hf = LLAMA_BLOCK[module + ".weight"].removesuffix(".weight") + "." + part
                out[f"layers.{i}.{name}"] = Link(shape, f"model.layers.{i}.{hf}")
            if m.moe.is_moe_layer(i):
                out.update(_moe_links(m, i, kind))
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


def hf_tensors(t: Tensor, link: Link, model_cfg: Any) -> dict[str, Tensor]:
    """Our full tensor as the HF tensors it is written as: one, or an expert stack's E."""
    if link.kind == "experts":
        return dict(zip(expert_keys(link), t.unbind(0)))
    return {link.hf: to_hf(t, link, model_cfg)}


def to_hf(t: Tensor, link: Link, model_cfg: Any) -> Tensor:
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


def from_hf(t: Tensor, link: Link, model_cfg: Any) -> Tensor:
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
