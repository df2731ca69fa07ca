"""Search a config's layouts on a described cluster (the command line, ``python -m megazero.plan --config C
--cluster K --gpus N``, is megazero.plan.cli).

Every layout (megazero.plan.layouts) is applied to the config, checked by the rules a run applies
(megazero.config.rules.validate) and resolved as a run is (megazero.config.resolve.resolve): the config's
rules decide validity, not a copy of them. Each valid one is costed by megazero.plan.step_time, whose
memory is the ``--dry-run`` plan's; those over the GPU's memory (times MEMORY_MARGIN) are dropped and the
rest ranked by predicted step time.

The search is pruned where the answer cannot change: micro-batches are tried smallest first and stop at
the first that does not fit at the least-memory recompute (a larger one holds more activations);
recomputation is tried only when a layout does not fit without it (it only adds time), and then the fewest
checkpointed layers that fit (``model.checkpoint_layers``) stand for the rest. Memory is asked first
(megazero.plan.memory_bound): a shape and ZeRO stage whose model state and ZeRO buffers alone are over the
budget is skipped before any of its layouts is planned (deepseek-v3-shape on 2,048 GPUs: 2,800 of 12,000 plans),
and a layout whose ZeRO-stage twin was planned has its bytes without a plan, planned only when they fit. A
ZeRO-2 layout whose ZeRO-1 twin was planned is not: it moves the same gradients and parameters and updates
the same optimizer shard (step_time), so it takes ZeRO-1's step time. The ranking is the exhaustive search's,
row for row (tests/plan/test_search_pruning.py).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from megazero.config.resolve import resolve
from megazero.config.rules import validate
from megazero.config.schema import AUTO, Config
from megazero.errors import UserError
from megazero.plan.cluster import Cluster
from megazero.plan.layouts import MAX_SEARCH_WORK, Layout, Ranked, bounded, candidates, plan_work, too_large
from megazero.plan.memo import PlanMemo
from megazero.plan.memory_bound import MemoryBound, twin_key
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import Constants, StepTime, step_time
from megazero.parallel.zero.policy import StagePolicy

# The plan counts model states, ZeRO buffers and activations; the allocator's fragmentation and cached
# blocks, the CUDA context (~0.5 GB), NCCL's buffers, cuBLAS workspaces and a step's temporaries are not in
# it. Megatron-scale runs keep ~10% of HBM for them, so a layout fits when its plan is <= 90% of the GPU.
MEMORY_MARGIN = 0.9
GB = 1e9
PLANNED_DEVICE = "cuda"  # a search lays a run out on a GPU cluster


def configure(base: Config, layout: Layout, gpus: int, memo: Optional[PlanMemo] = None) -> Config:
    """The config with this layout: checked as load_config checks one (rules.validate), then resolved for
    ``gpus`` GPUs by megazero.config.resolve.resolve, as a run's entry point resolves its config. Each layout
    is a distinct run's config, so each is resolved once, here; ``base`` is left as it was. A layout the
    rules refuse raises their UserError. Sequence parallelism is on with tp > 1; pipeline stages are
    balanced by cost (``parallel.pp_layers: auto``)."""
    cfg = copy.copy(base)  # the sections the layout and resolve change; the rest is shared
    cfg.parallel, cfg.model, cfg.train, cfg.zero, cfg.kernels, cfg.log = (
        copy.copy(s) for s in (base.parallel, base.model, base.train, base.zero, base.kernels, base.log))
    p, m = cfg.parallel, cfg.model
    p.tp, p.pp, p.dp, p.virtual_stages, p.schedule = layout.tp, layout.pp, layout.dp, layout.virtual_stages, \
        layout.schedule
    p.sequence_parallel, p.pp_layers, p.ep, p.cp, p.cp_mode = layout.tp > 1, AUTO, layout.ep, layout.cp, \
        layout.cp_mode
    if p.world_size:
        p.world_size = gpus
    cfg.zero.stage, cfg.train.micro_batch = layout.zero_stage, layout.micro_batch
    m.activation_checkpointing = layout.recompute != "none"
    m.checkpoint_layers = int(layout.recompute) if layout.recompute.isdigit() else 0
    validate(cfg)
    return resolve(cfg, gpus, PLANNED_DEVICE, planned=True, memo=memo)


@dataclass
class Search:
    """What a search found: the fitting layouts (ranked), how many it costed, and why the others failed."""

    ranked: list
    tried: int = 0  # layouts put to the rules
    costed: int = 0  # layouts given a step time: planned, or ZeRO-2 from a planned ZeRO-1 twin
    planned: int = 0  # of those, planned
    first_refusal: Optional[str] = None  # the rules' line for the first invalid layout
    least: Optional[tuple] = None  # (bytes, Layout) of the valid layout that needs least memory
    work: int = 0  # of the plans made so far (megazero.plan.layouts.plan_work), bounded by MAX_SEARCH_WORK


def search(base: Config, cluster: Cluster, gpus: int, fixed: dict, c: Constants = Constants(),
           exhaustive: bool = False) -> Search:
    """Every fitting layout of ``base`` on ``gpus`` GPUs of ``cluster``, fastest first (pruned as the module
    says; ``exhaustive``: every layout planned, without the memory bound and the twins, to check them). A
    UserError when it would take minutes: at once over MAX_LAYOUTS layouts or MAX_LISTED_WORK, or once the plans
    of those the rules accept pass MAX_SEARCH_WORK (megazero.plan.layouts)."""
    budget = cluster.memory_gb * GB * MEMORY_MARGIN
    found = Search([])
    memo = PlanMemo()
    bound = MemoryBound()
    flops: list[float] = []  # model FLOPs per step: the same for every layout, taken from the first plan
    refused: set = set()  # layouts the rules refused while the memory bound was counted: not put to them again
    configured: dict = {}  # Layout -> its config, resolved for the memory bound: not resolved again
    skipped: list = []  # (bytes, Layout): the layout of least fixed bytes the memory bound skipped
    zero1: dict = {}  # twin_key -> the StepTime of a planned ZeRO-1 layout, which its ZeRO-2 twin takes

    def may_fit(layout: Layout) -> bool:
        """False when the layout's model state and ZeRO buffers alone are over the budget: one resolve per shape
        and ZeRO stage (megazero.plan.memory_bound), before any layout of it is planned."""
        if exhaustive:
            return True
        floor = bound.floor(layout)
        if floor is None:
            found.tried += 1
            try:
                cfg = configure(base, layout, gpus, memo)
            except UserError as e:  # maybe this micro-batch's refusal, not the shape's: the next one is tried
                found.first_refusal = found.first_refusal or str(e)
                refused.add(layout)
                return True
            floor = bound.learn_shape(layout, cfg, memo)
            if floor <= budget:
                configured[layout] = cfg
        if floor <= budget:
            return True
        if not skipped or floor < skipped[0][0]:
            skipped[:] = [(floor, layout)]
        return False

    def cost(layout: Layout) -> "Optional[StepTime | _Over]":
        if layout in refused:
            return None
        predicted = None if exhaustive else bound.predicted(layout)
        policy = StagePolicy.of(layout.zero_stage)
        takes_twin = policy.shards_updates_only and policy.shard_grads  # ZeRO-2, timed as its ZeRO-1 twin
        timed = zero1.get(twin_key(layout)) if predicted is not None and takes_twin else None
        if predicted is not None and (predicted > budget or timed is not None):
            if found.least is None or predicted < found.least[0]:
                found.least = (predicted, layout)
            # over the budget by its ZeRO-stage twin's plan; or ZeRO-2 beside a planned ZeRO-1: the same gradient
            # traffic, gathers and optimizer shard (step_time), so the same step time, at the bytes predicted
            if timed is None:
                return _Over(predicted)
            found.costed += 1
            return dataclasses.replace(timed, memory_bytes=predicted)
        cfg = configured.pop(layout, None)
        if cfg is None:
            found.tried += 1
            try:
                cfg = configure(base, layout, gpus, memo)
            except UserError as e:
                found.first_refusal = found.first_refusal or str(e)
                return None
        found.work += plan_work(layout, cfg.microbatches)
        if found.work > MAX_SEARCH_WORK:
            raise too_large(gpus, fixed, f"its plans pass {MAX_SEARCH_WORK:,} units of work, about 10 s, after "
                                         f"{found.costed:,} of its {len(layouts):,} layouts")
        plan = make_plan(cfg, memo)
        bound.learn_plan(layout, cfg, plan)
        st = step_time(cfg, cluster, c, plan=plan)
        found.costed += 1
        found.planned += 1
        if policy.shards_updates_only and not policy.shard_grads:  # ZeRO-1: its ZeRO-2 twin takes this time
            zero1[twin_key(layout)] = st
        if found.least is None or st.memory_bytes < found.least[0]:
            found.least = (st.memory_bytes, layout)
        if not flops:
            flops.append(plan.flops_per_step)
        return st

    def keep(layout: Layout, st) -> None:
        achieved = flops[0] / (st.total * gpus) / 1e12
        found.ranked.append(Ranked(layout, st.memory_bytes / GB, st.total, achieved, achieved / cluster.peak_tflops))

    with _no_cyclic_gc():
        layouts = bounded(candidates(base, gpus, fixed, cluster.gpus_per_node), gpus, fixed, base.train.global_batch)
        _walk(filter(may_fit, layouts), fixed, base.model.layers, cost, keep, budget)
        if not found.ranked and skipped and (found.least is None or skipped[0][0] < found.least[0]):
            least = skipped[0][1]  # nothing fits: the least memory a valid layout plans, for the one-line answer
            cost(least if "recompute" in fixed else dataclasses.replace(least, recompute="full"))
    found.ranked.sort(key=lambda r: r.step_s)
    return found


@dataclass(frozen=True)
class _Over:
    """A layout's predicted bytes, over the budget (megazero.plan.memory_bound): all the walk needs of it."""

    memory_bytes: int


def _walk(layouts: Iterator[Layout], fixed: dict, layers: int, cost: Callable, keep: Callable,
          budget: float) -> None:
    """Cost the layouts in order, each at the least recomputation that fits, skipping what memory already
    answers: ``cost`` gives a layout's StepTime, or None when the rules refuse it.

    Recompute levels run none (0), k = 1, 2, ... layers per chunk, full (a whole chunk, L). The least level
    that fits never falls as the micro-batch grows (more activations per layer), nor from ZeRO-1 to ZeRO-0
    (the same activations beside a larger optimizer state), nor from a ring layout to its Ulysses twin (which
    keeps more): those floors skip levels that cannot fit."""
    floors: dict = {}  # per layout less its micro-batch, and (for ZeRO-0, from ZeRO-1) less its ZeRO stage
    never = 2 ** 31  # no level fits
    for layout in layouts:
        def keys(mode: str) -> tuple:
            shape = (layout.tp, layout.pp, layout.virtual_stages, layout.schedule, layout.recompute, layout.ep,
                     layout.cp, mode)
            return ("zero", layout.zero_stage, *shape), ("micro_batch", layout.micro_batch, *shape)

        group, beside = keys(layout.cp_mode)
        policy = StagePolicy.of(layout.zero_stage)
        replicated = not policy.shard_optimizer  # ZeRO-0: reads the floor ZeRO-1 left at its micro-batch
        optimizer_only = policy.shard_optimizer and not policy.shard_grads  # ZeRO-1: leaves it
        # Ulysses keeps what the ring keeps and more (megazero.plan.context): it reads the ring's floor too
        reads = [keys(layout.cp_mode)] + ([keys("ring")] if layout.cp_mode != "ring" else [])
        floor = max(max(floors.get(g, 0), floors.get(b, 0) if replicated else 0) for g, b in reads)
        if floor >= never or ("recompute" not in fixed and layout.recompute == "full"):
            continue  # full recomputation is reached from "none" below, when that does not fit
        per_chunk = math.ceil(layers / (layout.pp * layout.virtual_stages))
        if "recompute" in fixed or floor == 0:
            st = cost(layout)
            if st is None:
                continue
            if st.memory_bytes <= budget or "recompute" in fixed:
                level = 0 if st.memory_bytes <= budget else never
                if level == 0:
                    keep(layout, st)
                floors[group] = level
                if optimizer_only:
                    floors[beside] = level
                continue
        got = _fewest_recomputed(layout, max(floor, 1), per_chunk, cost, budget)
        if got is None:  # the rules refuse this micro-batch (e.g. its microbatch count): try the next
            continue
        level = got[0] if got[0] < never else never
        if got[1] is not None:
            keep(*got[1])
        floors[group] = level
        if optimizer_only:
            floors[beside] = level


def _fewest_recomputed(layout: Layout, low: int, per_chunk: int, cost: Callable, budget: float) -> Optional[tuple]:
    """(level, (layout, StepTime) or None when nothing fits) for the fewest recomputed layers per chunk
    (``model.checkpoint_layers`` k from ``low``; full, k = per_chunk, last) that fit: recomputing more only adds
    time. Memory falls about linearly in k up to per_chunk - 1; full may hold more (the layer being recomputed
    holds its whole set meanwhile) or less. So k is interpolated between ``low`` and per_chunk - 1, then
    stepped to the fewest that fits: three or four plans. None: the rules refuse the layout."""
    def at(k: int):
        trial = dataclasses.replace(layout, recompute="full" if k >= per_chunk else str(k))
        return trial, cost(trial)

    top = per_chunk - 1
    if low <= top:
        fits = {top: at(top)}
        if fits[top][1] is None:
            return None
        if fits[top][1].memory_bytes <= budget:
            return _interpolated(at, low, top, fits, budget)
    full = at(per_chunk)
    if full[1] is None:
        return None
    return (per_chunk, full) if full[1].memory_bytes <= budget else (2 ** 31, None)


def _interpolated(at: Callable, low: int, top: int, fits: dict, budget: float) -> tuple:
    """The fewest k in [low, top] that fits, given that ``top`` does and memory falls with k."""
    if low < top:
        fits[low] = at(low)
        st_low, st_top = fits[low][1], fits[top][1]
        if st_low.memory_bytes <= budget:
            return low, fits[low]
        slope = (st_low.memory_bytes - st_top.memory_bytes) / (top - low)
        k = min(top, low + 1 + (int((st_low.memory_bytes - budget) / slope) if slope > 0 else 0))
        while k not in fits or fits[k][1].memory_bytes > budget:  # up to the first that fits
            fits.setdefault(k, at(k))
            k = k if fits[k][1].memory_bytes <= budget else k + 1
        while k - 1 > low:  # down while one fewer still fits
            fits.setdefault(k - 1, at(k - 1))
            if fits[k - 1][1].memory_bytes > budget:
                break
            k -= 1
    else:
        k = top
    return k, fits[k]


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A search's schedules are millions of small objects without cycles (freed by reference counts); the
    cyclic collector would rescan the live ones every few hundred allocations: 3x the search's time."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
