"""A run resumed at step 10 of 20 at its own layout equals the uninterrupted run bit for bit: every step's loss
and gradient norm, and every tensor of the last checkpoint (weights, optimizer states, buffers). The resumed run
starts, in a folder of its own, from the uninterrupted run's step-10 save (a save does not change the run it is
taken from: the uninterrupted curve is the same with or without it). One 4-rank spawn, fp32 on the CPU (the same
operations on the same values, so exactly equal):

- Muon at tp 2 x dp 2, ZeRO 1 (its momentum, the matrices exchanged over the stage's ranks);
- LAMB at pp 2 x dp 2, ZeRO 2 (its moments, sharded; the trust ratios' norms over the shard group);
- a mixture of experts with the sigmoid router and its bias update, ep 2 x dp 4 at ZeRO 1 (the selection bias,
  a buffer moved by each step's global load; the router statistics are a step's own and restart at zero).

1-bit Adam's resume (its per-rank error feedback) is tests/parallel/test_onebit_adam_runs.py. Seen failing: a
load that skips the buffers fails the mixture of experts; one that skips exp_avg fails all three."""
from __future__ import annotations

import pytest

from megazero.train.run import run
from tests.dist import run_ranks
from tests.runs import ROOT, assert_resume_exact, small_overrides, write_corpus

STEPS, SAVED = 20, 10
LLAMA = ["model.arch=llama", "model.kv_heads=2", "model.tie_embeddings=false"]
CASES = {
    "muon": ("tiny.yaml", {"optim.name": "muon", "train.lr": "2.0e-2", "optim.muon.adamw_lr": "4.0e-3",
                           "zero.stage": 1, "zero.bucket_mb": 0.02},
             ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]),
    "lamb": ("tiny.yaml", {"optim.name": "lamb", "train.lr": "1.0e-2", "zero.stage": 2, "zero.bucket_mb": 0.02},
             ["parallel.pp=2", "parallel.dp=2"]),
    "moe_sigmoid": ("tiny-llama.yaml", {"zero.stage": 1, "train.global_batch": 16},
                    LLAMA + ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_hidden=32",
                             "model.moe.dense_layers=1", "model.moe.router=sigmoid",
                             "model.moe.bias_update_rate=0.01", "model.moe.routed_scaling_factor=2.5",
                             "parallel.dp=4", "parallel.ep=2"]),
}


def _overrides(case, text, cache, log_dir, extra=()):
    config, values, layout = CASES[case]
    return small_overrides(text, cache, log_dir, steps=STEPS, **values) + layout + list(extra)


def _config(case):
    return str(ROOT / "configs" / CASES[case][0])


def _ranks(rank, world, text, cache, base):
    from megazero.checkpoint import store

    for case in CASES:  # the uninterrupted run saves at step SAVED too: the resumed run starts from that save
        whole = base / case / "whole"
        run(_config(case), _overrides(case, text, cache, whole, [f"train.save_every={SAVED}"]))
        saved = store.checkpoint_dir(whole / "checkpoints", SAVED)
        run(_config(case), _overrides(case, text, cache, base / case / "resumed", [f"train.resume={saved}"]))
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("exact_resume")
    text, cache = write_corpus(base / "text"), base / "cache"
    for config in sorted({c for c, _, _ in CASES.values()}):  # the data, built once per tokenizer
        run(str(ROOT / "configs" / config), small_overrides(text, cache, base / f"build_{config}", steps=1))
    run_ranks(4, _ranks, text, cache, base)
    return base


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_equals_the_uninterrupted_one(runs, case):
    assert_resume_exact(runs / case / "whole", runs / case / "resumed", SAVED, STEPS)
