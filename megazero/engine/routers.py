"""After each step, the routers' statistics over the global batch: one all-reduce for every layer.

Each mixture-of-experts layer counts, on every rank, the assignments its tokens made and its auxiliary
losses' sums (``models.moe``). A layer lives on one pipeline stage and its tokens are split over dp and tp, so
one sum over every rank of a (layers x statistics) table gives each layer's global figures, the same on every
rank: the auxiliary-loss-free bias update (DeepSeek-V3 §2.1.2) reads them on the ranks that hold the layer,
and the logger reads them on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from megazero.models.moe import STATS
from megazero.parallel.comm import Comm


@dataclass
class RouterStats:
    """Per mixture-of-experts layer (global index): its experts' load and its losses over the last step."""

    layers: list[int]
    table: Tensor  # (layers, E + len(STATS) + 3): counts, STATS, then holders, bias min, bias max (summed)
    capacity: bool = False  # tokens may be dropped (model.moe.capacity_factor)
    bias: bool = False  # the routers have a selection bias (the sigmoid router)

    def summary(self) -> dict[int, dict[str, float]]:
        """layer -> max/mean load, aux loss, z-loss, dropped share and count (token-expert copies over the
        capacity, over the global batch), bias min and max (a host read)."""
        rows = self.table.cpu().tolist()
        out = {}
        for layer, row in zip(self.layers, rows):
            experts = len(row) - len(STATS) - 3
            load = row[:experts]
            aux, z, dropped, tokens = row[experts:experts + len(STATS)]
            holders, low, high = row[experts + len(STATS):]
            mean = sum(load) / experts
            out[layer] = {"load_max_over_mean": max(load) / mean if mean else 0.0,
                          "aux_loss": aux / tokens if tokens else 0.0, "z_loss": z / tokens if tokens else 0.0,
                          "dropped": dropped / sum(load) if sum(load) else 0.0, "dropped_copies": dropped,
                          "bias_min": low / holders if holders else 0.0,
                          "bias_max": high / holders if holders else 0.0}
        return out


def router_record(stats: Optional[RouterStats]) -> dict[str, float]:
    """A log record's router figures: ``moe/<layer>/<figure>`` for each mixture-of-experts layer, and across
    layers the largest max/mean load and the mean auxiliary loss (``moe/load_max_over_mean``, ``moe/aux_loss``).
    Dropped copies (their share and count) appear only with a capacity, the bias range only for the sigmoid
    router."""
    if stats is None:
        return {}
    out: dict[str, float] = {}
    summary = stats.summary()
    for layer, figures in summary.items():
        for key, value in figures.items():
            if key.startswith("dropped") and not stats.capacity:
                continue
            if key.startswith("bias_") and not stats.bias:
                continue
            out[f"moe/{layer}/{key}"] = value
    out["moe/load_max_over_mean"] = max(f["load_max_over_mean"] for f in summary.values())
    out["moe/aux_loss"] = sum(f["aux_loss"] for f in summary.values()) / len(summary)
    return out


def moe_layer_ids(model_cfg) -> list[int]:
    moe = getattr(model_cfg, "moe", None)
    return [i for i in range(model_cfg.layers) if moe is not None and moe.is_moe_layer(i)]


def balance_routers(chunks: list[nn.Module], world: Comm, update: bool) -> Optional[RouterStats]:
    """Sum every layer's step statistics over the ranks, move the sigmoid routers' biases (``update``: the step
    was applied) and reset the counts. None for a dense model (no collective)."""
    ids = moe_layer_ids(chunks[0].cfg)
    if not ids:
        return None
    held = [(i, m) for c in chunks for i, m in c.moe_layers()]
    experts = chunks[0].cfg.moe.experts
    device = held[0][1].stats.device if held else next(chunks[0].parameters()).device
    table = torch.zeros(len(ids), experts + len(STATS) + 3, dtype=torch.float64, device=device)
    row = {layer: r for r, layer in enumerate(ids)}
    for layer, mlp in held:
        bias = mlp.router.expert_bias
        extremes = torch.stack([bias.min(), bias.max()]).double() if bias is not None else table.new_zeros(2)
        table[row[layer]] = torch.cat([mlp.stats, table.new_ones(1), extremes])
    world.all_reduce(table, tag="router")
    for layer, mlp in held:
        mlp.after_step(table[row[layer]], update)
    moe = chunks[0].cfg.moe
    return RouterStats(ids, table, capacity=moe.capacity_factor > 0, bias=moe.router == "sigmoid")
