"""Start a run from a Hugging Face GPT-2 or Llama folder (``train.init_from``).

The folder's config.json must describe the model the run's config does: a run never silently reshapes
a model, so every key that differs is named in one line and the user sets it. The folder is untrusted:
config.json is parsed as plain JSON (bounded size) and only the keys listed here are read, each type- and
range-checked; weights come only from safetensors files (a pickle, ``pytorch_model.bin``, could run code
and is never opened). Every tensor's name, shape and dtype is checked against the config from the file
headers when the folder is opened, so a bad folder fails before a model is built.

:class:`HFWeights` then reads one tensor at a time, on demand, in megazero's layout (``megazero.interop.hf_layout``):
each rank takes what it needs of each parameter, and a model larger than host memory is never whole in it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from megazero.errors import UserError, shown, shown_name
from megazero.checkpoint.architecture import architecture_differences
from megazero.interop.hf_layout import HF_ARCHITECTURES, Link, from_hf, hf_shape, links, model_config

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB
MAX_INDEX_BYTES = 64 << 20  # a sharded index names each tensor once: ~10 MB for the largest models
MAX_SHARDS = 10_000
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_ARCH_CLASSES = MappingProxyType({v: k for k, v in HF_ARCHITECTURES.items()})
_PREFIXES = ("transformer.", "model.")  # older GPT-2 folders store 'h.0...', a bare LlamaModel 'layers.0...'
_ACTIVATIONS = MappingProxyType({"gpt2": ("gelu_new", "gelu_pytorch_tanh"), "llama": ("silu", "swish")})


def _where(folder: Path) -> str:
    return f"train.init_from {shown_name(str(folder))}"


def _read_json(path: Path, limit: int, where: str) -> Any:
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


_KINDS = MappingProxyType({  # what a config.json value of each type must be, and how a message says it
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2 ** 40, "a positive integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
            "a finite number > 0"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: isinstance(v, str), "a string"),
})


class _Fields:
    """Typed, range-checked reads of config.json keys; an absent key (or null) takes HF's documented default,
    and one without a default (None) is required."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.raw.get(key)
        ok, valid = _KINDS[kind]
        if value is None:
            if default is None:
                raise UserError(f"{self.where}: config.json has no {key}; expected {valid}")
            return default
        if not ok(value):
            raise UserError(f"{self.where}: config.json {key}={shown(value)} is invalid; expected {valid}")
        return float(value) if kind is float else value


def _architecture(raw: dict, where: str) -> str:
    model_type, classes = raw.get("model_type"), raw.get("architectures")
    # megazero's model.arch names are HF's model_type names
    if isinstance(model_type, str) and model_type in HF_ARCHITECTURES:
        return model_type
    if model_type is None and isinstance(classes, list) and classes and isinstance(classes[0], str) \
            and classes[0] in _ARCH_CLASSES:
        return _ARCH_CLASSES[classes[0]]
    what = f"model_type {shown(model_type)}" if model_type is not None else f"architectures {shown(classes)}"
    raise UserError(f"{where}: the folder holds a model of {what}, which megazero cannot read; valid: GPT-2 "
                    f"(gpt2, GPT2LMHeadModel) or Llama (llama, LlamaForCausalLM)")


_LLAMA3_KEYS = (("factor", "rope_factor", float), ("low_freq_factor", "rope_low_freq_factor", float),
                ("high_freq_factor", "rope_high_freq_factor", float),
                ("original_max_position_embeddings", "rope_original_positions", int))


def _rope(raw: dict, f: _Fields) -> dict[str, Any]:
    """rope_theta and the scaling, in megazero's keys, from transformers 5's rope_parameters or 4.x's top level
    and rope_scaling: none ('default') or Llama 3.1's 'llama3'; any other scaling is refused."""
    params, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    out: dict[str, Any] = {"rope_theta": f.get("rope_theta", float, 10000.0), "rope_scaling": "none"}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is None:
            continue
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            kind = "per layer type"
        if kind not in ("default", "llama3"):
            raise UserError(f"{f.where}: config.json {key} has rope type {shown(kind)}; megazero's rotary "
                            f"embedding scales only as Llama 3.1 does: valid: none, 'default' or 'llama3'")
        fields = _Fields(value, f.where)
        if "rope_theta" in value:
            out["rope_theta"] = fields.get("rope_theta", float)
        if kind == "llama3":
            out["rope_scaling"] = "llama3"
            out.update({ours: fields.get(theirs, kind_of) for theirs, ours, kind_of in _LLAMA3_KEYS})
    return out


def _hf_model(raw: dict, arch: str, where: str) -> dict[str, Any]:
    """The folder's model in megazero's keys (plus n_positions for GPT-2), from the keys HF's config reads."""
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
    head_dim = raw.get("head_dim")
    if head_dim is not None and (hidden % heads or f.get("head_dim", int) != hidden // heads):
        raise UserError(f"{where}: config.json head_dim={shown(head_dim)} is not hidden_size/num_attention_heads="
                        f"{hidden}/{heads}; megazero's heads are hidden/heads wide")
    attn_bias, mlp_bias = f.get("attention_bias", bool, False), f.get("mlp_bias", bool, False)
    bias = attn_bias if attn_bias == mlp_bias else f"attention_bias={_show(attn_bias)}, mlp_bias={_show(mlp_bias)}"
    return {"arch": "llama", "layers": f.get("num_hidden_layers", int), "hidden": hidden, "heads": heads,
            "kv_heads": f.get("num_key_value_heads", int, heads), "ffn_hidden": f.get("intermediate_size", int),
            "vocab_size": f.get("vocab_size", int), "norm_eps": f.get("rms_norm_eps", float, 1e-6),
            **_rope(raw, f), "tie_embeddings": f.get("tie_word_embeddings", bool, False), "bias": bias}


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_COMPARED = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size", "norm_eps", "rope_theta",
             "tie_embeddings", "bias", "rope_scaling")


def _differences(there: dict[str, Any], m: Any) -> list[str]:
    """'model.KEY is A there and B here' for every key where the folder's model and the config differ."""
    out = []
    order = (*_COMPARED, *(ours for _, ours, _ in _LLAMA3_KEYS))  # a mismatch's keys in the order users know
    shared = {k: there[k] for k in sorted(there, key=lambda k: order.index(k) if k in order else len(order))
              if k != "n_positions"}
    for key, theirs, ours in architecture_differences(shared, m):
        split = " (megazero's one model.bias sets both)" if key == "bias" and isinstance(theirs, str) else ""
        out.append(f"model.{key} is {_show(theirs)} there{split} and {_show(ours)} here")
    if "n_positions" in there and m.seq_len > there["n_positions"]:
        out.append(f"model.seq_len is at most {there['n_positions']} there (n_positions) and {m.seq_len} here")
    return out


def _weight_files(folder: Path, where: str) -> list[Path]:
    """model.safetensors, the shards a model.safetensors.index.json names, or else every *.safetensors."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, MAX_INDEX_BYTES, where)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{where}: {index.name} has no weight_map of tensor names to file names")
        names = sorted(set(weight_map.values()))
        bad = next((n for n in names if Path(n).name != n or n.startswith(".") or not n.endswith(".safetensors")
                    or not n.isprintable()), None)
        if bad is not None:
            raise UserError(f"{where}: {index.name} names the file {shown(bad)}; expected *.safetensors files "
                            f"inside the folder")
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        why = (f"only {pickles[0]}, a pickle, which megazero never loads (it can run code); save the model "
               f"with safe_serialization=True" if pickles else "no *.safetensors weights")
        raise UserError(f"{where}: the folder holds {why}")
    if len(files) > MAX_SHARDS:
        raise UserError(f"{where}: {len(files)} weight files; at most {MAX_SHARDS}")
    missing = next((p for p in files if not p.is_file()), None)
    if missing is not None:
        raise UserError(f"{where}: weight file {missing.name} is missing (or not a regular file)")
    return files


def _read_error(where: str, path: Path, e: Exception) -> UserError:
    text = (getattr(e, "strerror", None) or str(e) or type(e).__name__).strip().splitlines()[0][:200]
    return UserError(f"{where}: {path.name} is not a readable safetensors file ({text})")


def _headers(files: list[Path], where: str) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Tensor name -> (file, shape, dtype), from the file headers alone (no tensor data read)."""
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in out:
                        raise UserError(f"{where}: tensor '{shown_name(key)}' is in both {out[key][0].name} and "
                                        f"{path.name}")
                    piece = f.get_slice(key)
                    out[key] = (path, tuple(piece.get_shape()), piece.get_dtype())
        except (OSError, SafetensorError) as e:
            raise _read_error(where, path, e) from None
    return out


class HFWeights:
    """A checked Hugging Face folder whose tensors are read one at a time, in megazero's layout.

    Made by :func:`open_hf_model`. ``names`` are the megazero parameters it can give (the whole model);
    :meth:`value` reads one of them from its file when asked, so only that tensor is ever in memory.
    """

    def __init__(self, folder: Path, model: Any, table: dict[str, Link], sources: dict[str, tuple[Path, str]]):
        self.folder, self.model = folder, model
        self.arch: str = model.arch
        self._links, self._sources = table, sources

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._links)

    def value(self, name: str) -> Tensor:
        """The full float32 value of megazero parameter ``name`` (padded vocabulary rows zero)."""
        if name not in self._links:
            raise KeyError(f"'{name}' is not a parameter of the {self.arch} model in {self.folder}")
        link, (path, key) = self._links[name], self._sources[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                t = f.get_slice(key)[: self.model.seq_len] if link.kind == "positions" else f.get_tensor(key)
        except (OSError, SafetensorError) as e:
            raise _read_error(_where(self.folder), path, e) from None
        return from_hf(t, link, self.model)


def open_hf_model(folder: str | Path, model_cfg: Any) -> HFWeights:
    """Check the folder at ``train.init_from`` against the run's model config and its weights' headers.

    Raises a one-line UserError for a folder of another architecture, a model that differs from the
    config (naming every differing key), or a tensor that is missing, misshapen or not floating point.
    """
    folder = Path(folder)
    where = _where(folder)
    raw = _read_json(folder / "config.json", MAX_CONFIG_BYTES, where)
    if not isinstance(raw, dict):
        raise UserError(f"{where}: config.json holds {shown(raw)}; expected a JSON object")
    arch = _architecture(raw, where)
    there = _hf_model(raw, arch, where)
    m = model_config(model_cfg)
    diffs = _differences(there, m)
    if diffs:
        raise UserError(f"{where}: the folder's model differs from the config: {'; '.join(diffs)}; set these in "
                        f"the config's model section or choose a matching folder")
    table = links(m)
    headers = _headers(_weight_files(folder, where), where)
    sources: dict[str, tuple[Path, str]] = {}
    for name, link in table.items():
        key, bare = link.hf, link.hf.split(".", 1)[-1]
        if key not in headers and key.startswith(_PREFIXES) and bare in headers:
            key = bare
        if key not in headers:
            raise UserError(f"{where}: the weights have no tensor '{link.hf}' (megazero's {name}); the folder does "
                            f"not hold a complete {HF_ARCHITECTURES[arch]}")
        path, shape, dtype = headers[key]
        want = hf_shape(link, m, there.get("n_positions", 0))
        if shape != want:
            raise UserError(f"{where}: tensor '{key}' in {path.name} has shape {shape}; config.json gives {want}")
        if dtype not in FLOAT_DTYPES:
            raise UserError(f"{where}: tensor '{key}' in {path.name} has dtype {dtype}; expected one of "
                            f"{', '.join(FLOAT_DTYPES)}")
        sources[name] = (path, key)
    return HFWeights(folder, m, table, sources)


@torch.no_grad()
def load_into(model: nn.Module, weights: HFWeights) -> None:
    """Set every parameter of a single-process (tp=1) model, or stage, to its value in ``weights``.

    A tensor-parallel rank needs its slice of each value instead: the trainer cuts those itself.
    """
    for name, p in model.named_parameters():
        value = weights.value(name)
        if value.shape != p.shape:
            raise ValueError(f"load_into fills whole (tp=1) parameters; {name} is {tuple(p.shape)}, the folder's "
                             f"value {tuple(value.shape)}")
        p.copy_(value)
