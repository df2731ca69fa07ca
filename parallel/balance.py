"""Pipeline stages balanced by cost: the layer counts per (virtual) stage that least load the busiest rank.

An even split leaves the last stage heavier: besides its layers it runs the output head (a hidden x vocab
matmul) and the cross entropy over the vocabulary, and the first stage adds the embedding lookup. A pipeline
runs at the pace of its busiest stage, so ``parallel.pp_layers: auto`` moves layers off the ends (what
Megatron-LM leaves to the user as --decoder-first/last-pipeline-num-layers).

Every layer costs the same, so a stage of n layers costs ``n * layer`` plus what its end adds, and giving
layers one at a time to the stage that is cheapest after taking one is exact for the busiest stage (each
layer raises one stage's cost by the same amount). :func:`balance_layers` finds where that greedy stops by
a binary search over the bottleneck, in exact fractions, so a billion layers split as fast as ten.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence


@dataclass(frozen=True)
class StageCosts:
    """Work per token on one rank, in FLOPs or FLOPs-equivalents: one transformer layer, and what the first
    virtual stage (the embedding) and the last (the output head and the loss) add to their layers."""

    layer: float
    first: float = 0.0
    last: float = 0.0


def balance_layers(layers: int, pp: int, costs: StageCosts, virtual_stages: int = 1) -> list[int]:
    """Contiguous layer counts, one per virtual stage (``pp * virtual_stages``, each >= 1), that minimise the
    busiest pipeline rank's work per microbatch.

    With interleaving rank r runs virtual stages r, r + pp, ...: each microbatch passes through all of them,
    so what a rank does per step is the sum of its chunks, and that is what is balanced (exactly); each rank's
    layers are then split over its chunks so that its largest chunk is as small as it can be. Ties go to the
    earlier stages, so equal ends give the even split of ``parallel.pipeline.partition_layers``.
    """
    v = virtual_stages
    stages = pp * v
    if pp < 1 or v < 1 or layers < stages:
        raise ValueError(f"{layers} layers over pp={pp} x virtual_stages={v}: fewer layers than stages")
    if not costs.layer > 0:
        raise ValueError(f"layer cost {costs.layer}: must be > 0")
    last_rank = (stages - 1) % pp
    rank_extra = [costs.first if r == 0 else 0.0 for r in range(pp)]
    rank_extra[last_rank] += costs.last
    per_rank = _fill(layers, rank_extra, costs.layer, v)
    counts = [0] * stages
    for r, n in enumerate(per_rank):
        mine = range(r, stages, pp)
        extras = [(costs.first if vs == 0 else 0.0) + (costs.last if vs == stages - 1 else 0.0) for vs in mine]
        for vs, c in zip(mine, _fill(n, extras, costs.layer, 1)):
            counts[vs] = c
    return counts


def rank_costs(counts: Sequence[int], pp: int, costs: StageCosts) -> list[float]:
    """What each pipeline rank does per token with these layer counts per virtual stage (rank r holds virtual
    stages r, r + pp, ...): its layers, the embedding on rank 0, the head and loss on the last stage's rank."""
    stages = len(counts)
    out = [costs.layer * sum(counts[r::pp]) for r in range(pp)]
    out[0] += costs.first
    out[(stages - 1) % pp] += costs.last
    return out


def _fill(total: int, extras: Sequence[float], unit: float, minimum: int) -> list[int]:
    """Counts n_i >= minimum summing to ``total`` that minimise max(n_i * unit + extras[i]).

    The greedy answer (each layer to the stage cheapest after taking it, ties to the earlier) without its
    loop: ``level`` is the cost of the last layer it gives, the least cost at which the layers costing no
    more would be ``total``; every layer costing less is taken, and those costing exactly ``level`` fill
    what is left, earlier stages first.
    """
    n = len(extras)
    if len(set(extras)) == 1:  # every stage alike (the middle ranks): the even split
        base, extra = divmod(total, n)
        return [base + (1 if i < extra else 0) for i in range(n)]
    w = Fraction(unit)
    groups: dict[float, int] = {}
    for x in extras:
        groups[x] = groups.get(x, 0) + 1
    exact = {x: Fraction(x) for x in groups}

    def taken(level: Fraction) -> int:  # layers held when each stage takes all that cost <= level
        return sum(c * max(minimum, math.floor((level - exact[x]) / w)) for x, c in groups.items())

    if total == minimum * n:
        return [minimum] * n
    level = None
    for x in groups:  # the least level, a stage of this kind holding k layers, at which enough are taken
        lo, hi = minimum + 1, total
        while lo < hi:
            mid = (lo + hi) // 2
            if taken(mid * w + exact[x]) >= total:
                hi = mid
            else:
                lo = mid + 1
        candidate = lo * w + exact[x]
        level = candidate if level is None else min(level, candidate)
    below = {x: max(minimum, math.ceil((level - exact[x]) / w) - 1) for x in groups}  # layers costing < level
    at_level = {x: ((level - exact[x]) / w).denominator == 1 and (level - exact[x]) / w > minimum for x in groups}
    counts = [below[x] for x in extras]
    spare = total - sum(counts)
    for i, x in enumerate(extras):
        if spare == 0:
            break
        if at_level[x]:
            counts[i] += 1
            spare -= 1
    return counts
