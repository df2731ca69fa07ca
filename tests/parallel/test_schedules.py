"""Pipeline schedules as pure functions: completeness, ordering, p2p pairing, deadlock freedom, bubbles."""
from collections import Counter

import pytest

from megazero.parallel.pipeline import partition_layers
from megazero.parallel.schedule_analysis import check_deadlock_free, simulate
from megazero.parallel.schedules import (
    COMM,
    Action,
    build_schedule,
    events,
    schedule_constraint,
    virtual_stage,
)


def cases():
    for pp in (1, 2, 4, 8):
        for m in range(1, 4 * pp + 1):
            for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("zb1p", (1,)), ("interleaved", (2, 3))):
                for v in vs:
                    if schedule_constraint(name, pp, m, v) is None:
                        yield name, pp, m, v


CASES = list(cases())


def test_the_case_grid_covers_every_schedule():
    names = Counter(c[0] for c in CASES)
    assert names["gpipe"] == names["1f1b"] == names["zb1p"] == sum(4 * pp for pp in (1, 2, 4, 8))
    assert names["interleaved"] == 2 * sum(4 for pp in (2, 4, 8))  # m in {pp, 2pp, 3pp, 4pp}, v in {2, 3}


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_schedule_is_complete_ordered_and_deadlock_free(name, pp, m, v):
    sched = build_schedule(name, pp, m, v)
    assert len(sched) == pp
    for rank, actions in enumerate(sched):
        computes = [(a.kind, a.mb, a.chunk) for a in actions if a.kind in ("F", "B")]
        # every microbatch's forward and backward exactly once per chunk
        assert Counter(computes) == Counter((k, mb, c) for k in ("F", "B") for mb in range(m) for c in range(v))
        # each forward precedes its backward, which precedes its weight gradient (zb1p: each exactly once)
        order = [(a.kind, a.mb, a.chunk) for a in actions if a.kind in ("F", "B", "W")]
        assert sorted(k[1:] for k in order if k[0] == "W") == ([(mb, 0) for mb in range(m)] if name == "zb1p" else [])
        for mb in range(m):
            for c in range(v):
                assert order.index(("F", mb, c)) < order.index(("B", mb, c))
                if name == "zb1p":
                    assert order.index(("B", mb, c)) < order.index(("W", mb, c))
        # a receive comes before the compute that consumes it, a send after the one that produces it
        for i, a in enumerate(actions):
            if a.kind in ("recv_f", "recv_b"):
                want = "F" if a.kind == "recv_f" else "B"
                assert any((b.kind, b.mb, b.chunk) == (want, a.mb, a.chunk) for b in actions[i + 1:])
            if a.kind in ("send_f", "send_b"):
                want = "F" if a.kind == "send_f" else "B"
                assert any((b.kind, b.mb, b.chunk) == (want, a.mb, a.chunk) for b in actions[:i])
        # the first virtual stage receives no activations, the last receives no gradients
        for a in actions:
            vs = virtual_stage(rank, a.chunk, pp)
            assert not (vs == 0 and a.kind in ("recv_f", "send_b"))
            assert not (vs == pp * v - 1 and a.kind in ("send_f", "recv_b"))
    check_deadlock_free(sched, pp)   # sends/receives pair up in order; rendezvous semantics never stall
    ahead = build_schedule(name, pp, m, v, overlap_p2p=True)  # posted ahead, waited at first use
    assert [[a for a in r if a.kind not in COMM] for r in ahead] == [[a for a in r if a.kind not in COMM]
                                                                     for r in sched]
    assert [sorted(map(str, r)) for r in ahead] == [sorted(map(str, r)) for r in sched]
    check_deadlock_free(ahead, pp, overlap_p2p=True)
    simulate(sched, pp)              # cross-stage dependencies can all be met in the ranks' orders
    evaluation = build_schedule(name, pp, m, v, forward_only=True)
    assert all(a.kind in ("F", "send_f", "recv_f") for actions in evaluation for a in actions)
    check_deadlock_free(evaluation, pp)


@pytest.mark.parametrize("pp,m", [(pp, m) for pp in (1, 2, 4, 8) for m in range(1, 4 * pp + 1)])
def test_1f1b_bubble_and_memory(pp, m):
    sim = simulate(build_schedule("1f1b", pp, m), pp)
    for frac in sim["idle_fraction"]:
        assert frac == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert sim["peak_in_flight"] == [min(pp - r, m) for r in range(pp)]
    gpipe = simulate(build_schedule("gpipe", pp, m), pp)
    assert gpipe["peak_in_flight"] == [m] * pp
    assert gpipe["makespan"] == pytest.approx(sim["makespan"])  # same bubble, more memory


@pytest.mark.parametrize("pp,m,v", [(pp, k * pp, v) for pp in (2, 4, 8) for k in (1, 2, 4) for v in (2, 3)])
def test_interleaving_shrinks_the_bubble(pp, m, v):
    one = simulate(build_schedule("1f1b", pp, m), pp)["idle_fraction"][0]
    inter = simulate(build_schedule("interleaved", pp, m, v), pp)["idle_fraction"]
    assert max(inter) < one
    if m > pp:  # steady state reached: Narayanan et al.'s (pp-1)/(v*m + pp-1) with chunk cost 1/v
        assert max(inter) == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zb1p_bubble_is_a_third_of_1f1b_at_the_same_memory(pp):
    """ZB-H1 (Qi et al. 2023, §3.1) with equal F, B and W costs: 1F1B idles (p-1)(F+B+W) per rank, zb1p
    (p-1)(F+B-W). The bubble is the idle time (the paper's measure); as a share of zb1p's shorter step it is
    0.36-0.48 of 1F1B's share over these m. Memory: at most p microbatches held on a rank, as 1F1B's first."""
    for m in range(pp, 4 * pp + 1):
        one = simulate(build_schedule("1f1b", pp, m), pp, 1.0, 1.0, 1.0)
        zb = simulate(build_schedule("zb1p", pp, m), pp, 1.0, 1.0, 1.0)
        assert one["makespan"] - 3 * m == pytest.approx(3 * (pp - 1))
        idle = [zb["makespan"] - busy for busy in zb["busy"]]
        assert max(idle) <= 0.4 * 3 * (pp - 1)
        assert max(idle) == pytest.approx(pp - 1)  # exactly (p-1)(F+B-W)
        assert max(zb["peak_in_flight"]) <= max(one["peak_in_flight"]) == pp
    # unequal costs (W cheaper than B, as when attention's backward is all input gradient): still below 1F1B
    for m in (pp, 2 * pp):
        one = simulate(build_schedule("1f1b", pp, m), pp, 1.0, 1.2, 0.8)
        zb = simulate(build_schedule("zb1p", pp, m), pp, 1.0, 1.2, 0.8)
        assert zb["makespan"] < one["makespan"] - (pp - 1) * 1.0


def test_overlap_waits_transfers_late():
    """1F1B at pp 4, rank 1, steady state (F(k), then B(k-3)): the gradient sent after B(k-3) is waited only
    after the next forward, which it overlaps; the activation sent after F(k) goes out with the receives of
    the next forward and backward, waited just before that backward; one wait per post."""
    sched = build_schedule("1f1b", 4, 8, overlap_p2p=True)
    ev = events(sched[1], True)
    post = {str(a): i for i, e in enumerate(ev) if e[0] == "post" for a in e[2]}
    group = {str(a): e[1] for e in ev if e[0] == "post" for a in e[2]}
    wait = {e[1]: i for i, e in enumerate(ev) if e[0] == "wait"}
    compute = {str(e[1]): i for i, e in enumerate(ev) if e[0] == "compute"}
    for k in range(4, 8):
        assert compute[f"B{k - 3}"] < post[f"send_b{k - 3}"] < compute[f"F{k}"] < wait[group[f"send_b{k - 3}"]]
        assert group[f"send_f{k - 1}"] == group[f"recv_f{k}"] == group[f"recv_b{k - 3}"]
        assert compute[f"F{k - 1}"] < post[f"recv_f{k}"] < wait[group[f"recv_f{k}"]] < compute[f"B{k - 3}"]
    assert sum(e[0] == "wait" for e in ev) == sum(e[0] == "post" for e in ev)
    waited = [events(build_schedule("1f1b", 4, 8)[1])[i:i + 2] for i in range(0, 2)]
    assert waited[0][0][0] == "post" and waited[0][1] == ("wait", waited[0][0][1])  # without overlap: in place


def test_checker_rejects_receives_ahead_that_cross_on_a_pair():
    """Receives of both directions posted ahead (the backward's too) cross on a rank pair: rank 1 posts
    the receive of grad 1 before the send of activation 3, rank 2 the receive of activation 3 before the
    send of grad 1. Each rank's groups run in posting order (NCCL's one stream per process group): a cycle."""
    text = ["F0 send_f0 F1 send_f1 F2 send_f2 F3 send_f3 recv_b0 B0 recv_b1 B1 recv_b2 B2 recv_b3 B3",
            "recv_f0 F0 send_f0 recv_f1 F1 send_f1 recv_f2 F2 send_f2 recv_f3 recv_b0 B0 send_b0 recv_b1 F3 "
            "send_f3 B1 send_b1 recv_b2 B2 send_b2 recv_b3 B3 send_b3",
            "recv_f0 F0 send_f0 recv_f1 F1 send_f1 recv_f2 recv_b0 B0 send_b0 recv_b1 F2 send_f2 recv_f3 B1 "
            "send_b1 recv_b2 F3 send_f3 B2 send_b2 recv_b3 B3 send_b3",
            "recv_f0 F0 B0 send_b0 recv_f1 F1 B1 send_b1 recv_f2 F2 B2 send_b2 recv_f3 F3 B3 send_b3"]
    sched = [[Action(w.rstrip("0123456789"), int(w[len(w.rstrip("0123456789")):])) for w in line.split()]
             for line in text]
    with pytest.raises(AssertionError, match="deadlock"):
        check_deadlock_free(sched, 4, overlap_p2p=True)


def test_deadlock_checker_catches_a_bad_order():
    sched = build_schedule("1f1b", 2, 4)
    # rank 1 receives microbatch 1 before microbatch 0: channel order mismatch
    r1 = sched[1]
    i, j = r1.index(next(a for a in r1 if a.kind == "recv_f" and a.mb == 0)), \
        r1.index(next(a for a in r1 if a.kind == "recv_f" and a.mb == 1))
    bad = [list(sched[0]), r1[:i] + [r1[j]] + r1[i + 1:j] + [r1[i]] + r1[j + 1:]]
    with pytest.raises(AssertionError):
        check_deadlock_free(bad, 2)
    # rank 0 waits for the gradient before sending the activation it depends on: a rendezvous deadlock
    stuck = [[Action("F", 0), Action("recv_b", 0), Action("B", 0), Action("send_f", 0)],
             [Action("recv_f", 0), Action("F", 0), Action("B", 0), Action("send_b", 0)]]
    with pytest.raises(AssertionError):
        check_deadlock_free(stuck, 2)


def test_invalid_combinations_are_explained():
    assert "multiple of parallel.pp" in schedule_constraint("interleaved", 4, 6, 2)
    assert "virtual_stages >= 2" in schedule_constraint("interleaved", 4, 8, 1)
    assert "must be 1" in schedule_constraint("1f1b", 4, 8, 2)
    assert "unknown schedule" in schedule_constraint("zigzag", 4, 8, 1)
    assert "must be 1" in schedule_constraint("zb1p", 4, 8, 2)


def test_partition_layers():
    assert partition_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert partition_layers(8, 8) == [range(i, i + 1) for i in range(8)]
    assert partition_layers(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
