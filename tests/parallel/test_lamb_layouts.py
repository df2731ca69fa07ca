"""LAMB trains the same model at every layout: tp 2 with sequence parallelism, pp 2 under 1F1B, dp 4 at ZeRO
1, 2 and 3 (several buckets), tp 2 x pp 2 x dp 2 at ZeRO 1, Llama, experts over ep 2, k/v heads replicated
over tp, cp 2, the tied embedding under pp 2 at ZeRO 3, and a run saved at tp 2 x dp 2 and continued at dp 4,
each against its one-process run.

Tolerance: fp32 on the CPU, 10 steps, loss and gradient norm within 1e-5 relative (the issue's bound; the
layouts sum the same per-microbatch gradients in another order, ~1e-6). A trust ratio computed from one
rank's piece of a layer (no sum over the shard group or tp) moves the weights by another step size per rank:
the curves part at step 2 by ~1e-3."""
from __future__ import annotations

import pytest

from megazero.train.run import run
from tests.dist import run_ranks, start_ranks
from tests.runs import assert_curves_match, ROOT, read_metrics, small_overrides, write_corpus

CONFIG = str(ROOT / "configs" / "tiny.yaml")
STEPS = 10
STOP = 5  # the tp 2 x dp 2 run saves here; the dp 4 run continues from it
LAMB = {"optim.name": "lamb", "train.lr": "1.0e-2", "train.min_lr": "1.0e-3", "train.global_batch": 16}
LLAMA = ["model.arch=llama", "model.kv_heads=2", "model.tie_embeddings=false"]
MOE = LLAMA + ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32", "model.moe.dense_layers=1"]
SEVERAL = ["zero.bucket_mb=0.02"]  # several buckets per rank, and layers cut across the dp slices
FOUR = [
    ("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]),
    ("pp2_1f1b", ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.dp=2"]),
    ("dp4_z1", ["parallel.dp=4", "zero.stage=1"] + SEVERAL),
    ("dp4_z2", ["parallel.dp=4", "zero.stage=2"] + SEVERAL),
    ("dp4_z3", ["parallel.dp=4", "zero.stage=3"] + SEVERAL),
    ("llama_tp2_sp_z1", LLAMA + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
                                 "zero.stage=1"] + SEVERAL),
    ("moe_ep2_z1", MOE + ["parallel.dp=4", "parallel.ep=2", "zero.stage=1"]),
    # 2 k/v heads on 4 tp ranks (each k/v piece on 2 ranks: counted once), context parallel (gradients over
    # dp x cp), and the tied embedding's two copies (first and last stage) under ZeRO 3
    ("llama_tp4_kv2_z2", LLAMA + ["parallel.tp=4", "zero.stage=2"]),
    ("llama_cp2_dp2_z1", LLAMA + ["parallel.cp=2", "parallel.dp=2", "zero.stage=1"]),
    ("pp2_dp2_z3_tied", ["parallel.pp=2", "parallel.dp=2", "zero.stage=3"]),
]
EIGHT = [("tp2_pp2_dp2_z1", ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "zero.stage=1"] + SEVERAL)]
REFERENCE = {"llama_tp2_sp_z1": "one_llama", "moe_ep2_z1": "one_moe", "llama_tp4_kv2_z2": "one_llama",
             "llama_cp2_dp2_z1": "one_llama"}


def _overrides(text, cache, log_dir, extra=()):
    return small_overrides(text, cache, log_dir, steps=STEPS, **LAMB) + list(extra)


def _checkpoint(log_dir):
    from megazero.checkpoint import store

    return store.latest_checkpoint(log_dir / "checkpoints")


def _layouts(rank, world, text, cache, base, layouts, resume=False):
    for name, extra in layouts:
        run(CONFIG, _overrides(text, cache, base / name, extra))
    if resume:  # saved at tp 2 x dp 2, continued at dp 4
        saved = ["parallel.tp=2", "parallel.dp=2", f"train.save_every={STOP}", f"train.exit_after={STOP}"]
        run(CONFIG, _overrides(text, cache, base / "saved_tp2_dp2", saved))
        run(CONFIG, _overrides(text, cache, base / "resumed_dp4",
                               ["parallel.dp=4", f"train.resume={_checkpoint(base / 'saved_tp2_dp2')}"]))
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lamb")
    text, cache = write_corpus(base / "text"), base / "cache"
    run(CONFIG, _overrides(text, cache, base / "one"))  # builds the data the others read
    references = start_ranks(1, _layouts, text, cache, base, [("one_llama", LLAMA), ("one_moe", MOE)])
    run_ranks(4, _layouts, text, cache, base, FOUR, True)
    references.results()
    run_ranks(8, _layouts, text, cache, base, EIGHT)
    return base


def _records(folder):
    return [r for r in read_metrics(folder) if "loss" in r]


@pytest.mark.parametrize("name", [n for n, _ in FOUR + EIGHT] + ["resumed_dp4"])
def test_lamb_layouts_train_the_single_process_model(runs, name):
    want = _records(runs / REFERENCE.get(name, "one"))
    got = _records(runs / name)
    if name == "resumed_dp4":  # steps STOP+1.. after the tp 2 x dp 2 checkpoint
        want = want[STOP:]
    assert_curves_match(name, want, got, keys=("loss", "grad_norm", "optim/trust_min", "optim/trust_max"))  # 1e-5 relative


def test_lamb_moves_off_adamw(runs, tmp_path):
    """The runs above are LAMB's: its ratios are logged and differ per layer, and its curve is not AdamW's."""
    lamb = _records(runs / "one")
    assert all(r["optim/trust_max"] > r["optim/trust_min"] > 0 for r in lamb)
    text = runs / "text"
    overrides = [o for o in _overrides(text, runs / "cache", tmp_path / "adamw") if not o.startswith("optim.name")]
    adamw = [r for r in run(CONFIG, overrides) if "loss" in r]
    assert "optim/trust_min" not in adamw[-1]
    assert abs(adamw[-1]["loss"] - lamb[-1]["loss"]) > 1e-3, (adamw[-1]["loss"], lamb[-1]["loss"])
