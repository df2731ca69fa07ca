"""pretrain.py --simulate with a context-parallel ring: on fake tensors a ring runs one step of each kind
(``parallel.context.ring_plan``), each counted for the steps alike it stands for, and every figure equals the
full walk's (``--simulate full``). A ring of 1,024 ranks walked in full is 1,023 steps a layer of ~50 fake ops
each, forward and backward: over 20 minutes for one rank class of Llama 3 8B at 1M tokens."""
from __future__ import annotations

import pytest

from megazero.parallel.context import _block_plan, ring_plan
from tests.plan.test_simulate_extrapolate import _same, _simulate


def _kind(step: int, cp: int, rank: int) -> str:
    source = (rank - step) % cp
    return "own" if step == 0 else "last" if step == cp - 1 else "earlier" if source < rank else "later"


@pytest.mark.parametrize("cp", [2, 3, 4, 8, 1024])
def test_a_sampled_ring_stands_for_every_step_once(cp):
    """Every step is stood for once, by a step of its kind whose blocks have its shapes; the K/V hops (every step
    but the last) and the gradient hops (every step) are counted as often as in the full walk."""
    for rank in sorted({0, 1 % cp, cp // 2, cp - 1}):
        full, sampled = ring_plan(cp, rank, False), ring_plan(cp, rank, True)
        assert full == [(s, 1) for s in range(cp)]
        assert len(sampled) <= 4 and [s for s, _ in sampled] == sorted(s for s, _ in sampled)
        assert sum(t for _, t in sampled) == cp and sum(t for s, t in sampled if s < cp - 1) == cp - 1
        kinds = {}
        for s in range(cp):
            kinds.setdefault(_kind(s, cp, rank), []).append(s)
        assert sorted(_kind(s, cp, rank) for s, _ in sampled) == sorted(kinds), (cp, rank, sampled)
        for s, times in sampled:
            alike = kinds[_kind(s, cp, rank)]
            assert times == len(alike), (cp, rank, s, times)
            shapes = [[(r.stop - r.start, k.stop - k.start, c) for r, k, c in _block_plan(t, (rank - t) % cp, rank, 8)]
                      for t in alike]
            assert all(x == shapes[0] for x in shapes), (cp, rank, s)


def test_sampled_ring_figures_equal_the_full_walk(capsys, tmp_path, monkeypatch):
    """configs/tiny.yaml as Llama (rotary tables over the whole sequence) at cp 8 and seq 1024, ZeRO-1 over
    dp 2 x cp 8, on rank 3 (earlier and later ranks' K/V both): the peak, its split, the states, the build and
    the bytes sent per group equal the full walk's (bytes exactly, the bytes sent to 1e-12)."""
    sets = ["model.arch=llama", "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=1",
            "parallel.dp=2", "parallel.cp=8", "parallel.world_size=16", "model.seq_len=1024", "zero.stage=1",
            "train.global_batch=8", "launch.rank=3", "launch.memory_gb=80"]
    import megazero.parallel.context as context

    walks = []

    def recorded(cp: int, rank: int, sampled: bool):
        walks.append(sampled)
        return ring_plan(cp, rank, sampled)

    monkeypatch.setattr(context, "ring_plan", recorded)
    _, got = _simulate(capsys, tmp_path / "sampled", sets=sets)
    sampled, walks[:] = list(walks), []
    _, want = _simulate(capsys, tmp_path / "full", "full", sets=sets)
    assert sampled and all(sampled) and walks and not any(walks), (sampled, walks)  # each walked as it says
    assert got["comm_bytes"]["cp"] > 0, got["comm_bytes"]
    _same(got, want)
