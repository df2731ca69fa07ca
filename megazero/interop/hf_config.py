"""A Hugging Face folder's config.json, read as megazero's model keys (for ``train.init_from``).

The folder is untrusted: config.json is parsed as plain JSON (bounded size) and only the keys listed here are
read, each type- and range-checked before it is used, nested objects (``rope_scaling``, ``rope_parameters``)
included: a value of the wrong type is one line naming the file and the key, never an AttributeError.

GPT-2, Llama, Qwen3 (Llama with q/k norms: ``model.qk_norm``), Mixtral and Qwen3-MoE (``model.moe``) are read,
each by its architecture's spec (``ModelSpec.hf.read``: ``models.gpt2_spec``, ``models.llama_hf_read``) through
the typed fields here; DeepSeek's folders are refused (their multi-head latent attention
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
from megazero.models.llama_hf_read import LLAMA3_KEYS, show  # noqa: F401 (hf_compare and the tests read them here)
from megazero.models.registry import hf_titles, spec_of_hf

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB
_ARCH_CLASSES = MappingProxyType({v: k for k, v in HF_ARCHITECTURES.items()})


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

    def shown(self, value: Any) -> str:
        """An untrusted value as a message echoes it (``megazero.errors.shown``)."""
        return shown(value)

    def nested(self, raw: dict, prefix: str) -> "_Fields":
        """The fields of a nested object (``rope_scaling``), its key the prefix of every message."""
        return _Fields(raw, self.where, prefix=prefix)


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
    names = hf_titles()
    valid = ", ".join(f"{names[t]} ({t}, {c})" for t, c in HF_ARCHITECTURES.items())
    raise UserError(f"{where}: the folder holds a model of {what}, which megazero cannot read; valid: {valid}")


def folder_model(raw: Any, where: str) -> dict[str, Any]:
    """The folder's model in megazero's keys, from the keys HF's config reads (its architecture's spec reads
    them: ``ModelSpec.hf.read``), and what is compared besides: ``hf_type`` (its model_type), GPT-2's
    ``n_positions``, a ``sliding_window``, the MoE ``layers``."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: config.json holds {shown(raw)}; expected a JSON object")
    kind = architecture(raw, where)
    f = _Fields(raw, where)
    hf = spec_of_hf(kind).hf
    act_key, valid = hf.activation
    act = f.get(act_key, str, valid[0])
    if act not in valid:
        raise UserError(f"{where}: config.json {act_key}={shown(act)} is not supported; valid: "
                        f"{' | '.join(valid)}")
    return hf.read(raw, f, kind)
