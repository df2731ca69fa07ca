"""What a layout search knows of a layout's memory before planning it (megazero.plan.search).

A rank's planned bytes (megazero.plan.fits.stage_bytes) are its model state and ZeRO's gathered parameters and
gradient buffers, which a layout's shape and ZeRO stage fix (:func:`stage_fixed_bytes`), plus its activations and
a mixture of experts' dispatch buffers, which its micro-batch, recompute and schedule fix and its ZeRO stage does
not. So:

* the fixed part alone is a lower bound: a shape and ZeRO stage over the budget by it cannot fit at any
  micro-batch, recompute or schedule, and none of its layouts is planned (the memory bound, applied first);
* a layout's bytes are exact without its plan once a twin that differs only in the ZeRO stage was planned:
  each stage's fixed part at this ZeRO stage plus what the twin's stage holds beyond its own fixed part. The
  search plans a twin only where its step time may be needed: a prediction over the budget skips the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megazero.config.schema import Config
from megazero.plan.fits import stage_bytes
from megazero.plan.layouts import Layout
from megazero.plan.memo import PlanMemo
from megazero.plan.params import ParamCounts
from megazero.plan.stage_plan import Plan
from megazero.plan.state_bytes import gathered_bytes, grad_buffer_bytes, rank_state_bytes
from megazero.parallel.pipeline import partition_layers
from megazero.parallel.schedules import virtual_stage

PLANNED_DEVICE_TYPE = "cuda"


def shape_key(layout: Layout) -> tuple:
    """What fixes a layout's model state and ZeRO buffers: its ranks' split of the model and its ZeRO stage (the
    layer split, ``pp_layers: auto``, balances by tp, pp and v, never by the schedule or the micro-batch)."""
    return layout.tp, layout.pp, layout.virtual_stages, layout.dp, layout.cp, layout.ep, layout.zero_stage


def twin_key(layout: Layout) -> tuple:
    """A layout less its ZeRO stage: the layouts whose activations and dispatch buffers are the same."""
    return (layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.schedule, layout.micro_batch,
            layout.recompute, layout.ep, layout.cp, layout.cp_mode)


def stage_fixed_bytes(cfg: Config, memo: Optional[PlanMemo] = None) -> list[int]:
    """Per pipeline stage, the bytes one of its ranks keeps whatever its micro-batch, recompute and schedule: its
    model state (on the device) and ZeRO's gathered parameters and gradient buffers, counted as make_plan's
    stages count them (megazero.plan.stage_plan), without the schedule or the activations."""
    m, p = cfg.model, cfg.parallel
    ranges = partition_layers(m.layers, p.pp * p.virtual_stages, p.pp_layers)
    params = ParamCounts.of(cfg, memo)
    last_vs, out = p.pp * p.virtual_stages - 1, []
    for r in range(p.pp):
        chunks = [virtual_stage(r, chunk, p.pp) for chunk in range(p.virtual_stages)]
        counts = [params.chunk_counts(ranges[vs], vs == 0, vs == last_vs) for vs in chunks]
        psi, experts = sum(n[0] for n in counts), sum(n[2] for n in counts)
        state = rank_state_bytes(cfg, psi, experts)[0]["device_total"]
        out.append(state + gathered_bytes(cfg, chunks, ranges, psi, params)
                   + grad_buffer_bytes(cfg, chunks, ranges, psi, params, experts))
    return out


def _plan_fixed(stage) -> int:
    """A planned stage's part of stage_fixed_bytes, read from its plan."""
    return stage.model_state["device_total"] + stage.gathered + stage.grad_buffers


@dataclass
class MemoryBound:
    """One search's memory knowledge: the fixed bytes per shape and ZeRO stage, and the rest per planned twin."""

    fixed: dict = field(default_factory=dict)  # shape_key -> stage_fixed_bytes
    rest: dict = field(default_factory=dict)  # twin_key -> per stage, planned bytes beyond the fixed part

    def floor(self, layout: Layout) -> Optional[int]:
        """The most fixed bytes of a rank of the layout's shape and ZeRO stage, when known."""
        stages = self.fixed.get(shape_key(layout))
        return max(stages) if stages else None

    def learn_shape(self, layout: Layout, cfg: Config, memo: Optional[PlanMemo] = None) -> int:
        """Count the fixed bytes of a configured layout's shape and ZeRO stage; their most, over its stages."""
        self.fixed[shape_key(layout)] = stage_fixed_bytes(cfg, memo)
        return max(self.fixed[shape_key(layout)])

    def learn_plan(self, layout: Layout, cfg: Config, plan: Plan) -> None:
        """Keep what a planned layout's stages hold beyond their fixed part, for its ZeRO-stage twins."""
        self.fixed.setdefault(shape_key(layout), [_plan_fixed(s) for s in plan.stages])
        self.rest.setdefault(twin_key(layout), [stage_bytes(cfg, s, PLANNED_DEVICE_TYPE) - _plan_fixed(s)
                                                for s in plan.stages])

    def predicted(self, layout: Layout) -> Optional[int]:
        """The layout's planned bytes (megazero.plan.step_time's memory) from a planned twin; None if none is."""
        rest, fixed = self.rest.get(twin_key(layout)), self.fixed.get(shape_key(layout))
        if rest is None or fixed is None:
            return None
        return max(f + r for f, r in zip(fixed, rest))
