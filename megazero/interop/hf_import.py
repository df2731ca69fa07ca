"""Start a run from a Hugging Face GPT-2, Llama, Qwen3, Mixtral or Qwen3-MoE folder (``train.init_from``).

The folder's config.json (read by ``megazero.interop.hf_config``) must describe the model the run's config
does: a run never silently reshapes a model, so every key that differs is named in one line and the user sets
it. The folder is untrusted: weights come only from safetensors files (a pickle, ``pytorch_model.bin``, could
run code and is never opened). Every tensor's name, shape and dtype is checked against the config from the
file headers when the folder is opened, so a bad folder fails before a model is built; so is every tensor the
model would not use (weights that disagree with their own config.json: layers beyond it, a head beside tied
embeddings), refused unless ``train.init_unused: drop``.

:class:`HFWeights` then reads one tensor at a time, on demand, in megazero's layout (``megazero.interop.hf_layout``):
each rank takes what it needs of each parameter, and a model larger than host memory is never whole in it.
Each tensor is checked to be finite as it is read, so a damaged weight is named with its file rather than
found by step 1 as a non-finite gradient. A mixture of experts' stack is read expert by expert, under the name
an initialisation asks for (``layers.3.mlp.experts.5.gate``), so each ep rank reads only its own experts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from megazero.errors import UserError, shown, shown_name
from megazero.interop.hf_compare import differences
from megazero.interop.hf_config import MAX_CONFIG_BYTES, folder_model, read_json, show
from megazero.interop.hf_config import where as folder_where
from megazero.interop.hf_layout import (
    HF_ARCHITECTURES,
    Link,
    expert_keys,
    from_hf,
    hf_shape,
    links,
    model_config,
    stacked_shape,
)
from megazero.models.init import expert_name, initial_tp_value

MAX_INDEX_BYTES = 64 << 20  # a sharded index names each tensor once: ~10 MB for the largest models
MAX_SHARDS = 10_000
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_PREFIXES = ("transformer.", "model.")  # older GPT-2 folders store 'h.0...', a bare LlamaModel 'layers.0...'
UNUSED = ("refuse", "drop")  # train.init_unused: a tensor the model does not use is refused, or left unread


def _weight_files(folder: Path, where: str) -> list[Path]:
    """model.safetensors, the shards a model.safetensors.index.json names, or else every *.safetensors."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, MAX_INDEX_BYTES, where)
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


def _buffers(m: Any) -> frozenset[str]:
    """The tensors HF folders hold that are no parameters, by exact name (never read: megazero computes them):
    GPT-2's causal-mask buffers (``attn.bias``, ``attn.masked_bias``: older transformers saved them) and Llama's
    rotary inverse frequencies (older conversions: per layer, or once per model), under both name forms."""
    names = m.spec.hf.buffers(m)
    return frozenset(names + [n.split(".", 1)[1] for n in names])


def _in_layer_order(name: str) -> list:
    """Sort key: layers.2 before layers.10 (digit runs compared as numbers)."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))]


def _refuse_unused(headers: dict[str, tuple[Path, tuple[int, ...], str]], used: set[str], m: Any,
                   where: str) -> None:
    """Weights that disagree with their own config.json (layers beyond it, a head beside tied embeddings, names
    of another model) would start the run from less than the folder holds, without a word: refused, naming the
    first in layer order and counting the rest."""
    buffers = _buffers(m)
    unused = sorted((k for k in headers if k not in used and k not in buffers), key=_in_layer_order)
    if not unused:
        return
    more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
    experts = f", {m.moe.experts} experts" if m.moe.experts else ""
    raise UserError(f"{where}: the weights hold tensor '{shown_name(unused[0])}' in {headers[unused[0]][0].name}"
                    f"{more}, which the model ({m.layers} layers{experts}, tie_embeddings="
                    f"{show(bool(m.tie_embeddings))}) does not use; set train.init_unused=drop to start without it, "
                    f"or choose a folder whose weights match its config.json")


def _check_finite(t: Tensor, raw: Tensor, key: str, path: Path, where: str) -> None:
    """``t``, the float32 value just read from ``path`` (``raw`` as stored), must be finite: one sum, no copy (a
    NaN or Inf anywhere makes it non-finite); only a non-finite sum looks at each value."""
    if torch.isfinite(t.sum()):
        return
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    if not count:
        return  # finite values whose sum overflowed
    nan = int(torch.isnan(t).sum())
    what = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (count - nan, "Inf")) if n)
    first = [int(i) for i in torch.unravel_index(bad.reshape(-1).to(torch.uint8).argmax(), t.shape)]
    beyond = int((bad & torch.isfinite(raw)).sum()) if raw.dtype != t.dtype else 0
    stored = str(raw.dtype).removeprefix("torch.")
    why = f", {beyond} of them {stored} values beyond float32's range" if beyond else ""
    raise UserError(f"{where}: tensor '{shown_name(key)}' in {path.name} holds {what} of {t.numel()} values (first "
                    f"at {first}{why}); the weights are damaged: re-save them from a good copy or choose another "
                    f"folder")


class Source(NamedTuple):
    """Where one megazero tensor is read: a file, a tensor in it, and the piece of that tensor (None: all of it;
    else an index, an expert's matrix of a stack)."""

    path: Path
    key: str
    index: Optional[tuple] = None


class HFWeights:
    """A checked Hugging Face folder whose tensors are read one at a time, in megazero's layout.

    Made by :func:`open_hf_model`. ``names`` are the megazero tensors it can give (the whole model; an expert
    stack as each expert's matrix, by ``models.init.expert_name``, which is what an initialisation asks for);
    :meth:`value` reads one of them from its file when asked, so only that tensor is ever in memory.
    """

    def __init__(self, folder: Path, model: Any, table: dict[str, Link], sources: dict[str, Source]):
        self.folder, self.model = folder, model
        self.arch: str = model.arch
        self._sources = sources
        self._links = {name: table[_stack_name(name) if name not in table else name] for name in sources}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def value(self, name: str) -> Tensor:
        """The full float32 value of megazero tensor ``name`` (padded vocabulary rows zero)."""
        if name not in self._sources:
            raise KeyError(f"'{name}' is not a parameter of the {self.arch} model in {self.folder}")
        link, (path, key, index) = self._links[name], self._sources[name]
        where = folder_where(self.folder)
        try:
            with safe_open(str(path), framework="pt") as f:
                if link.kind == "positions":
                    raw = f.get_slice(key)[: self.model.seq_len]
                else:
                    raw = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        except (OSError, SafetensorError) as e:
            raise _read_error(where, path, e) from None
        t = raw.float()  # the one conversion (from_hf's is then none)
        _check_finite(t, raw, key, path, where)
        return from_hf(t, link, self.model)


def _stack_name(name: str) -> str:
    """``layers.3.mlp.experts.5.gate`` -> ``layers.3.mlp.experts.gate`` (the stack expert 5's matrix is of)."""
    prefix, _, kind = name.rpartition(".")
    return f"{prefix.rpartition('.')[0]}.{kind}"


def _find(headers: dict[str, tuple[Path, tuple[int, ...], str]], link: Link, key: str, name: str, want: tuple,
          expert: int, m: Any, kind: str, where: str) -> Source:
    """The checked source of ``key`` (megazero's ``name``): the tensor itself (also without the 'model.' prefix
    of a bare base model), or else ``link.alt`` (transformers 5's stack of the experts) and its piece."""
    def lookup(k: str) -> Optional[str]:
        bare = k.split(".", 1)[-1]
        return k if k in headers else bare if k.startswith(_PREFIXES) and bare in headers else None

    found, index = lookup(key), None
    if found is None and link.alt and lookup(link.alt) is not None:
        found, want = lookup(link.alt), stacked_shape(link)
        if link.kind == "experts":
            rows = link.shape[1]
            index = (expert,) if link.part < 0 else (expert, slice(link.part * rows, (link.part + 1) * rows))
    if found is None:
        count = f" (config.json gives {m.moe.experts} experts)" if link.kind == "experts" else ""
        raise UserError(f"{where}: the weights have no tensor '{key}' (megazero's {name}){count}; the folder does "
                        f"not hold a complete {HF_ARCHITECTURES[kind]}")
    path, shape, dtype = headers[found]
    if shape != want:
        count = f" ({m.moe.experts} experts)" if link.kind == "experts" or name.endswith("mlp.router.weight") else ""
        raise UserError(f"{where}: tensor '{found}' in {path.name} has shape {shape}; config.json gives {want}"
                        f"{count}")
    if dtype not in FLOAT_DTYPES:
        raise UserError(f"{where}: tensor '{found}' in {path.name} has dtype {dtype}; expected one of "
                        f"{', '.join(FLOAT_DTYPES)}")
    return Source(path, found, index)


def open_hf_model(folder: str | Path, model_cfg: Any, unused: str = "refuse") -> HFWeights:
    """Check the folder at ``train.init_from`` against the run's model config and its weights' headers.

    Raises a one-line UserError for a folder of another architecture, a model that differs from the
    config (naming every differing key), or a tensor that is missing, misshapen or not floating point, and,
    unless ``unused`` (``train.init_unused``) is ``drop``, for a tensor the model does not use.
    """
    assert unused in UNUSED, unused
    folder = Path(folder)
    where = folder_where(folder)
    there = folder_model(read_json(folder / "config.json", MAX_CONFIG_BYTES, where), where)
    kind = there.get("hf_type", there["arch"])
    m = model_config(model_cfg)
    diffs = differences(there, m)
    if diffs:
        raise UserError(f"{where}: the folder's model differs from the config: {'; '.join(diffs)}; set these in "
                        f"the config's model section or choose a matching folder")
    table = links(m, kind)
    headers = _headers(_weight_files(folder, where), where)
    sources: dict[str, Source] = {}
    for name, link in table.items():
        want = hf_shape(link, m, there.get("n_positions", 0))
        if link.kind == "experts":
            for e, key in enumerate(expert_keys(link)):
                one = expert_name(name, e)
                sources[one] = _find(headers, link, key, one, want, e, m, kind, where)
        else:
            sources[name] = _find(headers, link, link.hf, name, want, -1, m, kind, where)
    if unused == "refuse":
        _refuse_unused(headers, {source.key for source in sources.values()}, m, where)
    return HFWeights(folder, m, table, sources)


@torch.no_grad()
def load_into(model: nn.Module, weights: HFWeights) -> None:
    """Set every parameter of a single-process (tp=1, ep=1) model, or stage, to its value in ``weights``.

    A tensor-parallel rank needs its slice of each value instead: the trainer cuts those itself
    (``models.init.initial_tp_value``, which gives an expert stack its experts' matrices by name)."""
    for name, p in model.named_parameters():
        value = initial_tp_value(model, name, lambda n, shape: weights.value(n))
        if value.shape != p.shape:
            raise ValueError(f"load_into fills whole (tp=1) parameters; {name} is {tuple(p.shape)}, the folder's "
                             f"value {tuple(value.shape)}")
        p.copy_(value)
