"""A Hugging Face folder's config.json, read as megazero's model keys (for ``train.init_from``).

The folder is untrusted: config.json is parsed as plain JSON (bounded size) and only the keys listed here are
read, each type- and range-checked before it is used, nested objects (``rope_scaling``, ``rope_parameters``)
included: a value of the wrong type is one line naming the file and the key, never an AttributeError.
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
    """megazero's model.arch of the folder (HF's model_type names), from model_type or architectures."""
    model_type, classes = raw.get("model_type"), raw.get("architectures")
    if isinstance(model_type, str) and model_type in HF_ARCHITECTURES:
        return model_type
    if model_type is None and isinstance(classes, list) and classes and isinstance(classes[0], str) \
            and classes[0] in _ARCH_CLASSES:
        return _ARCH_CLASSES[classes[0]]
    what = f"model_type {shown(model_type)}" if model_type is not None else f"architectures {shown(classes)}"
    raise UserError(f"{where}: the folder holds a model of {what}, which megazero cannot read; valid: GPT-2 "
                    f"(gpt2, GPT2LMHeadModel) or Llama (llama, LlamaForCausalLM)")


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
    """The folder's model in megazero's keys (plus n_positions for GPT-2), from the keys HF's config reads."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: config.json holds {shown(raw)}; expected a JSON object")
    arch = architecture(raw, where)
    f = _Fields(raw, where)
    act_key = "hidden_act" if arch == "llama" else "activation_function"
    act = f.get(act_key, str, _ACTIVATIONS[arch][0])
    if act not in _ACTIVATIONS[arch]:
        raise UserError(f"{where}: config.json {act_key}={shown(act)} is not supported; valid: "
                        f"{' | '.join(_ACTIVATIONS[arch])}")
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
    head_dim = f.get("head_dim", int) if raw.get("head_dim") is not None else hidden // heads  # model.head_dim
    attn_bias, mlp_bias = f.get("attention_bias", bool, False), f.get("mlp_bias", bool, False)
    bias = attn_bias if attn_bias == mlp_bias else f"attention_bias={show(attn_bias)}, mlp_bias={show(mlp_bias)}"
    return {"arch": "llama", "layers": f.get("num_hidden_layers", int), "hidden": hidden, "heads": heads,
            "kv_heads": f.get("num_key_value_heads", int, heads), "head_dim": head_dim,
            "ffn_hidden": f.get("intermediate_size", int),
            "vocab_size": f.get("vocab_size", int), "norm_eps": f.get("rms_norm_eps", float, 1e-6),
            **_rope(raw, f), "tie_embeddings": f.get("tie_word_embeddings", bool, False), "bias": bias}
