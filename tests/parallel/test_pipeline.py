"""Pipeline parallelism against the single-process run: gradients, loss curves, tied embeddings, the trace.

fp32 on CPU; a pipeline run does the same arithmetic per microbatch as pp=1,
only the order in which microbatch gradients are accumulated (and the dp sum)
differs, so values agree to ~1e-6 relative; 1e-5 is the DESIGN's bound.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.train.run import run
from megazero.engine.step import forward_backward
from megazero.models.build import build_gpt
from megazero.parallel.schedules import batches
from megazero.parallel.topology import Grid
from megazero.parallel.dims import ParallelDims
from tests.dist import run_ranks, start_ranks
from tests.runs import ROOT, engine_for, read_metrics, small_overrides, write_corpus, NO_FINAL_SAVE

TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 6
EIGHT_LAYERS = {"model.layers": 8}  # pp=4 with two chunks per rank needs 8 (virtual) stages
SCHEDULES = {"gpipe": ["parallel.schedule=gpipe"], "1f1b": ["parallel.schedule=1f1b"],
             "zb1p": ["parallel.schedule=zb1p"], "interleaved": ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]}


def _overrides(text, cache, log_dir, extra=()):
    return small_overrides(text, cache, log_dir, steps=STEPS, **EIGHT_LAYERS, **NO_FINAL_SAVE) + list(extra)


def _counted_as(a) -> tuple[str, str]:
    """The counter's (kind, tag) for a schedule's send or receive action."""
    return "send" if a.kind.startswith("send") else "recv", "activation" if a.kind.endswith("_f") else "grad"


def _gradient_checks(rank, world, text, cache, base):
    """One step's gradients at pp=4 (each schedule) equal the full model's, tied embedding included."""
    results = {"held": {}}
    for name, extra in SCHEDULES.items():
        cfg = load_config(TINY, _overrides(text, cache, base / f"grad_{name}", extra + ["parallel.pp=4"]))
        resolve(cfg, world, "cpu")
        grid = Grid.build(ParallelDims(tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp), "cpu")
        data, engine = engine_for(cfg, grid, is_builder=rank == 0)
        mbs = data.train_microbatches(0, grid.dp_rank, grid.dp, cfg.train.micro_batch, cfg.train.global_batch)
        forward_backward(engine.zero, engine.executor, engine.schedule, mbs)
        grads = engine.zero.full_gradients()
        one_output = cfg.train.micro_batch * cfg.model.seq_len * cfg.model.hidden * 4
        results["held"][name] = (engine.executor.peak_held_bytes, one_output, len(mbs))

        ref = build_gpt(cfg.model, cfg.train.seed)
        for mb in data.train_microbatches(0, 0, 1, cfg.train.micro_batch, cfg.train.global_batch):
            (ref(mb[:, :-1], mb[:, 1:]).sum() / engine.tokens_per_step).backward()
        want = dict(ref.named_parameters())
        names = []
        for n, p in engine.named_params:
            err = (grads[n] - want[n].grad).abs().max().item()
            scale = want[n].grad.abs().max().item()
            assert err <= 1e-5 * scale, (name, n, err, scale)
            names.append(n)
        results[name] = names

    # pp=2 x dp=2: the data-parallel reduction runs once per step, after the last microbatch
    cfg = load_config(TINY, _overrides(text, cache, base / "dp_once", ["parallel.pp=2"]))
    resolve(cfg, world, "cpu")
    grid = Grid.build(ParallelDims(tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp), "cpu")
    data, engine = engine_for(cfg, grid, is_builder=rank == 0)
    mbs = data.train_microbatches(0, grid.dp_rank, grid.dp, cfg.train.micro_batch, cfg.train.global_batch)
    grid.counter.reset()
    exchanges = []  # the ops of each Comm.exchange call: the executor's p2p goes through the grid's pp Comm
    exchange = grid.pp_comm.exchange
    grid.pp_comm.exchange = lambda ops: exchanges.append([(kind, tag) for kind, _, _, tag in ops]) or exchange(ops)
    forward_backward(engine.zero, engine.executor, engine.schedule, mbs)
    results["dp_reductions"] = (len(mbs), len(engine.zero.buckets), grid.counter.count("all_reduce", "dp", "grad"))
    c = grid.counter
    results["p2p"] = {
        "batches": [[_counted_as(a) for a in items] for kind, items in batches(engine.schedule) if kind == "comm"],
        "exchanges": exchanges,
        "counted": {(k, t): c.count(k, "pp", t) for k in ("send", "recv") for t in ("activation", "grad")},
        "elsewhere": c.count("send") + c.count("recv") - c.count("send", "pp") - c.count("recv", "pp"),
        "volume": c.volume("send", "pp") + c.volume("recv", "pp"),
        "message": cfg.train.micro_batch * cfg.model.seq_len * cfg.model.hidden}
    return results


def _train_layouts(rank, world, text, cache, base, layouts):
    for name, extra in layouts:
        run(TINY, _overrides(text, cache, base / name, extra))
    return True


def _four_ranks(rank, world, text, cache, base):
    """The gradient checks, then the 4-rank layouts: one spawn (each process costs ~2 s of imports)."""
    grads = _gradient_checks(rank, world, text, cache, base)
    _train_layouts(rank, world, text, cache, base, FOUR)
    return grads


FOUR = [(f"pp4_{s}", SCHEDULES[s] + ["parallel.pp=4"]) for s in SCHEDULES] + \
       [(f"pp2_dp2_{s}", SCHEDULES[s] + ["parallel.pp=2"]) for s in ("interleaved", "zb1p")] + \
       [(f"pp2_dp2_interleaved_z{z}", SCHEDULES["interleaved"] + ["parallel.pp=2", f"zero.stage={z}"])
        for z in (2, 3)] + \
       [("pp4_1f1b_waited", SCHEDULES["1f1b"] + ["parallel.pp=4", "parallel.overlap_p2p=false"]),
        # a checkpointed layer is recomputed for B and again for W
        ("pp2_dp2_zb1p_recompute", SCHEDULES["zb1p"] + ["parallel.pp=2", "model.activation_checkpointing=true"])]
# (every other layout posts p2p ahead and waits at first use, the default)
TP2_PP2 = ["parallel.pp=2", "parallel.tp=2"]
# (GPipe at tp2 x pp2 x dp2 runs on a weighted blend: test_a_blend_trains_alike_at_tp2_pp2_dp2...; interleaved
# at tp 2 x pp 2 is tests/models/test_llama.py's tp2_pp2_sp, and at dp 2 the pp2_dp2 ones above)
EIGHT = [
    ("tp2_pp2_dp2_1f1b_sp", SCHEDULES["1f1b"] + TP2_PP2 + ["parallel.sequence_parallel=true", "log.pipeline_trace=true"]),
    # the split backward under ZeRO: gradient hooks fire in W; stage 3 keeps a layer gathered from its B to its W
    ("tp2_pp2_dp2_zb1p_z1", SCHEDULES["zb1p"] + TP2_PP2 + ["zero.stage=1", "log.pipeline_trace=true"]),
    ("tp2_pp2_dp2_zb1p_z3_sp", SCHEDULES["zb1p"] + TP2_PP2 + ["zero.stage=3", "parallel.sequence_parallel=true"])]


def _blend(base: Path) -> list[str]:
    """A weighted blend of two sources (the corpus's first 30 files and the rest), evaluated every 3 steps. Its
    data (a tokenizer trained on the blend, each source's tokens) in a cache of its own: the one-process run
    builds it while the 4-rank spawn reads the corpus's."""
    files = sorted((base / "text").iterdir())
    for name, part in (("a", files[:30]), ("b", files[30:])):
        (base / name).mkdir()
        for f in part:
            (base / name / f.name).write_bytes(f.read_bytes())
    return [f"data.paths=[{{path: {base / 'a'}, weight: 0.3, name: few}}, {{path: {base / 'b'}, weight: 0.7}}]",
            "train.eval_every=3", "train.eval_batches=2", f"data.cache_dir={base / 'blend_cache'}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pp")
    text, cache = write_corpus(base / "text"), base / "cache"
    blend = _blend(base)
    run(TINY, _overrides(text, cache, base / "pp1"))  # builds the corpus's data, which every other run reads
    # the blend's one-process run (its data built on the way) in a process of its own, beside the 4 ranks
    blended = start_ranks(1, _train_layouts, text, cache, base, [("pp1_blend", blend)])
    grads = run_ranks(4, _four_ranks, text, cache, base)
    blended.results()
    run_ranks(8, _train_layouts, text, cache, base, EIGHT + [("tp2_pp2_dp2_blend", SCHEDULES["gpipe"] + TP2_PP2 + blend)])
    return base, grads


def test_a_blend_trains_alike_at_tp2_pp2_dp2_with_each_source_validated(runs):
    """A weighted blend, under GPipe, reproduces the one-process loss curve (fp32, 1e-5 as the other layouts),
    its gradient norms (1e-4, as the others), and its
    validation: each source's val_loss/<name>, and val_loss their token-weighted mean (each source is
    evaluated on train.eval_batches batches, so equal tokens: the plain mean, to rounding)."""
    base, _ = runs
    ref, got = read_metrics(base / "pp1_blend"), read_metrics(base / "tp2_pp2_dp2_blend")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert ref[0]["loss"] != read_metrics(base / "pp1")[0]["loss"]  # the blend is other data than the corpus
    evals = 0
    for a, b in zip(ref, got):
        assert set(a) == set(b), (a, b)
        for key in a:
            if key.startswith(("loss", "val_loss", "grad_norm")):
                tol = 1e-4 if key == "grad_norm" else 1e-5
                assert math.isclose(a[key], b[key], rel_tol=tol), (a["step"], key, a[key], b[key])
        if "val_loss" in a:
            evals += 1
            assert math.isclose(a["val_loss"], (a["val_loss/few"] + a["val_loss/b"]) / 2, rel_tol=1e-6), a
            assert a["val_loss/few"] != a["val_loss/b"]
    assert evals == 2


def test_dp_gradients_are_reduced_once_per_step(runs):
    """Two microbatches, one all-reduce per gradient bucket: on the last microbatch only."""
    _, grads = runs
    for r in grads:
        m, buckets, reductions = r["dp_reductions"]
        assert m == 2 and reductions == buckets >= 1, r["dp_reductions"]


def test_p2p_goes_through_the_pp_comm_and_is_counted(runs):
    """pp=2 x dp=2, 1f1b, two microbatches: each batch of sends and receives of the schedule is one
    Comm.exchange on the grid's pp Comm, and the counter holds every message under its kind and tag."""
    _, grads = runs
    for rank, r in enumerate(grads):
        p2p = r["p2p"]
        assert p2p["exchanges"] == p2p["batches"] and p2p["batches"], (rank, p2p)
        sent = [op for batch in p2p["batches"] for op in batch]
        want = {key: sent.count(key) for key in p2p["counted"]}
        assert p2p["counted"] == want and sum(want.values()) == 4, (rank, p2p["counted"], want)  # 2 mbs x (F, B)
        assert p2p["elsewhere"] == 0 and p2p["volume"] == 4 * p2p["message"], (rank, p2p)


def test_outputs_are_released_once_sent(runs):
    """GPipe keeps every microbatch in flight, yet a stage holds at most two outputs' values at a time: the
    one just computed and the one whose send is still in flight (p2p overlap waits a send lazily, before the
    next transfer to that peer); the rest live on only as autograd graphs. 64 bytes: the loss scalars."""
    _, grads = runs
    for rank in range(3):  # stages that send (the last one returns losses)
        held, one_output, m = grads[rank]["held"]["gpipe"]
        assert m == 4 and one_output <= held <= 2 * one_output + 64, (rank, held, one_output)


def test_pipeline_gradients_equal_the_full_model(runs):
    _, grads = runs
    for name in SCHEDULES:
        held = [set(r[name]) for r in grads]
        # every parameter is checked somewhere; the tied embedding on the first and the last stage
        assert set().union(*held) == set(dict(build_gpt(load_config(TINY, ["model.layers=8", "model.hidden=64",
                                                                            "model.heads=4", "model.seq_len=32",
                                                                            "model.vocab_size=512",
                                                                            "parallel.tp=1"]).model,
                                                                0).named_parameters()))
        assert "embed.tokens.weight" in held[0] and "embed.tokens.weight" in held[3]
        assert "embed.tokens.weight" not in held[1] | held[2]


@pytest.mark.parametrize("name", [n for n, _ in FOUR + EIGHT])
def test_loss_curve_matches_pp1(runs, name):
    base, _ = runs
    ref, got = read_metrics(base / "pp1"), read_metrics(base / name)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
    assert got[-1]["loss"] < got[0]["loss"]


def test_pipeline_trace_shows_every_rank(runs):
    base, _ = runs
    trace = json.loads((base / "tp2_pp2_dp2_1f1b_sp" / "pipeline_trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(8))
    for pid in range(8):
        names = [e["name"] for e in events if e["pid"] == pid and e["cat"] == "compute"]
        # 2 microbatches per rank (global 8 / micro 2 / dp 2), forward and backward each
        assert sorted(names) == ["B0", "B1", "F0", "F1"], (pid, names)
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == pid)
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))  # one rank does one thing at a time


def test_zb1p_trace_shows_input_and_weight_gradients_apart(runs):
    """zb1p's backward is two spans per microbatch: B (input gradient), then W (weight gradient), in the
    schedule's order: the last stage (pp rank 1) defers W0 past B1; the first runs each W right after its B."""
    base, _ = runs
    trace = json.loads((base / "tp2_pp2_dp2_zb1p_z1" / "pipeline_trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    for pid in range(8):
        names = [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if e["pid"] == pid]
        first = pid in (0, 1, 2, 3)  # rank order tp, dp, pp (DESIGN): pids 0-3 are pp rank 0
        assert names == (["F0", "F1", "B0", "W0", "B1", "W1"] if first else ["F0", "B0", "F1", "B1", "W0", "W1"]), \
            (pid, names)
        assert all(e["dur"] > 0 for e in events if e["pid"] == pid)


def test_logged_model_state_is_the_largest_ranks(runs):
    """The stages of a pipeline hold different parameters (the first also the position embedding): the log
    reports each model-state kind of the rank that holds most, not of the rank that writes (the last stage).
    The plan computes every stage's bytes; at dp = 1 nothing is padded, so they agree exactly."""
    from megazero.plan import stage_plan as plan

    base, _ = runs
    cfg = load_config(TINY, _overrides(base / "text", base / "cache", base / "pp4_1f1b",
                                       SCHEDULES["1f1b"] + ["parallel.pp=4"]))
    resolve(cfg, 4, "cpu")
    stages = plan.make_plan(cfg).stages
    logged = read_metrics(base / "pp4_1f1b")[-1]
    for kind in ("params", "grads", "optimizer"):
        assert logged[f"{kind}_gb"] == pytest.approx(max(s.model_state[kind] for s in stages) / 1e9, rel=1e-9)
    assert max(s.model_state["params"] for s in stages) > stages[-1].model_state["params"]
