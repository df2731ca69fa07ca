"""Parameter counts on one tp rank, from the real model class built on the meta device.

The module code itself is counted, so the plan's counts cannot drift from the model; nothing is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megazero.config.schema import Config
from megazero.plan.memo import PlanMemo
from models.stage import GPT
from models.llama import kv_replicas_needed
from parallel.comm import Comm


def _planning_comm(tp: int, name: str = "tp") -> Comm:
    """A Comm that claims rank 0 of a group of the given size, with no process group behind it."""
    comm = Comm(None, name)
    comm.rank, comm.size = 0, tp
    return comm


def _built_parameters(cfg: Config, layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
    """(held, replicated over tp) parameter counts of a model chunk on one tp rank, built on meta."""
    with torch.device("meta"):
        model = GPT(cfg.model, tp=_planning_comm(cfg.parallel.tp), layer_ids=layer_ids, first_stage=first,
                    last_stage=last, sequence_parallel=cfg.parallel.sequence_parallel,
                    kv_replicas=_planning_comm(kv_replicas_needed(cfg.model, cfg.parallel.tp), "kv"))
    held = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for p in model.parameters() if p.tp_split_dim is None)
    return held, replicated


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts on one tp rank, from the real model class built on meta once per kind: a chunk's ends
    (embeddings, final norm, head; by first/last stage) and one transformer layer. Every layer holds the same
    parameters, so a chunk of n layers is its ends plus n times one layer, and a plan takes the same time at
    10 layers as at 10^9, and at 2 stages as at 10^6."""

    ends: dict  # (first, last) -> (held, replicated)
    layer: tuple[int, int]

    @classmethod
    def of(cls, cfg: Config, memo: Optional[PlanMemo] = None) -> "ParamCounts":
        memo = memo or PlanMemo(remember=False)

        def built(layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
            key = (repr(cfg.model), cfg.parallel.tp, cfg.parallel.sequence_parallel, layer_ids, first, last)
            return memo.call(_built_parameters, cfg, layer_ids, first, last, key=key)

        ends = {(first, last): built(range(0), first, last) for first in (False, True) for last in (False, True)}
        one = built(range(1), False, False)
        bare = ends[(False, False)]
        return cls(ends, (one[0] - bare[0], one[1] - bare[1]))

    def chunk(self, layers: int, first: bool, last: bool) -> tuple[int, int]:
        held, replicated = self.ends[(first, last)]
        return held + layers * self.layer[0], replicated + layers * self.layer[1]


def chunk_parameters(cfg: Config, layer_ids: range, first: bool, last: bool) -> tuple[int, int]:
    """(held, replicated over tp) parameter counts of one model chunk on one tp rank (see ParamCounts)."""
    return ParamCounts.of(cfg).chunk(len(layer_ids), first, last)
