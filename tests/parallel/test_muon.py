"""Muon (parallel.zero.muon): steps on one process equal Muon written from the papers in float64 (Jordan et al.
2024: momentum, Nesterov, five Newton-Schulz steps; Liu et al. 2025: the 0.2 sqrt(max(m, n)) scale and the
decoupled decay) on the layers' matrices, and AdamW at its own learning rate on everything else.

Tolerance: the optimizer runs in fp32 against a float64 reference from the same gradients. Newton-Schulz in
fp32 is off by ~1e-6 of its output (five steps of matmuls over <= 256 terms), and a step moves a weight by
lr * |O| ~ 1e-2, so the weights agree to ~1e-8 of their largest value; 1e-6 is far under a wrong step (a matrix
left on AdamW, or orthogonalised per shard, moves weights by ~1e-3)."""
from __future__ import annotations

import math

import pytest
import torch

from megazero.kernels.newton_schulz import newton_schulz, newton_schulz_flops
from megazero.config.load import load_config
from megazero.config.schema import OptimConfig, ZeroConfig
from megazero.engine.build import make_zero
from megazero.parallel.topology import Grid
from tests.runs import ROOT, steps_recording_gradients

TINY = str(ROOT / "configs" / "tiny.yaml")
LR, ADAMW_LR, WD, BETAS, EPS, MU = 2e-2, 5e-3, 0.1, (0.9, 0.95), 1e-8, 0.95


def _orthogonalised(g: torch.Tensor) -> torch.Tensor:
    """Jordan et al. 2024: X = G / ||G||_F, then five times X <- a X + (b A + c A^2) X with A = X X^T, on the
    wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    wide = g.T if g.shape[0] > g.shape[1] else g
    x = wide / (torch.linalg.matrix_norm(wide) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_newton_schulz_is_the_published_iteration():
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 16), (16, 64), (33, 33)]:
        g = torch.randn(*shape, generator=gen, dtype=torch.float64)
        got, want = newton_schulz(g), _orthogonalised(g)
        assert (got - want).abs().max().item() <= 1e-12, shape
        # ~U V^T: the singular values land near 1 (the quintic's published band), whatever G's were
        s = torch.linalg.svdvals(got)
        assert 0.6 < s.min().item() and s.max().item() < 1.25, (shape, s.min().item(), s.max().item())
        assert newton_schulz_flops(*shape) == 5 * (4 * min(shape) ** 2 * max(shape) + 2 * min(shape) ** 3)
    assert newton_schulz(torch.zeros(8, 4)).abs().max().item() == 0.0  # a zero gradient: no update


def _muon_reference(w: dict, grads: list[dict], matrices: set) -> dict:
    """Per parameter in float64: Muon on ``matrices`` (M = mu M + G; U = G + mu M; W -= lr (0.2 sqrt(max(m, n))
    NS(U) + wd W)), AdamW on the rest at ADAMW_LR, decaying the 2-D ones."""
    b1, b2 = BETAS
    w = {n: t.double().clone() for n, t in w.items()}
    m = {n: torch.zeros_like(t) for n, t in w.items()}
    v = {n: torch.zeros_like(t) for n, t in w.items()}
    for t, g in enumerate(grads, start=1):
        for n in w:
            gn = g[n].double()
            if n in matrices:
                m[n] = MU * m[n] + gn
                o = _orthogonalised(gn + MU * m[n]) * 0.2 * math.sqrt(max(w[n].shape))
                w[n] = w[n] - LR * (o + WD * w[n])
                continue
            if w[n].dim() >= 2:
                w[n] = w[n] * (1 - ADAMW_LR * WD)
            m[n] = b1 * m[n] + (1 - b1) * gn
            v[n] = b2 * v[n] + (1 - b2) * gn * gn
            w[n] = w[n] - ADAMW_LR * (m[n] / (1 - b1 ** t)) / ((v[n] / (1 - b2 ** t)).sqrt() + EPS)
    return w


@pytest.mark.parametrize("arch,stage", [("gpt2", 0), ("llama", 3)])
def test_steps_equal_muon_from_the_paper(arch, stage):
    from megazero.models.build import build_gpt

    extra = ["model.arch=llama", "model.kv_heads=2", "model.tie_embeddings=false"] if arch == "llama" else []
    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=2"] + extra).model
    grid = Grid.build(1, 1, 1, "cpu")
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    matrices = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2}
    assert len(matrices) >= 8 and any(not n.startswith("layers.") and p.dim() == 2
                                      for n, p in model.named_parameters())  # the embedding stays on AdamW
    optim = OptimConfig(name="muon", beta1=BETAS[0], beta2=BETAS[1], eps=EPS, momentum=MU, adamw_lr=ADAMW_LR)
    zero, grads = steps_recording_gradients(
        model, grid, lambda: make_zero([model], grid, ZeroConfig(stage=stage, bucket_mb=0.01,  # several buckets
                                                           reshard_after_forward=True), "fp32", WD,
                                       torch.device("cpu"), optim=optim, lr=LR),
        cfg.vocab_size, cfg.seq_len, 3, LR)
    assert len(zero.buckets) > 2
    want = _muon_reference(start, grads, matrices)
    got = zero.full_parameters()
    scale = max(t.abs().max().item() for t in want.values())
    worst = max((got[n].double() - want[n]).abs().max().item() for n in want)
    assert worst <= 1e-6 * scale, (worst, scale)
    # the update's RMS is the scale's: RMS(U V^T) = 1 / sqrt(max(m, n)), times 0.2 sqrt(max(m, n)), times the
    # quintic's singular values (~0.7-1.2, not 1)
    rms = zero.optimizer_record()["optim/update_rms"]
    assert 0.1 < rms < 0.3, rms


def _argv(overrides: list[str]) -> list[str]:
    return ["--config", TINY] + [a for o in overrides for a in ("--set", o)]


def test_bad_muon_settings_are_one_line(tmp_path, capsys):
    from tests.hostile import assert_one_line, call, pretrain_main
    from tests.runs import small_overrides, write_corpus

    sets = small_overrides(write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run", steps=1)
    muon = sets + ["optim.name=muon"]
    code, _, err = call(pretrain_main, _argv(muon + ["zero.stage=1", "zero.offload_optimizer=cpu"]), capsys)
    assert_one_line(code, err, "zero.offload_optimizer", "optim.name=muon")
    code, _, err = call(pretrain_main, _argv(muon + ["optim.momentum=1.0"]), capsys)
    assert_one_line(code, err, "optim.momentum", "[0, 1)")
    code, _, err = call(pretrain_main, _argv(muon + ["optim.ns_steps=0"]), capsys)
    assert_one_line(code, err, "optim.ns_steps", ">= 1")
    code, _, err = call(pretrain_main, _argv(muon + ["optim.adamw_lr=-1"]), capsys)
    assert_one_line(code, err, "optim.adamw_lr", ">= 0")


def test_simulate_runs_muon(tmp_path, capsys):
    """--simulate builds Muon's exchange plan and steps it under fake tensors at 8 ranks, ZeRO 1, tp 2 x pp 2 x
    dp 2 (configs/tiny.yaml's layout), and the dry run reports its bytes."""
    from tests.hostile import call, pretrain_main

    sets = ["optim.name=muon", "parallel.world_size=8", "zero.stage=1", f"log.dir={tmp_path}"]
    code, out, err = call(pretrain_main, _argv(sets)[:2] + ["--simulate"] + _argv(sets)[2:], capsys)
    assert code == 0, err[-3000:]
    assert "every one fits" in out, out[-2000:]
    code, out, err = call(pretrain_main, _argv(sets)[:2] + ["--dry-run"] + _argv(sets)[2:], capsys)
    assert code == 0 and "muon: per rank and step" in out, (err[-2000:], out[-2000:])


def test_a_resume_between_muon_and_another_optimizer_is_one_line(tmp_path, capsys):
    from tests.hostile import assert_one_line, call, pretrain_main
    from tests.runs import small_overrides, write_corpus

    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    for first, other in (("muon", "adamw"), ("lamb", "muon")):
        log = tmp_path / first
        assert pretrain_main(_argv(small_overrides(text, cache, log, steps=2) + [f"optim.name={first}"])) == 0
        resume = small_overrides(text, cache, log, steps=3) + ["train.resume=auto"]
        code, _, err = call(pretrain_main, _argv(resume + [f"optim.name={other}"]), capsys)
        assert_one_line(code, err, f"optim.name is '{first}' there and '{other}' here")
    assert pretrain_main(_argv(resume[:-1] + ["train.resume=auto", "optim.name=lamb"])) == 0
