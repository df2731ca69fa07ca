"""Build one pipeline stage: on the meta device, then materialised and initialised (torchtitan's order).

Nothing is allocated before the stage knows its layout; ZeRO-3 may take the parameters still on the meta
device and create them one bucket at a time (``materialise=False``). ``count_parameters`` is the same
model's size from the config alone, for plans and metrics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megazero.models.arch import moe_layer_count, tied
from megazero.models.init import InitialValues, init_parameters
from megazero.models.stage import GPT

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

PARALLEL_ATTRS = ("tp_split_dim", "tp_replicas", "sequence_parallel", "ep_split_dim", "reduce_group")  # marked


def build_gpt(cfg: ModelConfig, seed: int | InitialValues, device: torch.device | str = "cpu", materialise: bool = True,
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


def count_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (every stage and tp rank, a tied head counted once); ``active``: those one
    token passes through, the routed experts of a mixture of experts counted top_k times instead of E times.

    The token embedding (and an untied head) count their padded rows because they are stored and
    multiplied like any other; a position table where the architecture has one; each layer as its spec counts
    it (``ModelSpec.layer_parameters``: a dense layer, or a mixture of experts with E or k routed experts).
    Active parameters count every embedding, attention, norm, router and shared expert, and k routed experts
    per layer.
    """
    spec, h, L = cfg.spec, cfg.hidden, cfg.layers
    head = 0 if tied(cfg) else cfg.padded_vocab * h
    positions = cfg.seq_len * h if spec.learned_positions else 0
    moe_layers = moe_layer_count(cfg, range(L))
    layers = ((L - moe_layers) * spec.layer_parameters(cfg, False, active)
              + (moe_layers and moe_layers * spec.layer_parameters(cfg, True, active)))
    return cfg.padded_vocab * h + head + positions + layers + spec.final_norm_parameters(cfg)
