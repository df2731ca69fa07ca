"""Llama's Hugging Face tables: the tensor names of LlamaForCausalLM, Qwen3ForCausalLM (``model.qk_norm``), and
the mixtures of experts MixtralForCausalLM and Qwen3MoeForCausalLM (``model.moe``, without or with q/k norms);
which of them a config is written as, and their config.json keys (read back by ``models.llama_hf_read``).

Every Llama weight is a ``copy`` (our rotary embedding uses HF's halves layout and frequencies, so q and k need
no permutation); an expert stack (E, out, in) is E HF tensors (``{e}`` in the name), as save_pretrained writes
them, or transformers 5's own stacked modules (``Link.alt``), which from_pretrained also reads.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from megazero.kernels.errors import UserError
from megazero.models.hf import Link

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

BLOCK = MappingProxyType({  # ours -> HF suffix under model.layers.{i}.; every kind is copy
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
CLASSES = MappingProxyType({"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"})
TITLES = MappingProxyType({"llama": "Llama", "qwen3": "Qwen3", "mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"})
QK_NORM = ("qwen3", "qwen3_moe")  # the model_types with q/k norms (model.qk_norm)
MIXTURES = ("mixtral", "qwen3_moe")  # the model_types with mixtures of experts (model.moe)


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_type(m: "ModelConfig", where: str = "the model config") -> str:
    """llama, or qwen3 with model.qk_norm; with model.moe, mixtral (no qk_norm) or qwen3_moe (qk_norm). What
    neither mixture holds (shared experts, the sigmoid router, scaled gates, Mixtral's dense layers, a biased MLP)
    is refused, naming the key."""
    moe = m.moe
    if not moe.experts:
        if m.qk_norm and m.bias:
            raise UserError(f"{where}: model.bias=true with model.qk_norm=true cannot be written as Hugging Face's "
                            f"Qwen3ForCausalLM (the one class with q/k norms), whose MLPs have no biases")
        return QK_NORM[0] if m.qk_norm else "llama"
    kind = MIXTURES[1] if m.qk_norm else MIXTURES[0]
    mixtral = kind == MIXTURES[0]
    dense = [i for i in range(m.layers) if not moe.is_moe_layer(i)]
    refusals = (("shared_experts", moe.shared_experts, moe.shared_experts != 0, "0 (neither has shared experts)"),
                ("router", moe.router, moe.router != "softmax", "softmax"),
                ("routed_scaling_factor", moe.routed_scaling_factor, moe.routed_scaling_factor != 1.0, "1.0"),
                ("norm_topk_prob", moe.norm_topk_prob, mixtral and moe.top_k > 1 and not moe.norm_topk_prob,
                 "true (Mixtral renormalises the top k; Qwen3-MoE, with model.qk_norm=true, may not)"),
                ("top_k", moe.top_k, mixtral and moe.top_k == 1,
                 "> 1 (Mixtral renormalises a single gate to 1, megazero's top-1 gate is the router's probability; "
                 "Qwen3-MoE, with model.qk_norm=true, keeps it)"),
                ("dense_layers" if moe.dense_layers else "every", moe.dense_layers or moe.every,
                 mixtral and bool(dense), "0 and every=1 (every Mixtral layer is a mixture of experts; "
                 "Qwen3-MoE, with model.qk_norm=true, has dense layers)"))
    for key, value, bad, valid in refusals:
        if bad:
            raise UserError(f"{where}: model.moe.{key}={_shown(value)} cannot be written as a Hugging Face "
                            f"Mixtral or Qwen3-MoE model; valid: {valid}")
    if m.bias and (mixtral or dense):
        raise UserError(f"{where}: model.bias=true cannot be written as {CLASSES[kind]}, whose "
                        f"{'layers have' if mixtral else 'dense MLPs have'} no biases")
    return kind


def _block_shapes(m: "ModelConfig", layer: int) -> dict[str, tuple[int, ...]]:
    """A block's parameters but a mixture of experts' (:func:`_moe_links`)."""
    h, f = m.hidden, m.ffn_hidden
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
    return {**out, **biases} if m.bias else out


def _moe_links(m: "ModelConfig", layer: int, kind: str) -> dict[str, Link]:
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


def links(m: "ModelConfig", kind: str) -> dict[str, Link]:
    """Every parameter of a resolved config -> its tensor in HF model_type ``kind``."""
    h = m.hidden
    out = {"embed.tokens.weight": Link((m.padded_vocab, h), "model.embed_tokens.weight", "vocab")}
    for i in range(m.layers):
        for name, shape in _block_shapes(m, i).items():
            module, _, part = name.rpartition(".")
            hf = BLOCK[module + ".weight"].removesuffix(".weight") + "." + part
            out[f"layers.{i}.{name}"] = Link(shape, f"model.layers.{i}.{hf}")
        if m.moe.is_moe_layer(i):
            out.update(_moe_links(m, i, kind))
    out["final_norm.weight"] = Link((h,), "model.norm.weight")
    return out


def config(m: "ModelConfig", kind: str) -> dict:
    """Llama's keys, and Qwen3's, Mixtral's or Qwen3-MoE's (``kind``). Unknown bos/eos ids are written as null:
    left out, transformers would assume Llama 2's 1 and 2. rope_theta is written both ways: transformers 5 reads
    rope_parameters, 4.x the top-level key. Attention is never windowed."""
    theta = float(m.rope_theta)
    scaling = None
    if m.rope_scaling == "llama3":  # Llama 3.1's long-context frequencies
        scaling = {"rope_type": "llama3", "factor": float(m.rope_factor),
                   "low_freq_factor": float(m.rope_low_freq_factor), "high_freq_factor": float(m.rope_high_freq_factor),
                   "original_max_position_embeddings": int(m.rope_original_positions)}
    out = {"hidden_size": m.hidden, "intermediate_size": m.ffn_hidden, "num_hidden_layers": m.layers,
           "num_attention_heads": m.heads, "num_key_value_heads": m.kv_head_count, "head_dim": m.head_width,
           "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": float(m.norm_eps),
           "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
           "rope_scaling": scaling, "attention_dropout": 0.0, "use_cache": True}
    if kind == "llama":
        return {**out, "attention_bias": bool(m.bias), "mlp_bias": bool(m.bias), "pretraining_tp": 1}
    out["sliding_window"] = None
    if kind in QK_NORM:
        out.update(attention_bias=bool(m.bias), use_sliding_window=False, max_window_layers=m.layers)
    if kind not in MIXTURES:
        return out
    moe = m.moe
    width = moe.expert_hidden or m.ffn_hidden
    out.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=float(moe.aux_loss), output_router_logits=False)
    if kind == MIXTURES[0]:  # Mixtral: every layer a mixture of experts intermediate_size wide, the top k renormalised
        return {**out, "intermediate_size": width, "num_local_experts": moe.experts, "router_jitter_noise": 0.0}
    return {**out, "num_experts": moe.experts, "moe_intermediate_size": width, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.layers) if not moe.is_moe_layer(i)],
            "norm_topk_prob": bool(moe.norm_topk_prob) and moe.top_k > 1}  # top-1: megazero's gate is the probability


def buffers(m: "ModelConfig") -> list[str]:
    """Rotary inverse frequencies older conversions saved: per layer, or once per model."""
    return [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(m.layers)] + ["model.rotary_emb.inv_freq"]
