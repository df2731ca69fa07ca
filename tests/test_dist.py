"""tests/dist.py's ranks, forked from a preloading forkserver, behave as spawned ones did: the project comes from
the caller's tree, unseeded draws differ per rank, and the caller's environment reaches the rank."""
import os

import torch

import megazero
from tests.dist import run_ranks


def _what_a_rank_sees(rank, world):
    import megazero as m

    return m.__file__, torch.randn(4).tolist(), os.environ.get("MEGAZERO_TEST_DIST_MARK")


def test_ranks_import_this_tree_draw_their_own_numbers_and_see_the_callers_environment(monkeypatch):
    monkeypatch.setenv("MEGAZERO_TEST_DIST_MARK", "set after the forkserver may have started")
    results = run_ranks(2, _what_a_rank_sees)
    assert all(path == megazero.__file__ for path, _, _ in results), (megazero.__file__, results)
    assert results[0][1] != results[1][1]  # a fork copies the generator: without a reseed both ranks draw alike
    assert all(mark == "set after the forkserver may have started" for _, _, mark in results)
