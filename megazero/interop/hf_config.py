"""A Hugging Face folder's config.json, read as megazero's model keys (for ``train.init_from``).

The folder is untrusted: config.json is parsed as plain JSON (bounded size) and only the keys listed here are
read, each type- and range-checked before it is used, nested objects (``rope_scaling``, ``rope_parameters``)
included: a value of the wrong type is one line naming the file and the key, never an AttributeError.

GPT-2, Llama, Qwen3 (Llama with q/k norms: ``model.qk_norm``), Mixtral and Qwen3-MoE (``model.moe``:
:func:`moe_model`) are read; DeepSeek's folders are refused (their multi-head latent attention
is not megazero's). Keys that are HF's training or output settings, not the model's, are not read: dropout,
``router_aux_loss_coef`` (HF's own balancing loss over the whole batch, added only with
``output_router_logits``: set megazero's ``model.moe.aux_loss`` for a run), ``output_router_logits``,
``router_jitter_noise`` (Mixtral's multiplicative noise on the router's input in training).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any

from megazero.errors import UserError, shown, shown_name
from megazero.interop.hf_layout import HF_ARCHITECTURES

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB
_ARCH_CLASSES = MappingProxyType({v: k for k, v in HF_ARCHITECTURES.items()})
_ACTIVATIONS = MappingProxyType({"gpt2": ("gelu_new", "gelu_pytorch_tanh"), "llama": ("silu", "swish")})
QWEN3 = ("qwen3", "qwen3_moe")  # the model_types with q/k norms (model.qk_norm)
LLAMA3_KEYS = (("factor", "rope_factor", float), ("low_freq_factor", "rope_low_freq_factor", float),
               ("high_freq_factor", "rope_high_freq_factor", float),
               ("original_max_position_embeddings", "rope_original_positions", int))


def where(folder: Path) -> str:
    """How a message about the folder begins."""
    return f"train.init_from {shown_name(str(folder))}"


def read_json(path: Path, limit: int, where: str) -> Any:
    """The parsed JSON of a file of at most ``limit`` bytes; anything else is one line."""
    try:
        if not path.is_file():
            raise UserError(f"{where}: no {path.name}; expected a Hugging Face model folder (config.json and "
                            f"*.safetensors)")
        if path.stat().st_size > limit:
            raise UserError(f"{where}: {path.name} is {path.stat().st_size} bytes; at most {limit}")
        return json.loads(path.read_bytes())
    except OSError as e:
        raise UserError(f"{where}: {path.name} is unreadable ({e.strerror or e})") from None
    except (ValueError, RecursionError):
        raise UserError(f"{where}: {path.name} is not valid JSON") from None


def _is_number(v: Any) -> bool:
    """A JSON number that is a finite float: a 400-digit integer is none (float() would overflow)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


_KINDS = MappingProxyType({  # what a config.json value of each type must be, and how a message says it
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2 ** 40,
          "a positive integer below 2^40"),
    float: (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: isinstance(v, str), "a string"),
})


class _Fields:
    """Typed, range-checked reads of one JSON object's keys (``prefix``: its key in config.json, for a nested
    object); an absent key (or null) takes HF's documented default, and one without a default (None) is
    required."""

    def __init__(self, raw: dict, where: str, prefix: str = ""):
        assert isinstance(raw, dict), type(raw)
        self.raw, self.where, self.prefix = raw, where, prefix

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.raw.get(key)
        ok, valid = _KINDS[kind]
        if value is None:
            if default is None:
                raise UserError(f"{self.where}: config.json has no {self.prefix}{key}; expected {valid}")
            return default
        if not ok(value):
            raise UserError(f"{self.where}: config.json {self.prefix}{key}={shown(value)} is invalid; "
                            f"expected {valid}")
        return float(value) if kind is float else value


def architecture(raw: dict, where: str) -> str:
    """The folder's HF model_type (one of ``HF_ARCHITECTURES``), from model_type or architectures."""
    model_type, classes = raw.get("model_type"), raw.get("architectures")
    if isinstance(model_type, str) and model_type in HF_ARCHITECTURES:
        return model_type
    first = classes[0] if isinstance(classes, list) and classes and isinstance(classes[0], str) else None
    if model_type is None and first in _ARCH_CLASSES:
        return _ARCH_CLASSES[first]
    what = f"model_type {shown(model_type)}" if model_type is not None else f"architectures {shown(classes)}"
    name = model_type if isinstance(model_type, str) else first if model_type is None else None
    if isinstance(name, str) and name.lower().startswith("deepseek"):
        raise UserError(f"{where}: the folder holds a DeepSeek model ({what}): its multi-head latent attention is "
                        f"not supported by megazero (its router and shared experts are: model.moe.router=sigmoid, "
                        f"model.moe.shared_experts, on Llama attention)")
    names = {"gpt2": "GPT-2", "llama": "Llama", "qwen3": "Qwen3", "mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}
    valid = ", ".join(f"{names[t]} ({t}, {c})" for t, c in HF_ARCHITECTURES.items())
    raise UserError(f"{where}: the folder holds a model of {what}, which megazero cannot read; valid: {valid}")


def _rope(raw: dict, f: _Fields) -> dict[str, Any]:
    """rope_theta and the scaling, in megazero's keys, from transformers 5's rope_parameters or 4.x's top level
    and rope_scaling: none ('default') or Llama 3.1's 'llama3'; any other scaling is refused."""
    out: dict[str, Any] = {"rope_theta": f.get("rope_theta", float, 10000.0), "rope_scaling": "none"}
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"{f.where}: config.json {key}={shown(value)} is invalid; expected a JSON object "
                            f"such as {{\"rope_type\": \"llama3\", \"factor\": 8.0, ...}}, or null (no scaling)")
        kind = value.get("rope_type")
        kind = value.get("type", "default") if kind is None else kind  # 4.x's older name of the key
        if any(isinstance(v, dict) for v in value.values()):
            kind = "per layer type"
        if kind not in ("default", "llama3"):
            raise UserError(f"{f.where}: config.json {key} has rope type {shown(kind)}; megazero's rotary "
                            f"embedding scales only as Llama 3.1 does: valid: none, 'default' or 'llama3'")
        fields = _Fields(value, f.where, prefix=f"{key}.")
        if value.get("rope_theta") is not None:
            out["rope_theta"] = fields.get("rope_theta", float)
        if kind == "llama3":
            out["rope_scaling"] = "llama3"
            out.update({ours: fields.get(theirs, kind_of) for theirs, ours, kind_of in LLAMA3_KEYS})
    return out


def show(value: Any) -> str:
    """A value as megazero's config spells it (true/false lower case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def folder_model(raw: Any, where: str) -> dict[str, Any]:
    """The folder's model in megazero's keys, from the keys HF's config reads, and what is compared besides:
    ``hf_type`` (its model_type), GPT-2's ``n_positions``, a ``sliding_window``, the MoE ``layers``."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: config.json holds {shown(raw)}; expected a JSON object")
    arch = architecture(raw, where)
    f = _Fields(raw, where)
    family = "gpt2" if arch == "gpt2" else "llama"
    act_key = "hidden_act" if family == "llama" else "activation_function"
    act = f.get(act_key, str, _ACTIVATIONS[family][0])
    if act not in _ACTIVATIONS[family]:
        raise UserError(f"{where}: config.json {act_key}={shown(act)} is not supported; valid: "
                        f"{' | '.join(_ACTIVATIONS[family])}")
    if arch == "gpt2":
        hidden = f.get("n_embd", int)
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if f.get(key, bool, want) != want:
                raise UserError(f"{where}: config.json {key}={str(not want).lower()} is not supported; "
                                f"megazero's attention needs {str(want).lower()}")
        return {"arch": "gpt2", "layers": f.get("n_layer", int), "hidden": hidden, "heads": f.get("n_head", int),
                "kv_heads": f.get("n_head", int), "ffn_hidden": f.get("n_inner", int, 4 * hidden),
                "vocab_size": f.get("vocab_size", int), "norm_eps": f.get("layer_norm_epsilon", float, 1e-5),
                "tie_embeddings": f.get("tie_word_embeddings", bool, True), "bias": True,
                "n_positions": f.get("n_positions", int, f.get("n_ctx", int, 1024))}
    hidden, heads = f.get("hidden_size", int), f.get("num_attention_heads", int)
    # model.head_dim: config.json's, else Qwen3's default 128, else hidden/heads
    head_dim = f.get("head_dim", int) if raw.get("head_dim") is not None else (128 if arch == "qwen3" else
                                                                                hidden // heads)
    layers = f.get("num_hidden_layers", int)
    out = {"arch": "llama", "hf_type": arch, "layers": layers, "hidden": hidden, "heads": heads,
           "kv_heads": f.get("num_key_value_heads", int, heads), "head_dim": head_dim, "vocab_size": f.get("vocab_size", int),
           "norm_eps": f.get("rms_norm_eps", float, 1e-6), **_rope(raw, f),
           "tie_embeddings": f.get("tie_word_embeddings", bool, False), "qk_norm": arch in QWEN3,
           **_window(raw, f, arch)}
    if arch in ("mixtral", "qwen3_moe"):
        out.update(moe_model(raw, f, arch, layers))
    else:
        out.update(ffn_hidden=f.get("intermediate_size", int), moe={"experts": 0})
    # Llama's biases are two keys; Mixtral has none, Qwen3's MLPs none (a Qwen3-MoE without dense layers: its
    # attention's bias is all of megazero's model.bias)
    attn_bias = f.get("attention_bias", bool, False) if arch != "mixtral" else False
    mlp_bias = f.get("mlp_bias", bool, False) if arch == "llama" else False
    if arch == "qwen3_moe" and "ffn_hidden" not in out:
        mlp_bias = attn_bias
    out["bias"] = attn_bias if attn_bias == mlp_bias else f"attention_bias={show(attn_bias)}, mlp_bias={show(mlp_bias)}"
    return out


def _window(raw: dict, f: _Fields, arch: str) -> dict[str, int]:
    """{"sliding_window": w} when attention sees only the last w tokens (Mixtral's sliding_window; Qwen3's with
    use_sliding_window), else {}: megazero's attention is whole, the same up to a sequence of w tokens."""
    if arch not in ("mixtral", *QWEN3) or (arch in QWEN3 and not f.get("use_sliding_window", bool, False)):
        return {}
    if raw.get("sliding_window", 4096 if arch in QWEN3 else None) is None:  # Mixtral's default: none
        return {}
    return {"sliding_window": f.get("sliding_window", int, 4096)}



def _expert_count(raw: dict, f: _Fields, arch: str) -> int:
    """num_local_experts (transformers 5 writes it for both) or num_experts (Qwen3-MoE's older name); both given
    must agree."""
    given = {k: f.get(k, int) for k in ("num_local_experts", "num_experts") if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise UserError(f"{f.where}: config.json num_local_experts={given['num_local_experts']} and num_experts="
                        f"{given['num_experts']} disagree; the folder does not say how many experts it holds")
    return next(iter(given.values()), 8 if arch == "mixtral" else 128)


def _sparse_layers(raw: dict, f: _Fields, layers: int) -> list[int]:
    """Qwen3-MoE's mixture-of-experts layers: i not in mlp_only_layers with (i + 1) % decoder_sparse_step == 0."""
    step = f.get("decoder_sparse_step", int, 1)
    only = raw.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in only):
        raise UserError(f"{f.where}: config.json mlp_only_layers={shown(only)} is invalid; expected a list of layer "
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


def moe_model(raw: dict, f: _Fields, arch: str, layers: int) -> dict[str, Any]:
    """A Mixtral or Qwen3-MoE folder's ffn_hidden (where it has dense layers) and model.moe, with the layers
    that are mixtures of experts (``layers``, compared as a set: other dense_layers/every may place the same);
    ``norm_topk_prob`` None where megazero's routing does not depend on it (top-1)."""
    top_k = f.get("num_experts_per_tok", int, 2 if arch == "mixtral" else 8)
    if arch == "mixtral":  # every layer; the experts are intermediate_size wide; the top k always renormalised
        sparse, width, norm, out = list(range(layers)), f.get("intermediate_size", int), True, {}
    else:
        sparse, width = _sparse_layers(raw, f, layers), f.get("moe_intermediate_size", int, 768)
        norm = f.get("norm_topk_prob", bool, False)
        out = {"ffn_hidden": f.get("intermediate_size", int, 6144)} if len(sparse) < layers else {}
    if top_k == 1 and norm:
        raise UserError(f"{f.where}: config.json num_experts_per_tok=1 with renormalised gates "
                        f"({'Mixtral' if arch == 'mixtral' else 'norm_topk_prob=true'}) gives each token its "
                        f"expert's whole output (gate 1); megazero's top-1 gate is the router's probability")
    dense, every = _placement(sparse, layers, f.where)
    out["moe"] = {"experts": _expert_count(raw, f, arch), "top_k": top_k, "expert_hidden": width,
                  "shared_experts": 0, "dense_layers": dense, "every": every, "router": "softmax",
                  "norm_topk_prob": None if top_k == 1 else norm, "routed_scaling_factor": 1.0,
                  "layers": tuple(sparse)}
    return out
