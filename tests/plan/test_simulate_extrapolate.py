"""pretrain.py --simulate extrapolated from fewer layers and microbatches (megazero.plan.extrapolate): the same
figures as simulating every one, the kinds of layers a chunk holds kept, and an axis whose increments differ
simulated in full."""
from __future__ import annotations

import json

import pytest

from tests.hostile import ROOT, call, pretrain_main

# configs/tiny.yaml (tp 2 with sequence parallelism x pp 2 x dp 2) at 7 layers per stage and 9 microbatches per
# rank: past the smallest counts an axis is taken at (3 microbatches on the last 1F1B stage, where its schedule
# repeats; 4 layers: first, 2 middle, last) and the three it steps through. The last stage (head and logits), ZeRO-3 (the gathered layer, buckets in
# flight), the first layer of each stage recomputed (two kinds: the other middle ones keep their activations);
# the tp sends have a microbatch x layer term.
SETS = ["model.layers=14", "train.global_batch=36", "parallel.world_size=8", "zero.stage=3",
        "model.activation_checkpointing=true", "model.checkpoint_layers=1", "launch.rank=4", "launch.memory_gb=80"]


def _simulate(capsys, tmp_path, *mode: str, sets: list[str] = SETS) -> tuple[str, dict]:
    code, out, err = call(pretrain_main, ["--config", str(ROOT / "configs/tiny.yaml"), "--simulate", *mode,
                                          "--set", f"log.dir={tmp_path}"] + [a for s in sets for a in ("--set", s)],
                          capsys)
    assert code == 0, err[-3000:]
    return out, json.loads((tmp_path / "simulate.json").read_text())["ranks"][0]


def test_extrapolated_figures_equal_the_full_simulation(capsys, tmp_path):
    """Every figure of simulate.json equal to ``--simulate full``'s: the peak, its split, the model states, the
    host bytes, the build's peak and the peak's moment exactly (bytes are integers, and the step is affine in
    both counts); the bytes sent to 1e-12 relative (float sums of ring factors)."""
    out, got = _simulate(capsys, tmp_path / "auto")
    full_out, want = _simulate(capsys, tmp_path / "full", "full")
    assert ("extrapolated linearly from 3, 4 and 5 microbatches to 9 and from 3, 4 and 5 MLP kept layers per stage "
            "to 6 (6 simulations); each increment constant to 0.000% of the peak") in out, out
    assert "extrapolated linearly" not in full_out and "extrapolation," not in out, (full_out, out)
    _same(got, want)


def _same(got: dict, want: dict) -> None:
    """simulate.json's figures equal: bytes exactly, the bytes sent to 1e-12 relative."""
    comm, want_comm = got.pop("comm_bytes"), want.pop("comm_bytes")
    assert comm.keys() == want_comm.keys() and all(
        abs(comm[g] - want_comm[g]) <= 1e-12 * want_comm[g] for g in comm), (comm, want_comm)
    for key in ("extrapolated", "seconds"):
        got.pop(key), want.pop(key)
    assert got == want


@pytest.mark.parametrize("rank, low", [(0, 6), (8, 7)])
def test_zb1p_ranks_are_extrapolated_from_their_own_periodic_schedule(capsys, tmp_path, rank, low):
    """zb1p at pp 4 repeats (F, B, W) on every rank from pp + 2 = 6 microbatches (7 on the middle ranks with
    tiny.yaml's overlapped receives), not the 2pp + 2 = 10 every rank together needs (megazero.plan.periodic):
    10 microbatches are simulated at 6, 7 and 8 (7, 8 and 9), and every figure equals ``--simulate full``'s
    as above. The first stage (embedding, no receives) and a middle one (receives both ways, its W's deferred
    by its rank), ZeRO-1, at 2 layers a stage."""
    sets = ["model.layers=8", "parallel.pp=4", "parallel.schedule=zb1p", "train.global_batch=40",
            "parallel.world_size=16", "zero.stage=1", f"launch.rank={rank}", "launch.memory_gb=80"]
    out, got = _simulate(capsys, tmp_path / "auto", sets=sets)
    _, want = _simulate(capsys, tmp_path / "full", "full", sets=sets)
    assert (f"extrapolated linearly from {low}, {low + 1} and {low + 2} microbatches to 10 (3 simulations); each "
            f"increment constant to 0.000% of the peak") in out, out[-2000:]
    _same(got, want)


def test_the_fit_is_exact_on_affine_figures_and_sees_a_changed_increment():
    """Two axes (microbatches, layers) with a cross term, as the bytes sent have: the fit gives the real point
    exactly and no deviation; an increment that grows on one axis shows on that axis only, as the
    difference carried to the real count over the peak."""
    from megazero.plan.axes import Axis
    from megazero.plan.extrapolate import design, fit

    axes = [Axis(None, 6, 1, 122), Axis("MLP", 4, 1, 16)]  # 6 to 128 microbatches, 4 to 20 layers

    def figures(m: int, layers: int) -> dict:
        return {"peak_bytes": 1000 + 3 * m + 50 * layers, "comm_bytes.tp": 7.5 * m * layers + 2.0 * m}

    points = {x: figures(axes[0].count(x[0]), axes[1].count(x[1])) for x in design(axes)}
    got = fit(points, axes)
    assert got.values == figures(128, 20) and got.deviation == [0.0, 0.0], got
    points[(0, 2)] = dict(points[(0, 2)], peak_bytes=points[(0, 2)]["peak_bytes"] + 10)  # 6 layers: +60 not +50
    got = fit(points, axes)
    assert got.deviation[0] == 0.0 and got.deviation[1] == 16 * 10 / got.values["peak_bytes"], got
    # on the line through 5 and 6 layers: 60 a layer from 6 to 20, 150 above the first line
    assert got.worst[1] == "peak_bytes" and got.values["peak_bytes"] == figures(128, 20)["peak_bytes"] + 150


def test_smaller_chunks_keep_their_kinds_of_layers():
    """Interleaved, uneven chunks (12 and 8 layers), the first 6 of each recomputed: the rank's 12-layer chunks
    have 5 middle recomputed and 5 middle kept layers, an axis each; cut to 2 of each, every chunk keeps its
    first (recomputed) and last (kept) layer and model.checkpoint_layers follows. Microbatches step by pp
    under interleaving."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.axes import _middle, choose_axes, layer_kind, rank_chunks, variant

    cfg = resolve(load_config(None, ["model.layers=40", "model.hidden=64", "model.heads=4", "model.vocab_size=512",
                                     "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                     "parallel.pp_layers=[12,8,12,8]", "parallel.dp=1", "train.micro_batch=1",
                                     "train.global_batch=16", "model.activation_checkpointing=true",
                                     "model.checkpoint_layers=6"]), 2, "cpu")
    chunks = rank_chunks(cfg, 0)
    axes = choose_axes(cfg, 0)
    assert chunks == [0, 2] and [(a.kind, a.low, a.step, a.real) for a in axes] == [
        (None, 8, 2, 4), ("MLP kept", 3, 1, 3), ("MLP recomputed", 3, 1, 3)], axes
    assert [a.label(cfg, chunks) for a in axes] == [
        "microbatches", "MLP kept layers per model chunk", "MLP recomputed layers per model chunk"]
    small = variant(cfg, chunks, axes, (1, 0, 2))  # 10 microbatches, 2 middle kept and 4 middle recomputed
    assert small.microbatches == 10 and small.model.checkpoint_layers == 5
    assert small.parallel.pp_layers == [8, 6, 8, 6] and small.model.layers == 28  # the 8s lose their one kept
    chunk = range(14, 22)  # virtual stage 2
    assert _middle(small, chunk) == {"MLP recomputed": 4, "MLP kept": 2}
    assert layer_kind(small, chunk, 0) == "MLP recomputed" and layer_kind(small, chunk, 7) == "MLP kept"
    assert variant(cfg, chunks, axes, (4, 3, 3)).parallel.pp_layers == [12, 8, 12, 8]  # the real counts


def test_an_axis_whose_increments_differ_is_simulated_in_full(monkeypatch):
    """No tolerance at all: the microbatch axis fails its check, says so, and the rank is simulated at its real
    count (its figures are simulate_rank's)."""
    import megazero.plan.extrapolate as extrapolate
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.simulate import simulate_rank
    from megazero.plan.stage_plan import make_plan

    cfg = resolve(load_config(None, ["model.layers=2", "model.hidden=32", "model.heads=2", "model.seq_len=16",
                                     "model.vocab_size=128", "train.micro_batch=1", "train.global_batch=7",
                                     "parallel.dp=1"]), 1, "cpu")
    plan = make_plan(cfg)
    assert [a.kind for a in extrapolate.choose_axes(cfg, 0)] == [None]  # 3, 4 and 5 microbatches to 7
    monkeypatch.setattr(extrapolate, "TOLERANCE", -1.0)
    said = []
    got = extrapolate.simulate_class(cfg, 0, plan, said.append)
    assert len(said) == 1 and said[0].startswith("extrapolation, rank 0: microbatches simulated at the run's 7: "
                                                 "its two increments differ by 0.000% of the peak"), said
    want = simulate_rank(cfg, 0, plan)
    assert got.extrapolated == "" and (got.peak_bytes, got.bytes, got.comm_bytes, got.moment) == (
        want.peak_bytes, want.bytes, want.comm_bytes, want.moment)
