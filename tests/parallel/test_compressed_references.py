"""The compressed optimizers against their papers' algorithms at 4 gloo ranks, ZeRO 0 and 1: 1-bit Adam (Tang et
al. 2021), 0/1 Adam (Lu et al. 2022) and 1-bit LAMB (Li et al. 2021), each rank's weights against the 4 workers
simulated in this process. Each optimizer's module holds its rank side, its reference, its tolerance and why:
tests/parallel/test_onebit_adam.py, test_zero_one_adam.py, test_onebit_lamb.py. One spawn runs all three (a
spawn of 4 ranks costs ~4.5 s of the suite's time)."""
from __future__ import annotations

import pytest

from tests.dist import run_ranks

WORLD = 4


def _every_rank_side(rank: int, world: int) -> dict:
    from tests.parallel import test_onebit_adam, test_onebit_lamb, test_zero_one_adam

    return {"onebit_adam": test_onebit_adam.rank_side(rank, world),
            "zero_one_adam": test_zero_one_adam.rank_side(rank, world),
            "onebit_lamb": test_onebit_lamb.rank_side(rank, world)}


@pytest.fixture(scope="module")
def ranks() -> dict:
    results = run_ranks(WORLD, _every_rank_side)
    return {name: [r[name] for r in results] for name in results[0]}


def test_onebit_adam_equals_the_papers_algorithm_and_sends_a_sixteenth(ranks):
    from tests.parallel.test_onebit_adam import check_four_ranks

    check_four_ranks(ranks["onebit_adam"])


def test_zero_one_adam_equals_the_papers_algorithm_with_local_steps_that_send_nothing(ranks):
    from tests.parallel.test_zero_one_adam import check_four_ranks

    check_four_ranks(ranks["zero_one_adam"])


def test_onebit_lamb_equals_the_papers_algorithm_and_adapts_the_trust_ratios(ranks):
    from tests.parallel.test_onebit_lamb import check_four_ranks

    check_four_ranks(ranks["onebit_lamb"])
