"""Mixtures of experts train the same model at every layout: ep 2 and 4 at dp 4, with tp and sequence
parallelism, under every pipeline schedule, under ZeRO 1-3, with both routers; a checkpoint saved at ep 4
resumes at ep 2 and at ep 1. The router's statistics (auxiliary loss, the sigmoid router's bias) equal the
single process's step after step.

Tolerances: fp32 on the CPU. The loss agrees to 1e-5 relative over 6 steps (only the order of floating-point
sums differs between layouts: measured ~2e-7). The gradient norm to 1e-5 as well (measured ~5e-6: the
layout changes how the CPU's float32 norm pieces fall, parallel.zero.adamw.sq_norm). Routing is discrete:
the same logits to ~1e-7 choose the same experts, so loads, and the bias moved by their sign, are equal
exactly; the balance loss is a sum of products of those loads with probabilities, 1e-5 as the loss.
"""
from __future__ import annotations

from functools import partial

import pytest

from megazero.train.run import run
from tests.dist import run_ranks
from tests.runs import (latest_checkpoint, NO_FINAL_SAVE, read_metrics, ROOT, run_layouts, run_saved_and_resumed,
                        run_tree, small_overrides)

CONFIG = str(ROOT / "configs" / "tiny-llama.yaml")
STEPS = 6
STOP = 3  # the ep 4 run saves here; ep 2 and ep 1 continue from it
MOE = {"model.arch": "llama", "model.layers": 3, "model.heads": 4, "model.kv_heads": 2, "model.ffn_hidden": 64,
       "model.tie_embeddings": "false", "model.moe.experts": 8, "model.moe.top_k": 2,
       "model.moe.expert_hidden": 32, "model.moe.shared_experts": 1, "model.moe.dense_layers": 1,
       "model.moe.aux_loss": 0.01, "model.moe.z_loss": 0.001, "train.global_batch": 16}
SIGMOID = ["model.moe.router=sigmoid", "model.moe.routed_scaling_factor=2.5", "model.moe.bias_update_rate=0.01",
           f"train.save_every={STEPS}"]  # the last step saved: every layer's whole bias vector compared
FOUR_LAYERS = ["model.layers=4"]  # interleaved pp 2 needs 4 (virtual) stages: its own reference
LAYOUTS = [
    ("ep2", ["parallel.ep=2"]),
    ("ep4", ["parallel.ep=4"]),
    ("tp2_sp_ep2", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
    ("tp2_ep2", ["parallel.tp=2", "parallel.ep=2"]),
    ("pp2_1f1b_ep2", ["parallel.pp=2", "parallel.ep=2"]),
    ("pp2_zb1p_ep2", ["parallel.pp=2", "parallel.schedule=zb1p", "parallel.ep=2"]),
    ("pp2_interleaved_ep2", ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                             "parallel.ep=2"] + FOUR_LAYERS),
    ("z1_ep2", ["zero.stage=1", "parallel.ep=2", "zero.bucket_mb=0.05"]),  # several buckets per partition
    ("z2_ep2", ["zero.stage=2", "parallel.ep=2", "zero.bucket_mb=0.05"]),
    ("z3_ep2", ["zero.stage=3", "parallel.ep=2"]),
    ("sigmoid_ep4", SIGMOID + ["parallel.ep=4"]),
    ("sigmoid_tp2_sp_ep2_z2", SIGMOID + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                                         "zero.stage=2"]),
]
REFERENCE = {"pp2_interleaved_ep2": "one_4_layers", "sigmoid_ep4": "one_sigmoid",
             "sigmoid_tp2_sp_ep2_z2": "one_sigmoid", "resumed_ep2": "one", "resumed_ep1": "one"}


def _overrides(text, cache, log_dir, extra=()):
    # the end checkpoints read are the sigmoid runs' (train.save_every) and the ep 4 save's (train.exit_after)
    return small_overrides(text, cache, log_dir, steps=STEPS, **MOE, **NO_FINAL_SAVE) + list(extra)


def _four_ranks(rank, world, text, cache, base):
    """Every 4-rank layout, then the ep 4 run that saves at step STOP and its ep 2 continuation (one spawn)."""
    overrides = partial(_overrides, text, cache)
    run_layouts(CONFIG, overrides, base, LAYOUTS)
    run_saved_and_resumed(CONFIG, overrides, (base / "saved_ep4", ["parallel.ep=4"]),
                          (base / "resumed_ep2", ["parallel.ep=2"]), STOP)
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base, text, cache = run_tree(tmp_path_factory, "moe")
    run(CONFIG, _overrides(text, cache, base / "one"))
    run(CONFIG, _overrides(text, cache, base / "one_4_layers", FOUR_LAYERS))
    run(CONFIG, _overrides(text, cache, base / "one_sigmoid", SIGMOID))
    run_ranks(4, _four_ranks, text, cache, base)
    run(CONFIG, _overrides(text, cache, base / "resumed_ep1", [f"train.resume={latest_checkpoint(base / 'saved_ep4')}"]))
    return base


def _records(folder):
    return [r for r in read_metrics(folder) if "loss" in r]


@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS] + ["resumed_ep2", "resumed_ep1"])
def test_moe_layouts_train_the_single_process_model(runs, name):
    want = _records(runs / REFERENCE.get(name, "one"))
    got = _records(runs / name)
    if name.startswith("resumed"):  # steps STOP+1.. after the ep 4 checkpoint
        want = want[STOP:]
    assert len(got) == len(want) and got, (len(got), len(want))
    for a, b in zip(want, got):
        step = a["step"]
        assert b["step"] == step
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (name, step, a["grad_norm"],
                                                                              b["grad_norm"])
        router = [k for k in a if k.startswith("moe/")]
        assert router, "the runs log their routers' figures"
        for k in router:
            if "bias" in k or "load" in k:  # discrete routing: the same experts chosen, the same bias moves
                assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12), (name, step, k, a[k], b[k])
            else:
                assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]) + 1e-12, (name, step, k, a[k], b[k])


def test_the_router_figures_are_the_ones_asked_for(runs):
    """Per mixture-of-experts layer (1 and 2: layer 0 is dense): load, balance and z losses; the sigmoid
    router's bias range moves away from zero; no dropped-token figure without a capacity."""
    softmax, sigmoid = _records(runs / "one")[-1], _records(runs / "one_sigmoid")[-1]
    for layer in (1, 2):
        assert softmax[f"moe/{layer}/load_max_over_mean"] >= 1.0
        assert 0.5 < softmax[f"moe/{layer}/aux_loss"] < 4.0  # E·Σ f P: 1 when balanced
        assert softmax[f"moe/{layer}/z_loss"] > 0
        assert f"moe/{layer}/dropped" not in softmax and f"moe/{layer}/bias_min" not in softmax
        assert sigmoid[f"moe/{layer}/bias_min"] < 0 < sigmoid[f"moe/{layer}/bias_max"]
    assert "moe/0/aux_loss" not in softmax


@pytest.mark.parametrize("name", ["sigmoid_ep4", "sigmoid_tp2_sp_ep2_z2"])
def test_every_layers_whole_bias_vector_equals_the_single_process(runs, name):
    """Not only its min and max: each expert's bias, moved by the sign of its load's distance from the mean,
    is bit-identical to one process's when the loads are (discrete routing)."""
    import torch

    from megazero.checkpoint import store

    biases = []
    for folder in (runs / "one_sigmoid", runs / name):
        end = store.checkpoint_dir(folder / "checkpoints", STEPS)
        kinds = {k: v for k, v in store.stored_tensors(end).items() if k.startswith("buffer/")}
        state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in kinds.items()}
        store.load(end, state)
        biases.append(state)
    assert sorted(biases[0]) == sorted(biases[1]) and len(biases[0]) == 2, sorted(biases[1])  # layers 1 and 2
    for k, want in biases[0].items():
        assert want.abs().max() > 0, k  # it moved
        assert torch.equal(want, biases[1][k]), (k, want, biases[1][k])
