"""The step-time model (megazero.plan.step_time): a pure function whose terms move the right way, hand-checked
pieces, and the fitted defaults against the published rows (megazero.plan.published, shared with bench/planner.py)."""
from __future__ import annotations

import copy
import math

import pytest

from megazero.plan.cluster import load_cluster
from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.plan.published import ROOT, predict, rows
from megazero.plan.step_time import Constants, group_link, ring, step_time

A100 = load_cluster("a100-80g")
H100 = load_cluster("h100-80g")
SMALL = ["model.layers=8", "model.hidden=1024", "model.heads=16", "model.seq_len=2048", "model.vocab_size=51200",
         "train.precision=bf16", "model.activation_checkpointing=false", "parallel.dp=auto",
         "parallel.tp=1", "parallel.pp=1"]


def cfg(gpus: int, *sets: str):
    return resolve(load_config(ROOT / "configs" / "gpt13b.yaml", SMALL + list(sets)), gpus, "cuda", planned=True)


def test_pure_function():
    c = cfg(16, "parallel.tp=2", "parallel.pp=2", "train.global_batch=64", "train.micro_batch=1")
    before = copy.deepcopy(c)
    a, b = step_time(c, H100), step_time(c, H100)
    assert a == b
    assert c == before  # the config is not touched


def test_more_tp_on_a_small_model_raises_tp_comm():
    t = [step_time(cfg(8, f"parallel.tp={tp}", "train.global_batch=64", "train.micro_batch=1"), A100).tp_comm
         for tp in (1, 2, 8)]
    assert t[0] == 0.0 < t[1] < t[2]


def test_more_microbatches_shrink_the_bubble_share():
    def share(batch):
        st = step_time(cfg(4, "parallel.pp=4", f"train.global_batch={batch}", "train.micro_batch=1"), A100)
        return st.bubble / st.total

    assert share(4) > share(16) > share(64) > 0


def test_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    p, m = 4, 12
    st = step_time(cfg(4, "parallel.pp=4", f"train.global_batch={m}", "train.micro_batch=1"), A100)
    work = st.total - st.bubble - st.p2p - st.dp_comm - st.optimizer
    assert st.bubble / (work + st.bubble) == pytest.approx((p - 1) / (m + p - 1))


def test_recompute_adds_time():
    base = ["parallel.tp=2", "train.global_batch=64", "train.micro_batch=1"]
    off = step_time(cfg(8, *base), A100)
    on = step_time(cfg(8, *base, "model.activation_checkpointing=true"), A100)
    assert off.recompute == 0.0 < on.recompute
    assert on.total > off.total
    assert on.tp_comm > off.tp_comm  # the recomputed forward's collectives


def test_zero3_adds_dp_time():
    base = ["train.global_batch=64", "train.micro_batch=1"]
    z1 = step_time(cfg(64, *base, "zero.stage=1"), A100)
    z3 = step_time(cfg(64, *base, "zero.stage=3"), A100)
    assert z3.terms["dp_gather"] > z1.terms["dp_gather"] > 0
    assert z3.total >= z1.total


def test_pure_dp_is_compute_plus_the_unhidden_all_reduce():
    # a slow inter-node link so the all-reduce cannot hide behind the last microbatch's backward
    c = cfg(64, "parallel.tp=8", "train.global_batch=64", "train.micro_batch=1")
    slow = load_cluster("a100-80g").__class__(**{**A100.__dict__, "inter_node_gbps": 0.5})
    st = step_time(c, slow)
    reduce = st.terms["dp_reduce"]
    assert reduce > st.terms["dp_hideable"]
    assert st.dp_comm == pytest.approx(reduce - st.terms["dp_hideable"])
    compute = st.compute + st.elementwise + st.recompute + st.tp_comm
    assert st.total == pytest.approx(compute + st.dp_comm + st.optimizer)


def test_crossing_nodes_slows_a_collective():
    inside, across = group_link(A100, 8, 1), group_link(A100, 16, 1)
    assert across[0] < inside[0]
    c = Constants()
    assert ring(1e9, 16, across, c) > ring(1e9, 8, inside, c)
    # a dp group one GPU per node drives one adapter; eight per node drive eight
    assert group_link(A100, 32, 8)[0] == pytest.approx(A100.inter_node_gbps * 1e9)
    assert group_link(A100, 32, 1)[0] == pytest.approx(8 * A100.inter_node_gbps * 1e9)
    # and the step: tp 16 spans two nodes
    t8 = step_time(cfg(16, "parallel.tp=8", "train.global_batch=16", "train.micro_batch=1"), A100).tp_comm
    t16 = step_time(cfg(16, "parallel.tp=16", "train.global_batch=16", "train.micro_batch=1"), A100).tp_comm
    assert t16 > t8


@pytest.mark.parametrize("row", rows(named=True), ids=[r.name for r in rows(named=True)])
def test_fitted_defaults_predict_the_published_rows_within_10_percent(row):
    pred, st, _ = predict(row)
    assert abs(math.log(pred / row.tflops)) <= math.log(1.10), (row.name, pred, row.tflops)
    assert st.memory_bytes <= load_cluster("a100-80g" if row.source == "narayanan" else "h100-80g").memory_gb * 0.9e9
