"""A Llama, Qwen3, Mixtral or Qwen3-MoE folder's config.json as megazero's model keys (``train.init_from``): the
llama spec's reader, handed the typed fields of ``megazero.interop.hf_config`` (every value checked there).

rope_theta and Llama 3.1's scaling (transformers 5's rope_parameters or 4.x's rope_scaling), the attention's
window (compared: megazero's attention is whole), the biases, and a mixture's experts and the layers that are
mixtures (:func:`moe_model`).
"""
from __future__ import annotations

from typing import Any

from megazero.kernels.errors import UserError
from megazero.models.hf import HfFields
from megazero.models.llama_hf import MIXTURES, QK_NORM

MIXTRAL, QWEN3_MOE = MIXTURES
LLAMA3_KEYS = (("factor", "rope_factor", float), ("low_freq_factor", "rope_low_freq_factor", float),
               ("high_freq_factor", "rope_high_freq_factor", float),
               ("original_max_position_embeddings", "rope_original_positions", int))


def show(value: Any) -> str:
    """A value as megazero's config spells it (true/false lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def read(raw: dict, f: HfFields, kind: str) -> dict[str, Any]:
    """The folder's model (HF model_type ``kind``) in megazero's keys, with what is compared besides:
    ``hf_type``, a ``sliding_window``, the MoE ``layers``."""
    hidden, heads = f.get("hidden_size", int), f.get("num_attention_heads", int)
    # model.head_dim: config.json's, else Qwen3's default 128, else hidden/heads
    head_dim = f.get("head_dim", int) if raw.get("head_dim") is not None else (128 if kind == QK_NORM[0] else
                                                                                hidden // heads)
    layers = f.get("num_hidden_layers", int)
    out = {"arch": "llama", "hf_type": kind, "layers": layers, "hidden": hidden, "heads": heads,
           "kv_heads": f.get("num_key_value_heads", int, heads), "head_dim": head_dim, "vocab_size": f.get("vocab_size", int),
           "norm_eps": f.get("rms_norm_eps", float, 1e-6), **_rope(raw, f),
           "tie_embeddings": f.get("tie_word_embeddings", bool, False), "qk_norm": kind in QK_NORM,
           **_window(raw, f, kind)}
    if kind in MIXTURES:
        out.update(moe_model(raw, f, kind, layers))
    else:
        out.update(ffn_hidden=f.get("intermediate_size", int), moe={"experts": 0})
    # Llama's biases are two keys; Mixtral has none, Qwen3's MLPs none (a Qwen3-MoE without dense layers: its
    # attention's bias is all of megazero's model.bias)
    attn_bias = f.get("attention_bias", bool, False) if kind != MIXTRAL else False
    mlp_bias = f.get("mlp_bias", bool, False) if kind not in (*MIXTURES, *QK_NORM) else False
    if kind == QWEN3_MOE and "ffn_hidden" not in out:
        mlp_bias = attn_bias
    out["bias"] = attn_bias if attn_bias == mlp_bias else f"attention_bias={show(attn_bias)}, mlp_bias={show(mlp_bias)}"
    return out


def _rope(raw: dict, f: HfFields) -> dict[str, Any]:
    """rope_theta and the scaling, in megazero's keys, from transformers 5's rope_parameters or 4.x's top level
    and rope_scaling: none ('default') or Llama 3.1's 'llama3'; any other scaling is refused."""
    out: dict[str, Any] = {"rope_theta": f.get("rope_theta", float, 10000.0), "rope_scaling": "none"}
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"{f.where}: config.json {key}={f.shown(value)} is invalid; expected a JSON object "
                            f"such as {{\"rope_type\": \"llama3\", \"factor\": 8.0, ...}}, or null (no scaling)")
        kind = value.get("rope_type")
        kind = value.get("type", "default") if kind is None else kind  # 4.x's older name of the key
        if any(isinstance(v, dict) for v in value.values()):
            kind = "per layer type"
        if kind not in ("default", "llama3"):
            raise UserError(f"{f.where}: config.json {key} has rope type {f.shown(kind)}; megazero's rotary "
                            f"embedding scales only as Llama 3.1 does: valid: none, 'default' or 'llama3'")
        fields = f.nested(value, f"{key}.")
        if value.get("rope_theta") is not None:
            out["rope_theta"] = fields.get("rope_theta", float)
        if kind == "llama3":
            out["rope_scaling"] = "llama3"
            out.update({ours: fields.get(theirs, kind_of) for theirs, ours, kind_of in LLAMA3_KEYS})
    return out


def _window(raw: dict, f: HfFields, kind: str) -> dict[str, int]:
    """{"sliding_window": w} when attention sees only the last w tokens (Mixtral's sliding_window; Qwen3's with
    use_sliding_window), else {}: megazero's attention is whole, the same up to a sequence of w tokens."""
    if kind not in (MIXTRAL, *QK_NORM) or (kind in QK_NORM and not f.get("use_sliding_window", bool, False)):
        return {}
    if raw.get("sliding_window", 4096 if kind in QK_NORM else None) is None:  # Mixtral's default: none
        return {}
    return {"sliding_window": f.get("sliding_window", int, 4096)}


def _expert_count(raw: dict, f: HfFields, kind: str) -> int:
    """num_local_experts (transformers 5 writes it for both) or num_experts (Qwen3-MoE's older name); both given
    must agree."""
    given = {k: f.get(k, int) for k in ("num_local_experts", "num_experts") if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise UserError(f"{f.where}: config.json num_local_experts={given['num_local_experts']} and num_experts="
                        f"{given['num_experts']} disagree; the folder does not say how many experts it holds")
    return next(iter(given.values()), 8 if kind == MIXTRAL else 128)


def _sparse_layers(raw: dict, f: HfFields, layers: int) -> list[int]:
    """Qwen3-MoE's mixture-of-experts layers: i not in mlp_only_layers with (i + 1) % decoder_sparse_step == 0."""
    step = f.get("decoder_sparse_step", int, 1)
    only = raw.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in only):
        raise UserError(f"{f.where}: config.json mlp_only_layers={f.shown(only)} is invalid; expected a list of layer "
                        f"indices (integers >= 0)")
    return [i for i in range(layers) if i not in only and (i + 1) % step == 0]


def _placement(sparse: list[int], layers: int, where: str) -> tuple[int, int]:
    """(model.moe.dense_layers, every) that make exactly ``sparse`` the mixture-of-experts layers."""
    if not sparse:
        raise UserError(f"{where}: config.json (mlp_only_layers, decoder_sparse_step) leaves no mixture-of-experts "
                        f"layer among the {layers}; a dense model is a Llama or Qwen3 folder")
    first = sparse[0]
    every = sparse[1] - first if len(sparse) > 1 else layers - first
    if sparse != list(range(first, layers, every)):
        raise UserError(f"{where}: config.json (mlp_only_layers, decoder_sparse_step) makes layers {sparse} "
                        f"mixtures of experts; megazero places them as model.moe.dense_layers dense layers, then "
                        f"one every model.moe.every layers to the last")
    return first, every


def moe_model(raw: dict, f: HfFields, kind: str, layers: int) -> dict[str, Any]:
    """A Mixtral or Qwen3-MoE folder's ffn_hidden (where it has dense layers) and model.moe, with the layers
    that are mixtures of experts (``layers``, compared as a set: other dense_layers/every may place the same);
    ``norm_topk_prob`` None where megazero's routing does not depend on it (top-1)."""
    top_k = f.get("num_experts_per_tok", int, 2 if kind == MIXTRAL else 8)
    if kind == MIXTRAL:  # every layer; the experts are intermediate_size wide; the top k always renormalised
        sparse, width, norm, out = list(range(layers)), f.get("intermediate_size", int), True, {}
    else:
        sparse, width = _sparse_layers(raw, f, layers), f.get("moe_intermediate_size", int, 768)
        norm = f.get("norm_topk_prob", bool, False)
        out = {"ffn_hidden": f.get("intermediate_size", int, 6144)} if len(sparse) < layers else {}
    if top_k == 1 and norm:
        raise UserError(f"{f.where}: config.json num_experts_per_tok=1 with renormalised gates "
                        f"({'Mixtral' if kind == MIXTRAL else 'norm_topk_prob=true'}) gives each token its "
                        f"expert's whole output (gate 1); megazero's top-1 gate is the router's probability")
    dense, every = _placement(sparse, layers, f.where)
    out["moe"] = {"experts": _expert_count(raw, f, kind), "top_k": top_k, "expert_hidden": width,
                  "shared_experts": 0, "dense_layers": dense, "every": every, "router": "softmax",
                  "norm_topk_prob": None if top_k == 1 else norm, "routed_scaling_factor": 1.0,
                  "layers": tuple(sparse)}
    return out
