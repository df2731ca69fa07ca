"""Search a config's layouts on a described cluster (the command line, ``python -m megazero.plan --config C
--cluster K --gpus N``, is megazero.plan.cli).

Every layout (tp, pp, dp, virtual stages, schedule, ZeRO stage, micro-batch, recompute) is applied to the
config and checked by the rules a run applies (megazero.config.rules.validate and resolve_world: the config rules
decide validity, not a copy of them); each valid one is costed by megazero.plan.step_time, whose memory is the
``--dry-run`` plan's; those over the GPU's memory (times MEMORY_MARGIN) are dropped and the rest ranked by
predicted step time.

The search is pruned where the answer cannot change: micro-batches are tried smallest first and stop at
the first that does not fit at the least-memory recompute (a larger one holds more activations);
recomputation is tried only when a layout does not fit without it (it only adds time), and then the fewest
checkpointed layers that fit (``model.checkpoint_layers``) stand for the rest. Where it is narrowed to keep
it to seconds: tp stays within a node unless --layout fixes it; at most MAX_MICRO_BATCHES micro-batches
per layout; interleaving at 2, 4, 8... chunks; gpipe only when fixed.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

from megazero.plan.cluster import Cluster
from megazero.config.schema import Config
from megazero.config.load import load_config
from megazero.errors import UserError, shown
from megazero.plan.stage_plan import make_plan
from megazero.plan.memo import PlanMemo
from megazero.config.schema import AUTO
from megazero.config.rules import resolve_world, validate
from megazero.plan.step_time import Constants, step_time

KNOBS = ("tp", "pp", "dp", "virtual_stages", "schedule", "zero_stage", "micro_batch", "recompute")
# gpipe is not searched (it can be fixed with --layout): 1F1B's bubble, but every microbatch's activations held.
SEARCHED_SCHEDULES = ("1f1b", "zb1p", "interleaved")
# The plan counts model states, ZeRO buffers and activations; the allocator's fragmentation and cached
# blocks, the CUDA context (~0.5 GB), NCCL's buffers, cuBLAS workspaces and a step's temporaries are not in
# it. Megatron-scale runs keep ~10% of HBM for them, so a layout fits when its plan is <= 90% of the GPU.
MEMORY_MARGIN = 0.9
MAX_MICRO_BATCHES = 8  # micro-batch values tried per layout: a geometric spread of the batch's divisors
GB = 1e9


@dataclass(frozen=True)
class Layout:
    """One point of the search; recompute is 'none', 'full' or k (model.checkpoint_layers) as text."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int
    schedule: str
    zero_stage: int
    micro_batch: int
    recompute: str

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


@dataclass(frozen=True)
class Ranked:
    """A layout that fits, with what the step-time model predicts for it."""

    layout: Layout
    memory_gb: float
    step_s: float
    tflops_per_gpu: float
    mfu: float

    def as_dict(self) -> dict:
        return {**asdict(self.layout), "memory_gb": self.memory_gb, "step_s": self.step_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu}


def parse_layout(text: str) -> dict:
    """``tp=8,pp=4,recompute=full`` -> the fixed knobs; a bad knob or value is one line."""
    fixed: dict = {}
    for item in (text.split(",") if text.strip() else []):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in KNOBS:
            raise UserError(f"--layout {shown(item)} is invalid; expected knob=value with a knob of {', '.join(KNOBS)}")
        if key in fixed:
            raise UserError(f"--layout: {key} is given twice")
        fixed[key] = _knob_value(key, value)
    if not fixed:
        raise UserError(f"--layout {shown(text)} is invalid; expected e.g. tp=8,pp=4,recompute=full")
    return fixed


def _knob_value(key: str, value: str):
    from parallel.schedules import SCHEDULES

    if key == "schedule":
        if value not in SCHEDULES:
            raise UserError(f"--layout schedule={shown(value)} is invalid; valid: {' | '.join(SCHEDULES)}")
        return value
    if key == "recompute":
        if value in ("none", "full") or (value.isdigit() and 0 < int(value) < 2 ** 31):
            return value
        raise UserError(f"--layout recompute={shown(value)} is invalid; valid: none | full | a layer count k >= 1")
    low = 0 if key == "zero_stage" else 1
    if not (value.isdigit() and len(value) < 10) or int(value) < low or (key == "zero_stage" and int(value) > 3):
        valid = "0 | 1 | 2 | 3" if key == "zero_stage" else "an integer >= 1"
        raise UserError(f"--layout {key}={shown(value)} is invalid; valid: {valid}")
    return int(value)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _spread(values: list[int], most: int) -> list[int]:
    """At most ``most`` of sorted values, evenly by index (the divisors of a batch are near-geometric)."""
    if len(values) <= most:
        return values
    return sorted({values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)})


def candidates(base: Config, gpus: int, fixed: dict, max_tp: int = 2 ** 20) -> Iterator[Layout]:
    """Every layout of ``gpus`` ranks the search considers, recompute none or full, before the rules (those
    that break one are filtered by :func:`configure`). Per pipeline shape, layouts come in order of falling
    microbatch count, so each (tp, ZeRO stage) meets its micro-batches smallest first and layouts that share a
    schedule come together. tp above ``max_tp`` only when --layout fixes it."""
    layers, batch = base.model.layers, base.train.global_batch
    want = lambda key, value: key not in fixed or fixed[key] == value  # noqa: E731
    for pp in divisors(gpus):
        shapes = [(tp, gpus // (tp * pp)) for tp in divisors(gpus // pp) if tp <= max_tp or "tp" in fixed]
        shapes = [(tp, dp) for tp, dp in shapes if want("tp", tp) and want("dp", dp) and batch % dp == 0]
        if pp > layers or not want("pp", pp) or not shapes:
            continue
        rows = [(tp, dp, mb) for tp, dp in shapes for mb in ([fixed["micro_batch"]] if "micro_batch" in fixed
                                                             else _spread(divisors(batch // dp), MAX_MICRO_BATCHES))]
        rows.sort(key=lambda row: -(batch // (row[1] * row[2])))  # stable: ties keep tp order
        for schedule, v in _pipelines(pp, layers, fixed):
            for tp, dp, mb in rows:
                for zero in (z for z in (1, 0, 2, 3) if want("zero_stage", z)):  # ZeRO-1 tells ZeRO-0's memory
                    for rec in ([fixed["recompute"]] if "recompute" in fixed else ["none", "full"]):
                        yield Layout(tp, pp, dp, v, schedule, zero, mb, rec)


def _pipelines(pp: int, layers: int, fixed: dict) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs: one chunk per rank, or 2, 4, 8... chunks interleaved while every
    virtual stage keeps a layer. Without a pipeline only 1f1b (every schedule is the same there)."""
    if "schedule" in fixed:
        names = [fixed["schedule"]]
    else:
        names = ["1f1b"] if pp == 1 else list(SEARCHED_SCHEDULES)
    out = []
    for name in names:
        if name != "interleaved":
            out.append((name, 1))
            continue
        chunks = [fixed["virtual_stages"]] if "virtual_stages" in fixed else \
            [2 ** i for i in range(1, 32) if pp * 2 ** i <= layers]
        out += [(name, v) for v in chunks]
    return [(s, v) for s, v in out if "virtual_stages" not in fixed or fixed["virtual_stages"] == v]


def configure(base: Config, layout: Layout, gpus: int, memo: Optional[PlanMemo] = None) -> Config:
    """The config with this layout, validated as a run validates it (load_config's rules, then resolve_world);
    a layout the rules refuse raises their UserError. Sequence parallelism is on with tp > 1; pipeline
    stages are balanced by cost (``parallel.pp_layers: auto``)."""
    cfg = copy.copy(base)  # the sections the layout, validate and resolve_world change; the rest is shared
    cfg.parallel, cfg.model, cfg.train, cfg.zero = (copy.copy(s) for s in (base.parallel, base.model, base.train,
                                                                           base.zero))
    p, m = cfg.parallel, cfg.model
    p.tp, p.pp, p.dp, p.virtual_stages, p.schedule = layout.tp, layout.pp, layout.dp, layout.virtual_stages, \
        layout.schedule
    p.sequence_parallel, p.pp_layers = layout.tp > 1, AUTO
    if p.world_size:
        p.world_size = gpus
    cfg.zero.stage, cfg.train.micro_batch = layout.zero_stage, layout.micro_batch
    m.activation_checkpointing = layout.recompute != "none"
    m.checkpoint_layers = int(layout.recompute) if layout.recompute.isdigit() else 0
    validate(cfg, memo)
    return resolve_world(cfg, gpus)


@dataclass
class Search:
    """What a search found: the fitting layouts (ranked), how many it costed, and why the others failed."""

    ranked: list
    tried: int = 0  # layouts put to the rules
    costed: int = 0
    first_refusal: Optional[str] = None  # the rules' line for the first invalid layout
    least: Optional[tuple] = None  # (bytes, Layout) of the valid layout that needs least memory


def search(base: Config, cluster: Cluster, gpus: int, fixed: dict, c: Constants = Constants()) -> Search:
    """Every fitting layout of ``base`` on ``gpus`` GPUs of ``cluster``, fastest first (pruned as the module
    says)."""
    budget = cluster.memory_gb * GB * MEMORY_MARGIN
    found = Search([])
    memo = PlanMemo()
    flops: list[float] = []  # model FLOPs per step: the same for every layout, taken from the first plan

    def cost(layout: Layout) -> Optional[tuple]:
        found.tried += 1
        try:
            cfg = configure(base, layout, gpus, memo)
        except UserError as e:
            found.first_refusal = found.first_refusal or str(e)
            return None
        plan = make_plan(cfg, memo)
        st = step_time(cfg, cluster, c, plan=plan)
        found.costed += 1
        if found.least is None or st.memory_bytes < found.least[0]:
            found.least = (st.memory_bytes, layout)
        if not flops:
            flops.append(plan.flops_per_step)
        return st

    def keep(layout: Layout, st) -> None:
        achieved = flops[0] / (st.total * gpus) / 1e12
        found.ranked.append(Ranked(layout, st.memory_bytes / GB, st.total, achieved, achieved / cluster.peak_tflops))

    with _no_cyclic_gc():
        _walk(candidates(base, gpus, fixed, cluster.gpus_per_node), fixed, base.model.layers, cost, keep, budget)
    found.ranked.sort(key=lambda r: r.step_s)
    return found


def _walk(layouts: Iterator[Layout], fixed: dict, layers: int, cost: Callable, keep: Callable,
          budget: float) -> None:
    """Cost the layouts in order, each at the least recomputation that fits, skipping what memory already
    answers: ``cost`` gives a layout's StepTime, or None when the rules refuse it.

    Recompute levels run none (0), k = 1, 2, ... layers per chunk, full (a whole chunk, L). The least level
    that fits never falls as the micro-batch grows (more activations per layer), nor from ZeRO-1 to ZeRO-0
    (the same activations beside a larger optimizer state): those floors skip levels that cannot fit."""
    floors: dict = {}  # per layout less its micro-batch, and (for ZeRO-0, from ZeRO-1) less its ZeRO stage
    never = 2 ** 31  # no level fits
    for layout in layouts:
        shape = (layout.tp, layout.pp, layout.virtual_stages, layout.schedule, layout.recompute)
        group, beside = ("zero", layout.zero_stage, *shape), ("micro_batch", layout.micro_batch, *shape)
        floor = max(floors.get(group, 0), floors.get(beside, 0) if layout.zero_stage == 0 else 0)
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
                if layout.zero_stage == 1:
                    floors[beside] = level
                continue
        got = _fewest_recomputed(layout, max(floor, 1), per_chunk, cost, budget)
        if got is None:  # the rules refuse this micro-batch (e.g. its microbatch count): try the next
            continue
        level = got[0] if got[0] < never else never
        if got[1] is not None:
            keep(*got[1])
        floors[group] = level
        if layout.zero_stage == 1:
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
