"""Build one pipeline stage: on the meta device, then materialised and initialised (torchtitan's order).

Nothing is allocated before the stage knows its layout; ZeRO-3 may take the parameters still on the meta
device and create them one bucket at a time (``materialise=False``). ``count_parameters`` is the same
model's size from the config alone, for plans and metrics.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megazero.models.arch import expert_hidden, ffn_hidden, has_bias, head_dim, is_llama, moe_layer_count, tied
from megazero.models.init import InitialValues, init_parameters
from megazero.models.stage import GPT

PARALLEL_ATTRS = ("tp_split_dim", "tp_replicas", "sequence_parallel", "ep_split_dim", "reduce_group")  # marked


def build_gpt(cfg: Any, seed: int | InitialValues, device: torch.device | str = "cpu", materialise: bool = True,
              **stage: Any) -> GPT:
    """Build a stage on the meta device (no memory), materialise it on ``device``, initialise it.

    ``stage``: ``models.stage.GPT``'s keywords (tp, layer_ids, first_stage, last_stage, sequence_parallel,
    attention_impl, kv_replicas, tp_overlap). materialise=False leaves the parameters on the meta device for
    their owner (ZeRO-3) to create one bucket at a time from ``models.init.initial_tp_value``; the model still
    computes on ``device``.
    """
    with torch.device("meta"):
        model = GPT(cfg, **stage)
    model.rng.device = torch.device(device)
    for module in model.modules():  # buffers (a router's bias, its statistics) are small: always real, zero
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                setattr(module, name, torch.zeros(b.shape, dtype=b.dtype, device=device))
    if not materialise:
        return model
    # new Parameter objects on the device, keeping the parallel attributes (not to_empty: it cannot swap the
    # parameters of a model built under fake tensors, which --simulate runs)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                for attr in PARALLEL_ATTRS:
                    if hasattr(p, attr):
                        setattr(made[id(p)], attr, getattr(p, attr))
            setattr(module, name, made[id(p)])
    init_parameters(model, seed)
    return model


def count_parameters(cfg: Any, active: bool = False) -> int:
    """Parameters of the whole model (every stage and tp rank, a tied head counted once); ``active``: those one
    token passes through, the routed experts of a mixture of experts counted top_k times instead of E times.

    The token embedding (and an untied head) count their padded rows because they are stored and
    multiplied like any other. Llama: RMSNorms (no bias), q/o of h x heads*head_dim, k/v of h x
    kv_heads*head_dim, and SwiGLU's three ffn x h matrices; no position table. A mixture-of-experts layer
    (``model.moe``) has, in place of the SwiGLU, a router (E x h), E experts of 3 x expert_hidden x h (k of them
    active) and its shared experts, one SwiGLU of shared_experts*expert_hidden. Active parameters count every
    embedding, attention, norm, router and shared expert, and k routed experts per layer.
    """
    h, f, n_bias = cfg.hidden, ffn_hidden(cfg), int(has_bias(cfg))
    head = 0 if tied(cfg) else cfg.padded_vocab * h
    if is_llama(cfg):
        d = head_dim(cfg)
        q, kv = cfg.heads * d, cfg.kv_head_count * d
        norm = h
        qk_norm = 2 * d if getattr(cfg, "qk_norm", False) else 0
        attention = 2 * norm + 2 * h * q + 2 * h * kv + n_bias * (q + 2 * kv + h) + qk_norm

        def swiglu(width: int) -> int:
            return 3 * width * h + n_bias * (2 * width + h) if width else 0

        moe_layers = moe_layer_count(cfg, range(cfg.layers))
        total = cfg.layers * attention + (cfg.layers - moe_layers) * swiglu(f)
        if moe_layers:
            moe, fe = cfg.moe, expert_hidden(cfg)
            routed = (moe.top_k if active else moe.experts) * 3 * fe * h
            total += moe_layers * (moe.experts * h + routed + swiglu(moe.shared_experts * fe))
        return cfg.padded_vocab * h + head + total + norm
    norm = h * (1 + n_bias)
    block = (
        2 * norm
        + 3 * h * h + n_bias * 3 * h  # qkv
        + h * h + n_bias * h  # attention output projection
        + f * h + n_bias * f  # fc1
        + h * f + n_bias * h  # fc2
    )
    return cfg.padded_vocab * h + head + cfg.seq_len * h + cfg.layers * block + norm
