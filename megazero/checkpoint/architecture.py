"""One comparison of two models' architectures, shared by a checkpoint resume and a Hugging Face import.

Both sides are resolved model configs (``interop.hf_layout.model_config``): a key an older checkpoint lacks
has its old meaning, and kv_heads unset equals kv_heads = heads, so only real differences remain. ``model.moe``
is compared key by key (``moe.top_k``, 2 there and 1 here), as the Hugging Face import names it: a refusal
names what to set, not two whole sections to tell apart.
"""
from __future__ import annotations

from typing import Any, Mapping

from megazero.models.registry import spec_named

ROPE_SCALING_KEYS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")


def _value(m: Any, key: str) -> Any:
    """A key's resolved meaning: the number of k/v heads and the head width, not whether they were set; of
    ``moe``, the keys that shape the network (a dense model's: none), not its training settings."""
    if key == "moe":
        return moe_architecture(m.moe, m.ffn_hidden)
    if key == "head_dim":
        return getattr(m, "head_dim", None) or m.hidden // m.heads
    return m.kv_head_count if key == "kv_heads" else getattr(m, key)


def moe_architecture(moe: Any, ffn_hidden: Any = None) -> Any:
    """``model.moe``'s architecture keys as a mapping (``dense`` without experts), a stored mapping too; an
    unset ``expert_hidden`` is ``ffn_hidden`` where given (the experts' width either way)."""
    from megazero.config.schema import MoeConfig

    get = moe.get if isinstance(moe, Mapping) else lambda k, d=None: getattr(moe, k, d)
    if not get("experts", 0):
        return "dense"
    defaults = MoeConfig()
    arch = {k: get(k, getattr(defaults, k)) for k in MoeConfig.ARCHITECTURE}
    if arch["expert_hidden"] is None and ffn_hidden is not None:
        arch["expert_hidden"] = ffn_hidden
    return arch


def moe_differences(there: Any, here: Any) -> list[tuple[str, Any, Any]]:
    """(``moe.KEY``, there, here) for each differing key of two :func:`moe_architecture` values; a dense side
    differs in ``moe.experts`` alone (0), since its other keys shape nothing."""
    if there == here:
        return []
    if not isinstance(there, Mapping) or not isinstance(here, Mapping):
        experts = [m.get("experts") if isinstance(m, Mapping) else 0 for m in (there, here)]
        return [("moe.experts", *experts)]
    return [(f"moe.{k}", there.get(k), here.get(k)) for k in dict.fromkeys([*there, *here])
            if there.get(k) != here.get(k)]


def architecture_differences(there: Mapping[str, Any], here: Any) -> list[tuple[str, Any, Any]]:
    """(key, there, here) for every key of ``there`` whose value differs from the model config ``here``;
    ``model.moe`` as one (``moe.KEY``, there, here) per differing key. GPT-2 has no rotary positions (its spec says
    so), and unscaled rotary positions do not use the scaling's parameters, so those keys are not compared where
    they mean nothing."""
    out = []
    for key, theirs in there.items():
        ours = _value(here, key)
        if key == "moe":
            out += moe_differences(moe_architecture(theirs, there.get("ffn_hidden")), ours)
            continue
        if key.startswith("rope_") and not _rotary(here.arch) and not _rotary(there.get("arch", here.arch)):
            continue
        if key in ROPE_SCALING_KEYS and here.rope_scaling == "none":
            continue  # a scaled side also differs in rope_scaling, which is compared
        if theirs != ours:
            out.append((key, theirs, ours))
    return out


def _rotary(arch: Any) -> bool:
    """Whether the architecture named ``arch`` has rotary positions (an unknown name: assumed so, compared)."""
    spec = spec_named(arch)
    return spec is None or spec.rotary


def model_differences(there: Any, here: Any, keys: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """:func:`architecture_differences` between two model configs, over ``keys``."""
    return architecture_differences({k: _value(there, k) for k in keys}, here)
