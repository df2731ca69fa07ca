"""The flat fused CPU AdamW (kernels.adam_cpu) against torch.optim.AdamW, and bench/optimizer.py --smoke.

Expected values come from torch.optim.AdamW's single-tensor path (foreach=False) on separate tensors, or
from megazero.kernels.adam.adamw_step for the model copy, never from the implementation under test.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megazero.kernels import adam_cpu
from megazero.kernels.adam import adamw, adamw_step, resolve_impl
from megazero.kernels.adam_cpu import adamw_step_fused, decay_runs

ROOT = Path(__file__).resolve().parents[2]
# 2000 + 1000 + 231 + 1 + 17 = 3249 elements in four decay runs (the last two tensors make one), lengths not
# multiples of the 16-float vector width, so the kernel's scalar tails run too.
SHAPES = [(40, 50), (1000,), (33, 7), (1,), (17,)]
DECAYED = [True, False, True, False, False]
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
LRS = [1e-3, 2e-3, 3e-3, 3e-3, 2.5e-3, 2e-3, 1.5e-3, 1e-3, 5e-4, 1e-4]  # steps 1..10: warm-up and decay
SCALES = [1.0, 0.37, 1.0, 1.0, 0.61, 1.0, 0.2, 1.0, 1.0, 0.83]  # clipping folded in on some steps


def close(actual, expected, what):
    """1e-6 relative, with an absolute floor at 1e-6 of the tensor's largest element.

    Why 1e-6: both sides do the same fp32 operations in the same order except (a) the kernel gets grad
    times grad_scale as grad / fl(1/grad_scale), one extra rounding (<= 6e-8 relative), and (b) its scalar
    tail computes exp_avg's lerp without an fma; each is ~1 ulp (6e-8) per step, and 10 steps accumulate
    well under 1e-6. The floor is for exp_avg elements that cross zero, where a relative error is
    unbounded though the absolute one is an ulp of the terms that cancelled.
    """
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item(), msg=what)


def reference(gen):
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = torch.optim.AdamW([{"params": [p for p, d in zip(params, DECAYED) if d], "weight_decay": WD},
                             {"params": [p for p, d in zip(params, DECAYED) if not d], "weight_decay": 0.0}],
                            lr=LRS[0], betas=BETAS, eps=EPS, foreach=False)
    return params, opt


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def decay_mask():
    return torch.cat([torch.full((torch.Size(s).numel(),), d) for s, d in zip(SHAPES, DECAYED)])


@pytest.mark.parametrize("how", ["runs", "mask", "dispatch"])
def test_matches_torch_adamw(how):
    gen = torch.Generator().manual_seed(0)
    params, opt = reference(gen)
    master = flat(params).clone()
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    mask = decay_mask()
    runs = decay_runs(mask)
    assert len(runs) == 4 and master.numel() == 3249
    for step, (lr, scale) in enumerate(zip(LRS, SCALES), start=1):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]  # what backward produced
        for p, g in zip(params, grads):
            p.grad = g * scale  # torch gets the grads clipped beforehand
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        kw = dict(lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, step=step, grad_scale=scale)
        if how == "runs":
            adamw_step_fused(master, flat(grads), exp_avg, exp_avg_sq, runs=runs, **kw)
        elif how == "mask":
            adamw_step_fused(master, flat(grads), exp_avg, exp_avg_sq, decay_mask=mask, **kw)
        else:
            adamw("fused", master, flat(grads), exp_avg, exp_avg_sq, runs=runs, decay_mask=mask, **kw)
        close(master, flat(params), f"master, step {step}")
        close(exp_avg, flat(opt.state[p]["exp_avg"] for p in params), f"exp_avg, step {step}")
        close(exp_avg_sq, flat(opt.state[p]["exp_avg_sq"] for p in params), f"exp_avg_sq, step {step}")


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_grads_and_model_copy(grad_dtype, monkeypatch):
    """fp16/bf16 grads with fp32 masters go through the bounded scratch and are left as they were; the bf16
    model copy is written chunk by chunk (chunks of 1000 elements here: four, whose edges cut runs)."""
    monkeypatch.setattr(adam_cpu, "CPU_CHUNK", 1000)
    gen = torch.Generator().manual_seed(1)
    params, opt = reference(gen)
    master = flat(params).clone()
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    copy = torch.empty_like(master, dtype=torch.bfloat16)
    runs = decay_runs(decay_mask())
    for step, (lr, scale) in enumerate(zip(LRS[:4], SCALES[:4]), start=1):
        grad = torch.randn(master.numel(), generator=gen).to(grad_dtype)
        before = grad.clone()
        for p, g in zip(params, grad.float().split([p.numel() for p in params])):
            p.grad = g.view(p.shape) * scale
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        adamw_step_fused(master, grad, exp_avg, exp_avg_sq, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                         weight_decay=WD, step=step, runs=runs, grad_scale=scale, model_copy=copy)
        close(master, flat(params), f"master, step {step}")
        close(exp_avg_sq, flat(opt.state[p]["exp_avg_sq"] for p in params), f"exp_avg_sq, step {step}")
        assert torch.equal(copy, master.to(torch.bfloat16))
        if grad_dtype != torch.float32:  # fp32 grads are the kernel's to unscale in place
            assert torch.equal(grad, before)


def test_no_decay_everywhere_empty_and_bad_runs():
    gen = torch.Generator().manual_seed(2)
    n = 100
    master, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, step=3)
    for wd, mask in ((0.1, None), (0.0, torch.rand(n, generator=gen) > 0.5)):  # all decay; none (mask ignored)
        mine, ref = [master.clone(), torch.zeros(n), torch.zeros(n)], [master.clone(), torch.zeros(n), torch.zeros(n)]
        adamw_step_fused(mine[0], grad.clone(), mine[1], mine[2], weight_decay=wd, decay_mask=mask, **kw)
        adamw_step(ref[0], grad, ref[1], ref[2], weight_decay=wd, decay_mask=mask, **kw)
        for a, b in zip(mine, ref):
            close(a, b, f"wd={wd}")
    empty = [torch.zeros(0) for _ in range(4)]
    adamw_step_fused(*empty, weight_decay=0.1, runs=[], model_copy=torch.zeros(0, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="runs end at 50"):
        adamw_step_fused(master, grad, torch.zeros(n), torch.zeros(n), weight_decay=0.1, runs=[(0, 50, True)], **kw)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_step_fused(master, torch.zeros(2 * n)[::2], torch.zeros(n), torch.zeros(n), weight_decay=0.1, **kw)


def test_other_impls_accept_and_ignore_runs():
    n, kw = 10, dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    master = torch.ones(n)
    adamw("torch", master, torch.ones(n), torch.zeros(n), torch.zeros(n), runs=[(0, n, True)], **kw)
    assert master.lt(1).all()


def test_decay_runs_edge_cases():
    t, f = True, False
    assert decay_runs(torch.ones(5, dtype=torch.bool)) == [(0, 5, t)]
    assert decay_runs(torch.zeros(3, dtype=torch.bool)) == [(0, 3, f)]
    assert decay_runs(torch.tensor([t, f, t, f])) == [(0, 1, t), (1, 2, f), (2, 3, t), (3, 4, f)]
    assert decay_runs(torch.tensor([f, f, t, t, t, f])) == [(0, 2, f), (2, 5, t), (5, 6, f)]
    assert decay_runs(torch.tensor([t])) == [(0, 1, t)]
    assert decay_runs(torch.zeros(0, dtype=torch.bool)) == []


def test_resolve_auto_on_cpu_is_fused():
    assert resolve_impl("auto", "cpu") == "fused"
    assert resolve_impl("fused", "cpu") == "fused"
    assert resolve_impl("torch", "cpu") == "torch"


def test_bench_smoke_prints_ratios():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "optimizer.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for which in ("fused", "foreach"):
        assert re.search(rf"^- ratio new/{which} at smoke: [0-9.]+", proc.stdout, re.M), proc.stdout
    assert proc.stdout.count("| new flat fused |") == 1 and "| copy (" in proc.stdout
    for which in ("AdamW", "torch fused AdamW"):  # LAMB's table, against both AdamWs
        assert re.search(rf"^- ratio LAMB/{which} at smoke: [0-9.]+", proc.stdout, re.M), proc.stdout
