"""bench/step_profile.py's device-busy time counts overlapping kernels once (tests/bench/test_bench_kernels.py runs the
script end to end, through gpu_checks.py --smoke)."""
from bench.step_profile import _busy_union


def test_busy_union_counts_overlaps_once():
    assert _busy_union([]) == 0.0
    assert _busy_union([(0, 2), (1, 3), (5, 6)]) == 4.0  # [0, 3] and [5, 6]
    assert _busy_union([(5, 6), (0, 10), (2, 3)]) == 10.0  # nested, unsorted
    assert _busy_union([(0, 1), (1, 2)]) == 2.0  # touching
