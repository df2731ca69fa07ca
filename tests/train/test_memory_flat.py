"""A long run's host memory is flat: nothing kept per step grows with the step count (the communication
counter adds up, step records are bounded, the pipeline's timeline is the last step's)."""
from __future__ import annotations

import os

from tests.dist import run_ranks
from tests.runs import ROOT, small_overrides, write_corpus

STEPS = 550
RSS_FROM = 100  # the resident set after this step is the baseline (warm: caches, first-touch pages)
OBJECTS_FROM = 300  # Python objects are counted here and after the last step
# per step, what the bounds allow to stay alive: 1% of the resident set over 900 steps, 1000 objects over 500
RSS_BOUND = 0.01 * (STEPS - RSS_FROM) / 900
OBJECTS_BOUND = 1000 * (STEPS - OBJECTS_FROM) // 500


def _rss_bytes() -> int:
    """Resident bytes after glibc returns its free heap pages: what is alive, less the allocator's slack."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train_and_sample(rank: int, world: int, corpus, tmp) -> dict[int, int]:
    import gc

    import torch

    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.train.run_dir import plan_start
    from megazero.train.trainer import Trainer
    from megazero.parallel.topology import Grid

    sets = small_overrides(corpus, tmp / "cache", tmp / "run", steps=STEPS, **{
        "parallel.tp": 2, "parallel.sequence_parallel": "true", "train.micro_batch": 8, "train.global_batch": 8,
        "log.tensorboard": "false", "train.save_every": 0})
    cfg = resolve(load_config(str(ROOT / "configs" / "tiny.yaml"), sets), world, "cpu")
    trainer = Trainer(cfg, Grid.build(2, 1, 1, "cpu"), torch.device("cpu"), is_builder=rank == 0)
    rss: dict[int, int] = {}
    original = trainer.train_step

    def step_and_sample():  # instrumentation around the step, the loop itself is fit()'s
        record = original()
        if trainer.step in (RSS_FROM, STEPS):
            rss[trainer.step] = _rss_bytes()
        if trainer.step in (OBJECTS_FROM, STEPS):  # Python objects alive at the same point of a step
            gc.collect()
            rss["objects"] = len(gc.get_objects()) - rss.get("objects", 0)
        return record

    trainer.train_step = step_and_sample
    trainer.fit(plan_start(cfg))
    assert trainer.grid.counter.count() > 25 * STEPS, trainer.grid.counter.summary()  # every step's collectives counted
    return rss


def test_resident_memory_after_550_steps_is_within_half_a_percent_of_step_100(tmp_path):
    """550 steps of a tiny model at tp=2 with sequence parallelism (31 counted collectives a step) on 2 gloo
    ranks, every step logged. The acceptance bound is a resident set after step 1000 within 1% of the one after
    step 100; at the same growth per step, the resident set after step 550 is within 0.5% of step 100's
    (measured after glibc returns its free pages, the run grows ~0.1% by step 550 and ~0.2% by step 1000; the
    old per-call counter, put back for the measure, grew 1.6% over those 900 steps and 0.8% over these 450). A
    slow Python leak could hide under that bound, so Python's objects are counted too: at the same point of
    step 550 and of step 300, after a collection, there may be at most 500 more (a correct run's count does not
    move at all; the old counter added 31 records a step, 7,749 here). These are half the steps of the 1000-step
    run this replaced (36 ms a step on two cores), with both bounds halved: the same growth per step fails
    either."""
    corpus = write_corpus(tmp_path / "text")
    for rank, rss in enumerate(run_ranks(2, _train_and_sample, corpus, tmp_path, timeout=600)):
        assert set(rss) == {RSS_FROM, STEPS, "objects"}
        assert rss[STEPS] < rss[RSS_FROM] * (1 + RSS_BOUND), (rank, rss[RSS_FROM] / 2**20, rss[STEPS] / 2**20)
        assert rss["objects"] < OBJECTS_BOUND, (rank, rss["objects"])
