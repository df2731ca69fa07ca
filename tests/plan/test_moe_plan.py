"""Planning a mixture of experts: the --dry-run plan's counts, expert states, dispatch and all-to-all figures
(the states and the all-to-alls measured on a real dp 4 x ep 2 run), the step-time model's all-to-all term, and
the layout search's ep dimension."""
from __future__ import annotations

import dataclasses

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.plan import layouts as planner_layouts, search as planner
from megazero.plan.cluster import load_cluster
from megazero.plan.dispatch import dispatch_bytes
from megazero.plan.stage_plan import make_plan
from megazero.plan.step_time import step_time
from megazero.models.build import count_parameters
from tests.dist import run_ranks
from tests.runs import ROOT, small_overrides, write_corpus

TINY_MOE = ROOT / "configs" / "tiny-moe.yaml"
MIXTRAL = ROOT / "configs" / "mixtral-8x7b.yaml"
H100 = load_cluster("h100-80g")


def test_dry_run_prints_total_and_active_parameters_dispatch_and_all_to_alls(capsys):
    from megazero.train.run import dry_run

    plan = dry_run(str(TINY_MOE), ["parallel.world_size=8"])
    out = capsys.readouterr().out
    m = plan.cfg.model
    assert plan.total_params == count_parameters(m) > plan.active_params == count_parameters(m, active=True)
    assert f"parameters (whole model)  {plan.total_params:,}" in out
    assert f"active parameters         {plan.active_params:,}" in out
    assert "(ep 2 x edp 1)" in out and "experts/rank" in out and "a2a/step" in out
    d = plan.dispatch
    assert d.rows == plan.cfg.train.micro_batch * m.seq_len // plan.cfg.parallel.tp * m.moe.top_k
    for s in plan.stages:  # 4 all-to-alls per mixture-of-experts layer and microbatch, none recomputed
        assert s.moe_layers == sum(m.moe.is_moe_layer(i) for r in s.layers for i in r)
        assert s.all_to_all == 4 * s.moe_layers * plan.microbatches * d.all_to_all
        assert s.experts == s.moe_layers * m.moe.experts // 2 * 3 * m.moe.expert_hidden * m.hidden


def _dp4_ep2(rank, world, text, cache, base):
    """At dp 4 x ep 2 (tp 1, pp 1), bf16: the model state each ZeRO stage keeps against the plan's, and one
    step's expert all-to-alls (calls and bytes leaving this rank) against the plan's."""
    from megazero.engine.step import train_step
    from megazero.parallel.topology import Grid
    from tests.runs import engine_for

    out = {}
    for stage in (0, 1, 2, 3):
        sets = small_overrides(text, cache, base / "probe", steps=1) + [
            "model.arch=llama", "model.ffn_hidden=128", "model.moe.experts=4", "model.moe.top_k=2",
            "model.moe.expert_hidden=96", "model.moe.dense_layers=1", "model.layers=3", "parallel.ep=2",
            f"zero.stage={stage}", "train.precision=bf16", "train.micro_batch=1", "train.global_batch=8"]
        cfg = resolve(load_config(ROOT / "configs" / "tiny.yaml", sets), world, "cpu")
        grid = Grid.build(1, 1, world, "cpu", ep=2)
        data, engine = engine_for(cfg, grid, is_builder=grid.rank == 0)
        planned = make_plan(cfg).stages[0]
        grid.counter.reset()
        mbs = data.train_microbatches(0, grid.dp_rank, grid.dp, cfg.train.micro_batch, cfg.train.global_batch)
        train_step(engine.zero, engine.executor, engine.schedule, mbs, 1e-3, 1.0, engine.scaler)
        totals = [t for (kind, _, tag, _), t in grid.counter.totals.items() if kind == "all_to_all" and tag == "experts"]
        out[stage] = {"measured": engine.zero.model_state_bytes(), "planned": planned.model_state,
                      "calls": sum(t.calls for t in totals), "bytes": sum(t.bytes for t in totals),
                      "planned_calls": 4 * planned.moe_layers * cfg.microbatches, "planned_bytes": planned.all_to_all}
    return out


@pytest.fixture(scope="module")
def dp4_ep2(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe_plan")
    text = write_corpus(base / "corpus")
    return run_ranks(4, _dp4_ep2, text, base / "cache", base)


def test_expert_states_per_rank_under_ep_and_zero_are_the_plans(dp4_ep2):
    """Dense parameters shard over dp 4, the routed experts' over edp 2 (ZeRO's partition per reduction group):
    what a rank holds is the plan's, within its bucket padding (5%)."""
    for ranks in dp4_ep2:
        for stage, got in ranks.items():
            for kind in ("params", "grads", "optimizer"):
                want = got["planned"][kind]
                assert abs(got["measured"][kind] - want) <= 0.05 * want, (stage, kind, got)
    sharded = [dp4_ep2[0][s]["planned"]["optimizer"] for s in (0, 1)]
    assert sharded[1] < sharded[0] / 2  # ZeRO-1: a quarter of the dense states, a half of the experts'


def test_all_to_all_calls_and_bytes_per_step_are_the_plans(dp4_ep2):
    """Four all-to-alls per mixture-of-experts layer and microbatch (two forward, their two backward), exactly; the
    bytes leaving the ranks within 20% of the balanced plan's (a randomly initialised router is near balance)."""
    for stage in (0, 1, 2, 3):
        calls = [r[stage]["calls"] for r in dp4_ep2]
        assert calls == [dp4_ep2[0][stage]["planned_calls"]] * 4 and calls[0] == 4 * 2 * 2
        sent = sum(r[stage]["bytes"] for r in dp4_ep2)
        planned = 4 * dp4_ep2[0][stage]["planned_bytes"]
        assert abs(sent - planned) <= 0.2 * planned, (stage, sent, planned)


def test_a_run_that_does_not_fit_names_more_ep():
    """Mixtral at ep 1 on 8 ranks keeps every expert's states on each rank; ep 2 or more halves them: the
    one-line refusal names it among the knobs that fit."""
    import torch

    from megazero.errors import UserError
    from megazero.plan.fits import check_fits, needed_bytes

    cfg = resolve(load_config(MIXTRAL, ["parallel.pp=1", "parallel.dp=8", "parallel.ep=1", "parallel.world_size=8",
                                        "parallel.schedule=1f1b", "parallel.virtual_stages=1", "model.layers=2",
                                        "zero.stage=3", "train.global_batch=8"]), 8, "cuda", planned=True)
    need = needed_bytes(cfg, range(0, 1), "cuda")
    ep2 = resolve(load_config(MIXTRAL, ["parallel.pp=1", "parallel.dp=8", "parallel.ep=2", "parallel.world_size=8",
                                        "parallel.schedule=1f1b", "parallel.virtual_stages=1", "model.layers=2",
                                        "zero.stage=3", "train.global_batch=8"]), 8, "cuda", planned=True)
    assert needed_bytes(ep2, range(0, 1), "cuda") < need
    with pytest.raises(UserError) as e:
        check_fits(cfg, torch.device("cpu"), 0, 0, 1, available=needed_bytes(ep2, range(0, 1), "cpu"))
    assert "parallel.ep=2" in str(e.value) and "\n" not in str(e.value)


def _mixtral(*sets: str):
    return resolve(load_config(MIXTRAL, list(sets)), 64, "cuda", planned=True)


def test_step_time_counts_the_all_to_alls_on_the_ep_group_links():
    """With 16 experts: ep 1, no all-to-all; ep 8 (tp 1: eight adjacent ranks, one node), NVLink; ep 16 (two
    nodes), InfiniBand, slower per byte than the bytes alone would make it."""
    one, eight, sixteen = (step_time(_mixtral("model.moe.experts=16", f"parallel.ep={ep}"), H100) for ep in (1, 8, 16))
    assert one.ep_comm == 0.0 < eight.ep_comm < sixteen.ep_comm
    bytes8, bytes16 = (make_plan(_mixtral("model.moe.experts=16", f"parallel.ep={ep}")).stages[0].all_to_all
                       for ep in (8, 16))
    assert bytes16 / bytes8 == pytest.approx((15 / 16) / (7 / 8))
    assert sixteen.ep_comm / eight.ep_comm > 2 * bytes16 / bytes8  # NVLink 450 GB/s against 50 GB/s a GPU
    assert eight.terms["ep_comm"] == eight.ep_comm
    # the term is the stage's work, stretched by the bubble as the rest of it
    work = eight.compute + eight.elementwise + eight.recompute + eight.tp_comm + eight.ep_comm
    assert eight.bubble / (work + eight.bubble) == pytest.approx(eight.terms["bubble_share"], rel=1e-9)
    assert eight.total == pytest.approx(work + eight.bubble + eight.p2p + eight.dp_comm + eight.optimizer, rel=1e-12)


def test_step_time_reduces_expert_gradients_over_edp():
    """The experts' gradients reduce over edp: at a fixed layout more ep leaves fewer experts per rank to
    reduce, over fewer ranks; the dense ones are reduced over dp as before."""
    c = _mixtral()
    two, eight = step_time(_mixtral("parallel.ep=2"), H100), step_time(c, H100)
    assert eight.terms["dp_reduce"] < two.terms["dp_reduce"]


@pytest.fixture(scope="module")
def tiny_moe():
    return load_config(TINY_MOE)


def test_search_walks_ep_over_the_divisors_of_dp_that_divide_the_experts(tiny_moe):
    layouts = list(planner_layouts.candidates(tiny_moe, 8, {}))
    assert {lay.ep for lay in layouts} == {1, 2, 4, 8}
    assert all(lay.dp % lay.ep == 0 and 8 % lay.ep == 0 for lay in layouts)
    assert {lay.ep for lay in layouts if lay.dp == 2} == {1, 2}
    dense = load_config(ROOT / "configs" / "tiny-llama.yaml")
    assert {lay.ep for lay in planner_layouts.candidates(dense, 8, {})} == {1}
    found = planner.search(tiny_moe, H100, 8, {"recompute": "none", "micro_batch": 2, "pp": 2})
    assert {r.layout.ep for r in found.ranked} == {1, 2, 4}  # dp 4 at pp 2 allows ep 1, 2, 4
    for r in found.ranked:  # each is a valid config with that ep
        cfg = planner.configure(tiny_moe, r.layout, 8)
        assert cfg.parallel.ep == r.layout.ep


def test_layout_fixes_ep(tiny_moe, capsys):
    from megazero.plan import cli

    assert planner_layouts.parse_layout("ep=4,pp=1") == {"ep": 4, "pp": 1}
    found = planner.search(tiny_moe, H100, 8, {"ep": 4, "pp": 1, "recompute": "none"})
    assert found.ranked and {r.layout.ep for r in found.ranked} == {4}
    assert cli.main(["--config", str(TINY_MOE), "--cluster", "h100-80g", "--gpus", "8", "--layout",
                     "ep=4,pp=1,recompute=none", "--top", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:4] == ["tp", "pp", "dp", "ep"] and table[2].split()[4] == "4"
    assert "ep=4" in dataclasses.replace(found.ranked[0].layout).label()
