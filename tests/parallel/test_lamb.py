"""LAMB (parallel.zero.lamb): two steps on one process equal LAMB written from the paper (You et al. 2020,
Algorithm 2) in float64, every parameter its own layer; the trust ratios are what the metrics report.

Tolerance: the optimizer runs in fp32 against a float64 reference from the same gradients; one step moves a
weight by lr * trust * |u| ~ 1e-3 and fp32 rounds a weight of ~1e-1 at ~1e-8, so the weights agree to ~1e-7 of
their largest value: 1e-6 leaves a margin of 10 and is far under a wrong trust ratio (a ratio off by 1% moves
them by ~1e-5 of it)."""
from __future__ import annotations

import pytest
import torch

from megazero.config.load import load_config
from megazero.config.schema import OptimConfig, ZeroConfig
from megazero.engine.build import make_zero
from megazero.parallel.topology import Grid
from tests.runs import ROOT, steps_recording_gradients

TINY = str(ROOT / "configs" / "tiny.yaml")
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def _lamb_reference(w: dict, grads: list[dict], decays: dict) -> tuple[dict, list[float]]:
    """Algorithm 2 of You et al. 2020 per parameter in float64: Adam's bias-corrected direction with the
    decoupled decay, scaled by ||w|| / ||u|| (1 where either is 0)."""
    b1, b2 = BETAS
    w = {n: t.double().clone() for n, t in w.items()}
    m = {n: torch.zeros_like(t) for n, t in w.items()}
    v = {n: torch.zeros_like(t) for n, t in w.items()}
    ratios = []
    for t, g in enumerate(grads, start=1):
        for n in w:
            gn = g[n].double()
            m[n] = b1 * m[n] + (1 - b1) * gn
            v[n] = b2 * v[n] + (1 - b2) * gn * gn
            u = (m[n] / (1 - b1 ** t)) / ((v[n] / (1 - b2 ** t)).sqrt() + EPS)
            if decays[n]:
                u = u + WD * w[n]
            wn, un = w[n].norm(), u.norm()
            trust = (wn / un).item() if wn > 0 and un > 0 else 1.0
            ratios.append(trust)
            w[n] = w[n] - LR * trust * u
    return w, ratios


@pytest.mark.parametrize("stage", [0, 3])
def test_two_steps_equal_lamb_from_the_paper(stage):
    from megazero.models.build import build_gpt

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=2"]).model
    grid = Grid.build(1, 1, 1, "cpu")
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    decays = {n: p.dim() >= 2 for n, p in model.named_parameters()}
    optim = OptimConfig(name="lamb", beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    zero, grads = steps_recording_gradients(
        model, grid, lambda: make_zero([model], grid, ZeroConfig(stage=stage, bucket_mb=0.01,  # several buckets
                                                           reshard_after_forward=True), "fp32", WD,
                                       torch.device("cpu"), optim=optim),
        cfg.vocab_size, cfg.seq_len, 2, LR)
    assert len(zero.buckets) > 2
    want, ratios = _lamb_reference(start, grads, decays)
    got = zero.full_parameters()
    scale = max(t.abs().max().item() for t in want.values())
    worst = max((got[n].double() - want[n]).abs().max().item() for n in want)
    assert worst <= 1e-6 * scale, (worst, scale)
    # the ratios differ per layer (else a global ratio would pass) and the record reports their range
    last = ratios[len(want):]
    assert max(last) / min(last) > 2, (min(last), max(last))
    record_ = zero.optimizer_record()
    assert record_["optim/trust_min"] == pytest.approx(min(last), rel=1e-5)
    assert record_["optim/trust_max"] == pytest.approx(max(last), rel=1e-5)


def test_adamw_reports_no_trust_ratio():
    from megazero.models.build import build_gpt

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=1"]).model
    grid = Grid.build(1, 1, 1, "cpu")
    zero = make_zero([build_gpt(cfg, 0, tp=grid.tp_comm)], grid, ZeroConfig(stage=0, reshard_after_forward=True),
                     "fp32", WD, torch.device("cpu"))
    assert zero.optimizer_record() == {}


def _argv(overrides: list[str]) -> list[str]:
    return ["--config", TINY] + [a for o in overrides for a in ("--set", o)]


def test_an_unknown_optimizer_is_one_line(tmp_path, capsys):
    from tests.hostile import assert_one_line, call, pretrain_main
    from tests.runs import small_overrides, write_corpus

    sets = small_overrides(write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run", steps=1)
    code, _, err = call(pretrain_main, _argv(sets + ["optim.name=sgd"]), capsys)
    assert_one_line(code, err, "optim.name", "sgd", "adamw | lamb")
    code, _, err = call(pretrain_main, _argv(sets + ["optim.beta2=1.0"]), capsys)
    assert_one_line(code, err, "optim.beta2", "[0, 1)")
    code, _, err = call(pretrain_main, _argv(sets + ["optim.eps=0"]), capsys)  # 0/0 where a gradient stayed 0
    assert_one_line(code, err, "optim.eps", ">= 1e-30")


def test_simulate_runs_lamb(tmp_path, capsys):
    """--simulate builds LAMB's states under fake tensors (nothing read back to the host while building) and
    steps it at 8 ranks, ZeRO 1, tp 2 x pp 2 x dp 2 (configs/tiny.yaml's layout)."""
    from tests.hostile import call, pretrain_main

    code, out, err = call(pretrain_main, ["--config", TINY, "--simulate", "--set", "optim.name=lamb", "--set",
                                          "parallel.world_size=8", "--set", "zero.stage=1", "--set",
                                          f"log.dir={tmp_path}"], capsys)
    assert code == 0, err[-3000:]
    assert "every one fits" in out, out[-2000:]


def test_a_resume_with_another_optimizer_is_one_line(tmp_path, capsys):
    """An AdamW checkpoint resumed under LAMB, and back: refused before anything is built; the same optimizer
    resumes."""
    from tests.hostile import assert_one_line, call, pretrain_main
    from tests.runs import small_overrides, write_corpus

    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    for first, other in (("adamw", "lamb"), ("lamb", "adamw")):
        log = tmp_path / first
        sets = small_overrides(text, cache, log, steps=2)
        assert pretrain_main(_argv(sets + [f"optim.name={first}"])) == 0
        resume = small_overrides(text, cache, log, steps=3) + ["train.resume=auto"]
        code, _, err = call(pretrain_main, _argv(resume + [f"optim.name={other}"]), capsys)
        assert_one_line(code, err, f"optim.name is '{first}' there and '{other}' here")
        assert pretrain_main(_argv(resume + [f"optim.name={first}"])) == 0
