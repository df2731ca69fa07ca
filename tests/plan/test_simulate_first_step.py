"""The simulated run's first step over one microbatch (megazero.plan.simulate.first_step): the figures equal
those of a first step over all of them, on layouts whose first step leaves different things to the second."""
from __future__ import annotations

import pytest

from tests.hostile import ROOT

CASES = {  # config, overrides, rank
    "ZeRO-3, tp 2 with sequence parallelism, last stage": (
        "tiny.yaml", ["zero.stage=3", "train.global_batch=24"], 4),
    "ZeRO-2, optimizer offloaded, first stage": (
        "tiny.yaml", ["zero.stage=2", "zero.offload_optimizer=cpu", "train.global_batch=24"], 0),
    "interleaved, 2 chunks a rank": (
        "tiny.yaml", ["model.layers=8", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                      "train.global_batch=32"], 0),
    "zb1p, mixture of experts (router statistics held into the next step)": (
        "tiny-moe.yaml", ["parallel.schedule=zb1p", "train.global_batch=24"], 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_one_microbatch_first_step_leaves_the_second_step_its_figures(case, monkeypatch):
    """Every figure of simulate_rank equal, the bytes sent included (they are the last step's)."""
    import megazero.plan.simulate as simulate
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.stage_plan import make_plan
    from megazero.train.run import planned_world_size

    name, sets, rank = CASES[case]
    cfg = load_config(str(ROOT / "configs" / name), sets + ["parallel.world_size=8"])
    simulate.cpu_kernels(cfg)
    resolve(cfg, planned_world_size(cfg, 1), "cpu")
    plan = make_plan(cfg)
    short = simulate.simulate_rank(cfg, rank, plan)
    monkeypatch.setattr(simulate, "first_step", lambda trainer: trainer.train_step())
    whole = simulate.simulate_rank(cfg, rank, plan)
    assert short.moment.startswith("step 2") or short.moment == "after the build", short.moment
    for key in ("peak_bytes", "bytes", "moment", "host_bytes", "state_bytes", "comm_bytes", "build_peak_bytes"):
        assert getattr(short, key) == getattr(whole, key), (key, getattr(short, key), getattr(whole, key))
