"""The layout search's pruning (megazero.plan.search, megazero.plan.memory_bound): DeepSeek-V3's shape on the
2,048 GPUs it is trained at is searched, not refused for its size; the pruned search answers what the
exhaustive one does; the memory bound and the ZeRO-stage twins' bytes are the plan's own."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.errors import UserError
from megazero.plan import layouts as planner_layouts, search as planner
from megazero.plan.cluster import load_cluster
from megazero.plan.memo import PlanMemo
from megazero.plan.memory_bound import MemoryBound, stage_fixed_bytes
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import step_time

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
H100 = load_cluster("h100-80g")


def deepseek():
    return load_config(str(CONFIGS / "deepseek-v3-shape.yaml"), [])


def test_deepseek_v3_on_2048_gpus_is_searched_not_refused(monkeypatch):
    """It was refused at once ("over 32,768 layouts"). Its whole search is ~20 s (too long here): with the work
    bound at one unit it stops at its first plan, so the layouts were listed and accepted."""
    monkeypatch.setattr(planner, "MAX_SEARCH_WORK", 1)
    with pytest.raises(UserError, match="its plans pass 1 units of work") as e:
        planner.search(deepseek(), H100, 2048, {})
    assert "layouts)" in str(e.value) and "over 32,768 layouts" not in str(e.value)


@pytest.mark.parametrize("name, gpus, fixed", [
    ("deepseek-v3-shape", 2048, {"tp": 1, "pp": 16}),  # the 2,048-GPU search's best shape: ep 1 and 2 cannot fit
    ("mixtral-8x7b", 64, {"pp": 4, "tp": 1}),
    ("llama3-70b", 2048, {"tp": 4, "pp": 4, "micro_batch": 1}),
])
def test_pruned_search_returns_the_exhaustive_best(name, gpus, fixed):
    """The same ranking, row for row (layout, bytes, step time), from fewer plans."""
    base = load_config(str(CONFIGS / f"{name}.yaml"), [])
    pruned = planner.search(base, H100, gpus, fixed)
    full = planner.search(base, H100, gpus, fixed, exhaustive=True)
    assert pruned.ranked and pruned.ranked[0] == full.ranked[0]
    assert pruned.ranked == full.ranked
    assert pruned.planned < full.planned == full.costed  # fewer layouts planned


def test_a_search_nothing_fits_reports_the_least_memory_as_before():
    """Every shape of DeepSeek-V3 on 128 GPUs is over 72 GB by its model state alone: skipped unplanned, but the
    one-line answer still names the least a valid layout plans (the exhaustive search's figure)."""
    found = planner.search(deepseek(), H100, 128, {})
    assert not found.ranked and found.planned == 1
    assert found.least[0] / 1e9 == pytest.approx(110.9, abs=0.05)


def test_the_memory_bound_and_the_twins_bytes_are_the_plans():
    """stage_fixed_bytes is each stage's model state and ZeRO buffers as the plan counts them; a layout's bytes
    from a ZeRO-stage twin's plan are its own plan's; ZeRO-1 and ZeRO-2 take the same step time (which the
    search gives a ZeRO-2 layout from its planned ZeRO-1 twin)."""
    base, memo, bound = deepseek(), PlanMemo(), MemoryBound()
    shapes = [planner_layouts.Layout(1, 16, 128, 1, "zb1p", 1, 1, "3", 8),
              planner_layouts.Layout(2, 8, 128, 2, "interleaved", 1, 3, "full", 32),
              planner_layouts.Layout(1, 2, 1024, 1, "1f1b", 1, 5, "full", 256)]
    for shape in shapes:
        plans = {}
        for zero in (1, 0, 2, 3):
            lay = dataclasses.replace(shape, zero_stage=zero)
            cfg = planner.configure(base, lay, 2048, memo)
            plan = make_plan(cfg, memo)
            st = step_time(cfg, H100, plan=plan)
            fixed = [s.model_state["device_total"] + s.gathered + s.grad_buffers for s in plan.stages]
            assert stage_fixed_bytes(cfg, memo) == fixed and max(fixed) <= st.memory_bytes
            if zero != 1:
                assert bound.predicted(lay) is None  # its shape's fixed bytes are not known yet
                bound.learn_shape(lay, cfg, memo)
                assert bound.predicted(lay) == st.memory_bytes  # from ZeRO-1's plan, unplanned
            bound.learn_plan(lay, cfg, plan)
            plans[zero] = st
        assert dataclasses.replace(plans[2], memory_bytes=0) == dataclasses.replace(plans[1], memory_bytes=0)
