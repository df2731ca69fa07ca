"""Mixtures of experts under context parallelism train the single-process model: cp 2 x tp 2 (sequence
parallel) in both cp modes, ring and all-to-all, with the Switch balance loss and the router z-loss on. Each cp
rank routes its part of every sequence, so a sequence's expert shares f_e are summed over the cp ranks (as over
tp) before the balance term: the loss, the gradient norm and the logged router figures equal one process's.

Tolerances as tests/models/test_moe.py: fp32 on the CPU, 1e-5 relative over 6 steps (only the order of sums
differs); discrete routing gives equal loads."""
from __future__ import annotations

from functools import partial

import pytest

from megazero.train.run import run
from tests.dist import run_ranks
from tests.runs import read_metrics, ROOT, run_layouts, run_tree, small_overrides, NO_FINAL_SAVE

CONFIG = str(ROOT / "configs" / "tiny-llama.yaml")
STEPS = 6
MOE = {"model.arch": "llama", "model.layers": 2, "model.heads": 4, "model.kv_heads": 4, "model.ffn_hidden": 64,
       "model.tie_embeddings": "false", "model.moe.experts": 8, "model.moe.top_k": 2,
       "model.moe.expert_hidden": 32, "model.moe.shared_experts": 1, "model.moe.dense_layers": 0,
       "model.moe.aux_loss": 0.05, "model.moe.z_loss": 0.01, "train.global_batch": 8}
CP2_TP2 = ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = [("cp2_tp2_ring", CP2_TP2 + ["parallel.cp_mode=ring"]),
           ("cp2_tp2_all_to_all", CP2_TP2 + ["parallel.cp_mode=all_to_all"])]


def _overrides(text, cache, log_dir, extra=()):
    return small_overrides(text, cache, log_dir, steps=STEPS, **MOE, **NO_FINAL_SAVE) + list(extra)


def _four_ranks(rank, world, text, cache, base):
    run_layouts(CONFIG, partial(_overrides, text, cache), base, LAYOUTS)
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base, text, cache = run_tree(tmp_path_factory, "moe_cp")
    run(CONFIG, _overrides(text, cache, base / "one"))
    run_ranks(4, _four_ranks, text, cache, base)
    return base


def _records(folder):
    return [r for r in read_metrics(folder) if "loss" in r]


@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_moe_under_context_parallelism_trains_the_single_process_model(runs, name):
    want, got = _records(runs / "one"), _records(runs / name)
    assert len(got) == len(want) == STEPS
    for a, b in zip(want, got):
        for k in ["loss", "grad_norm"] + [k for k in a if k.startswith("moe/")]:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]) + 1e-12, (name, a["step"], k, a[k], b[k])
    assert 0.5 < want[-1]["moe/aux_loss"] < 4.0  # E * sum f P: 1 when balanced, so the term is on
