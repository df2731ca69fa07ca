"""Where one rank's schedule becomes periodic (megazero.plan.periodic): the fewest microbatches a simulation of
that rank runs before extrapolating, checked against the schedule itself and the plan's activation walk."""
from __future__ import annotations

import pytest

from megazero.plan.activations import activation_peak, peak_microbatches
from megazero.plan.periodic import periodic_microbatches, repeats_a_period, signature
from megazero.parallel.schedules import build_schedule


def test_zb1p_and_1f1b_ranks_repeat_sooner_than_every_rank_together():
    """zb1p repeats (F, B, W) on every rank from pp + 2 microbatches, 1F1B rank r from pp - r + 2 (its warm-up
    is shorter), both well under the plan's 2pp + 2 for all ranks at once; GPipe never (every microbatch is
    held); the overlapped receives of 1F1B add one to the middle ranks."""
    for pp in (2, 4, 16):
        m = 4 * pp + 7
        assert [periodic_microbatches("zb1p", pp, r, m) for r in range(pp)] == [pp + 2] * pp
        assert [periodic_microbatches("1f1b", pp, r, m) for r in range(pp)] == [pp - r + 2 for r in range(pp)]
        assert pp + 2 < peak_microbatches("zb1p", pp, m)
    assert [periodic_microbatches("1f1b", 4, r, 23, overlap_p2p=True) for r in range(4)] == [6, 6, 5, 3]
    assert periodic_microbatches("gpipe", 4, 0, 40) is None
    assert periodic_microbatches("zb1p", 4, 0, 7) == 6 and periodic_microbatches("zb1p", 4, 0, 6) is None
    assert [periodic_microbatches("interleaved", 4, r, 64, 2, step=4) for r in range(4)] == [16, 16, 16, 12]


@pytest.mark.parametrize("name, v, overlap", [("1f1b", 1, False), ("1f1b", 1, True), ("zb1p", 1, False),
                                              ("zb1p", 1, True), ("interleaved", 2, False)])
def test_each_rank_keeps_its_activation_peak_from_its_periodic_count(name, v, overlap):
    """The plan's walk of held microbatches (activation_peak, chunks of unequal sizes) on each rank's schedule:
    the same peak and count at the rank's periodic count, at every count past it, and far beyond."""
    per = [7, 11][:v]
    for pp in range(2, 7):
        step = pp if name == "interleaved" else 1
        m = 8 * pp
        for rank in range(pp):
            low = periodic_microbatches(name, pp, rank, m, v, overlap, step)
            want = activation_peak(build_schedule(name, pp, m, v, overlap_p2p=overlap)[rank], per)
            for n in range(low, m, step):
                got = activation_peak(build_schedule(name, pp, n, v, overlap_p2p=overlap)[rank], per)
                assert got[0] == want[0], (pp, rank, n, got, want)


def test_one_more_microbatch_is_one_more_period():
    """The check itself: a block inserted after an equal block is one more period; one inserted elsewhere,
    or a changed action, is not. And a zb1p rank's schedule at pp + 2 and pp + 3 microbatches differ so."""
    assert repeats_a_period(list("abcXYXYde"), list("abcXYXYXYde"))
    assert not repeats_a_period(list("abcXYde"), list("abcXYXZde"))
    assert not repeats_a_period(list("abcde"), list("abXYcde"))
    assert not repeats_a_period(list("abc"), list("abc"))
    short, long = (signature(build_schedule("zb1p", 4, n)[1], n, True) for n in (6, 7))
    assert repeats_a_period(short, long)
    short = signature(build_schedule("zb1p", 4, 5)[1], 5, True)
    assert not repeats_a_period(short, signature(build_schedule("zb1p", 4, 6)[1], 6, True))
