"""Parameter counts: on one tp and ep rank, from the real model class built on the meta device; and the whole
model's total and active counts, from the one closed-form count (``models.build.count_parameters``).

The module code itself is counted, so the plan's counts cannot drift from the model; nothing is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megazero.config.schema import Config
from megazero.plan.memo import PlanMemo
from megazero.models.arch import moe_layer_count
from megazero.models.build import count_parameters
from megazero.models.stage import GPT
from megazero.models.llama import kv_replicas_needed
from megazero.parallel.comm import Comm
from megazero.parallel.zero.declared import EXPERT, reduce_group


def _planning_comm(size: int, name: str = "tp") -> Comm:
    """A Comm that claims rank 0 of a group of the given size, with no process group behind it."""
    comm = Comm(None, name)
    comm.rank, comm.size = 0, size
    return comm


def _built_parameters(cfg: Config, layer_ids: range, first: bool, last: bool) -> tuple[int, int, int]:
    """(held, replicated over tp, experts' (split over ep, reduced over edp)) parameter counts of a model chunk
    on one tp and ep rank, built on meta."""
    with torch.device("meta"):
        model = GPT(cfg.model, tp=_planning_comm(cfg.parallel.tp), layer_ids=layer_ids, first_stage=first,
                    last_stage=last, sequence_parallel=cfg.parallel.sequence_parallel,
                    kv_replicas=_planning_comm(kv_replicas_needed(cfg.model, cfg.parallel.tp), "kv"),
                    ep=_planning_comm(cfg.parallel.ep, "ep"))
    held = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for p in model.parameters() if p.tp_split_dim is None)
    experts = sum(p.numel() for p in model.parameters() if reduce_group(p) == EXPERT)
    return held, replicated, experts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts on one tp and ep rank, from the real model class built on meta once per kind: a chunk's
    ends (embeddings, final norm, head; by first/last stage), one dense transformer layer and one mixture-of-
    experts layer (``model.moe``). Layers of a kind hold the same parameters, so a chunk is its ends plus its
    layers of each kind times one of them, and a plan takes the same time at 10 layers as at 10^9, and at 2
    stages as at 10^6. Each figure is (held, replicated over tp, experts'), the experts' being the routed
    experts' stacked weights this ep rank holds (E/ep of them), which ZeRO shards over edp, not dp."""

    ends: dict  # (first, last) -> (held, replicated, 0)
    layer: tuple[int, int, int]  # a dense layer
    moe_layer: tuple[int, int, int]  # a mixture-of-experts layer ((0, 0, 0) without model.moe)
    cfg: Config

    @classmethod
    def of(cls, cfg: Config, memo: Optional[PlanMemo] = None) -> "ParamCounts":
        memo = memo or PlanMemo(remember=False)
        p = cfg.parallel

        def built(layer_ids: range, first: bool, last: bool) -> tuple[int, int, int]:
            key = (repr(cfg.model), p.tp, p.ep, p.sequence_parallel, layer_ids, first, last)
            return memo.call(_built_parameters, cfg, layer_ids, first, last, key=key)

        def minus(a: tuple, b: tuple) -> tuple[int, int, int]:
            return tuple(x - y for x, y in zip(a, b))

        ends = {(first, last): built(range(0), first, last) for first in (False, True) for last in (False, True)}
        bare = ends[(False, False)]
        dense = mixture = (0, 0, 0)
        for i in _one_of_each_kind(cfg.model):
            one = minus(built(range(i, i + 1), False, False), bare)
            if moe_layer_count(cfg.model, range(i, i + 1)):
                mixture = one
            else:
                dense = one
        return cls(ends, dense, mixture, cfg)

    def chunk(self, layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
        """(held, replicated over tp) of a chunk of these layers on one rank."""
        held, replicated, _ = self.chunk_counts(layer_ids, first, last)
        return held, replicated

    def chunk_counts(self, layer_ids: range, first: bool, last: bool) -> tuple[int, int, int]:
        """(held, replicated over tp, experts') of a chunk of these layers on one rank."""
        moe = moe_layer_count(self.cfg.model, layer_ids)
        dense = len(layer_ids) - moe
        return tuple(e + dense * d + moe * x for e, d, x in zip(self.ends[(first, last)], self.layer, self.moe_layer))

    def largest_layer(self, layer_ids: range) -> int:
        """Held parameters of the largest layer among these (ZeRO-3 gathers a layer at a time)."""
        moe = moe_layer_count(self.cfg.model, layer_ids)
        sizes = ([self.layer[0]] if len(layer_ids) > moe else []) + ([self.moe_layer[0]] if moe else [])
        return max(sizes, default=0)


def _one_of_each_kind(m) -> list[int]:
    """A layer index of each kind the model has: a dense layer, and the first mixture of experts."""
    first_moe = m.moe.dense_layers if m.moe.experts and m.moe.dense_layers < m.layers else None
    if first_moe is None or first_moe > 0:
        dense = [0]
    else:  # every layer from 0 on is a mixture but for those between two of them (model.moe.every)
        dense = [1] if m.moe.every > 1 and m.layers > 1 else []
    return dense + ([first_moe] if first_moe is not None else [])


def chunk_parameters(cfg: Config, layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
    """(held, replicated over tp) parameter counts of one model chunk on one tp rank (see ParamCounts)."""
    return ParamCounts.of(cfg).chunk(layer_ids, first, last)


@dataclass(frozen=True)
class ModelCounts:
    """The whole model's parameters (every stage, tp and ep rank, a tied head once): ``total``, and ``active``,
    those one token passes through (a mixture of experts' top_k routed experts, not its E; FLOPs and MFU count
    these, megazero.costs)."""

    total: int
    active: int

    @classmethod
    def of(cls, cfg: Config) -> "ModelCounts":
        return cls(count_parameters(cfg.model), count_parameters(cfg.model, active=True))
