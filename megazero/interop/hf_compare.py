"""A Hugging Face folder's model against the run's config, key by key (``train.init_from``).

A run never silently reshapes a model: every key whose meaning differs is named, as ``model.KEY is A there and
B here``. Values are compared as they shape the network: k/v heads resolved, an expert's width as the experts
have it, the mixture-of-experts layers as the set of them (other ``dense_layers``/``every`` may place the same),
a routing key the folder leaves open (top-1's renormalisation) not at all; the sequence only against a limit the
folder sets (GPT-2's positions, a sliding window).
"""
from __future__ import annotations

from typing import Any

from megazero.checkpoint.architecture import architecture_differences
from megazero.interop.hf_config import LLAMA3_KEYS, show

_COMPARED = ("arch", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab_size", "norm_eps",
             "rope_theta", "tie_embeddings", "bias", "rope_scaling", "qk_norm")
_MOE_COMPARED = ("experts", "top_k", "expert_hidden", "shared_experts", "dense_layers", "every", "router",
                 "norm_topk_prob", "routed_scaling_factor")
_NOT_KEYS = ("n_positions", "sliding_window", "hf_type", "moe")  # compared on their own


def _moe_differences(theirs: dict[str, Any], m: Any) -> list[str]:
    """model.moe's keys, one by one: the expert width as the experts have it (expert_hidden, else ffn_hidden),
    the placement of the mixture-of-experts layers as the set of them (other dense_layers and every may give
    the same), a key the folder leaves open (None) not at all."""
    moe = m.moe
    if not theirs["experts"] or not moe.experts:
        if theirs["experts"] == moe.experts:
            return []
        what = {0: " (a dense model)"}
        return [f"model.moe.experts is {theirs['experts']}{what.get(theirs['experts'], '')} there and "
                f"{moe.experts}{what.get(moe.experts, '')} here"]
    here = {k: getattr(moe, k) for k in _MOE_COMPARED}
    here["expert_hidden"] = moe.expert_hidden or m.ffn_hidden
    placed = tuple(i for i in range(m.layers) if moe.is_moe_layer(i)) == tuple(theirs["layers"])
    out = []
    for key in _MOE_COMPARED:
        if theirs[key] is None or (placed and key in ("dense_layers", "every")):
            continue
        if theirs[key] != here[key]:
            out.append(f"model.moe.{key} is {show(theirs[key])} there and {show(here[key])} here")
    return out


def differences(there: dict[str, Any], m: Any) -> list[str]:
    """'model.KEY is A there and B here' for every key where the folder's model and the config differ."""
    out = []
    order = (*_COMPARED, *(ours for _, ours, _ in LLAMA3_KEYS))  # a mismatch's keys in the order users know
    shared = {k: there[k] for k in sorted(there, key=lambda k: order.index(k) if k in order else len(order))
              if k not in _NOT_KEYS}
    for key, theirs, ours in architecture_differences(shared, m):
        split = " (megazero's one model.bias sets both)" if key == "bias" and isinstance(theirs, str) else ""
        out.append(f"model.{key} is {show(theirs)} there{split} and {show(ours)} here")
    if "moe" in there:
        out += _moe_differences(there["moe"], m)
    if "n_positions" in there and m.seq_len > there["n_positions"]:
        out.append(f"model.seq_len is at most {there['n_positions']} there (n_positions) and {m.seq_len} here")
    if "sliding_window" in there and m.seq_len > there["sliding_window"]:
        out.append(f"model.seq_len is at most {there['sliding_window']} there (sliding_window: attention sees "
                   f"the last {there['sliding_window']} tokens; megazero's, the whole sequence) and {m.seq_len} here")
    return out
