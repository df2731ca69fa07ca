"""The Triton AdamW kernel against torch.optim.AdamW, on the CPU through the Triton interpreter.

Expected values always come from torch (torch.optim.AdamW, or kernels.adam.adamw_step where the kernel's
extra features — fp16 model copy — have no torch.optim counterpart), never from the kernel itself.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU interpreter

import math
import re

import pytest
import torch

import triton  # noqa: E402,F401  (a test dependency, installed by the Makefile)

from megazero.kernels import adam  # noqa: E402
from megazero.kernels.adam import adamw, adamw_step, adamw_step_triton, resolve_impl, triton_available  # noqa: E402
from megazero.errors import UserError  # noqa: E402

# 2000 + 1000 + 1 = 3001 elements: not a multiple of the kernel block, so the ragged tail is exercised.
SHAPES = [(40, 50), (1000,), (1,)]
DECAYED = [True, False, False]  # the matrix decays; the "biases" do not (two torch param groups)
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def close(actual, expected, what):
    """1e-6 relative, with an absolute floor at 1e-6 of the tensor's scale (elements crossing zero)."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item(), msg=what)


def run_against_torch(lrs, loss_scale):
    """Steps the kernel on one flat buffer and torch.optim.AdamW on the separate tensors; compares each step."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = torch.optim.AdamW([{"params": [p for p, d in zip(params, DECAYED) if d], "weight_decay": WD},
                             {"params": [p for p, d in zip(params, DECAYED) if not d], "weight_decay": 0.0}],
                            lr=lrs[0], betas=BETAS, eps=EPS, foreach=False)
    master = torch.cat([p.detach().flatten() for p in params]).clone()
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    decay_mask = torch.cat([torch.full((p.numel(),), d) for p, d in zip(params, DECAYED)])
    assert master.numel() == 3001 and decay_mask.dtype == torch.bool
    for step, lr in enumerate(lrs, start=1):
        scaled = [torch.randn(s, generator=gen) * loss_scale for s in SHAPES]  # what backward produced
        for p, g in zip(params, scaled):
            p.grad = g * (1.0 / loss_scale)  # torch gets the unscaled grads
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        adamw_step_triton(master, torch.cat([g.flatten() for g in scaled]), exp_avg, exp_avg_sq, lr=lr,
                          beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, step=step,
                          decay_mask=decay_mask, grad_scale=1.0 / loss_scale)
        close(master, torch.cat([p.detach().flatten() for p in params]), f"master, step {step}")
        close(exp_avg, torch.cat([opt.state[p]["exp_avg"].flatten() for p in params]), f"exp_avg, step {step}")
        close(exp_avg_sq, torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in params]),
              f"exp_avg_sq, step {step}")
    return master


def test_matches_torch_adamw_10_steps_with_mask_and_unscaling():
    master = run_against_torch([1e-2] * 10, loss_scale=3072.0)
    start = torch.randn(SHAPES[0], generator=torch.Generator().manual_seed(0)).flatten()
    assert (master[:2000] - start).abs().median() > 1e-2  # the weights moved (10 steps of up to lr each)


def test_lr_and_step_change_between_calls():
    """lr, step and the bias corrections are runtime arguments: a schedule needs no recompile and still matches."""
    lrs = [1e-2 * 0.5 * (1 + math.cos(math.pi * i / 6)) + 1e-4 for i in range(6)]  # cosine-ish schedule
    run_against_torch(lrs, loss_scale=1.0)
    # Only the feature flags and the block size are compile-time, and Triton does not specialise float
    # arguments, so a new lr / step reuses the compiled kernel. (The interpreter has no compile cache to inspect.)
    from triton.runtime.jit import JITFunction
    jit = JITFunction(adam._adamw_kernel)
    assert [p.name for p in jit.params if p.is_constexpr] == ["HAS_MASK", "HAS_COPY", "BLOCK"]
    assert not {"lr", "step"} & {p.name for p in jit.params}


# The interpreter computes bf16 wrongly (bf16 loads/conversions do not match torch), so only fp32 and fp16 are
# checked here; bf16 is exercised on a GPU.
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp switches formula at weight 0.5: cover both sides
def test_fp16_grads_and_model_copy_match_torch_impl(beta1):
    gen = torch.Generator().manual_seed(1)
    n = 3001
    ref = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
    out = [t.clone() for t in ref]
    copy = torch.empty(n, dtype=torch.float16)
    copy_ref = torch.empty(n, dtype=torch.float16)
    for step in range(1, 4):
        grad = (torch.randn(n, generator=gen) * 512).to(torch.float16)
        kw = dict(lr=3e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step, grad_scale=1 / 512)
        adamw_step(ref[0], grad, ref[1], ref[2], model_copy=copy_ref, **kw)
        adamw("triton", out[0], grad, out[1], out[2], model_copy=copy, **kw)
        for a, e, what in zip(out, ref, ("master", "exp_avg", "exp_avg_sq")):
            close(a, e, f"{what}, step {step}")
        assert torch.equal(copy, out[0].to(torch.float16))
        assert torch.equal(copy, copy_ref)


_COMPILE_FOR_HOPPER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
sys.path.insert(0, sys.argv[1])
from megazero.kernels import adam
grad_dtype, copy_dtype, block, warps = sys.argv[2], sys.argv[3], 2048, 8
copy_dtype = None if copy_dtype == "none" else copy_dtype
sig = {"master_ptr": "*fp32", "grad_ptr": f"*{grad_dtype}", "exp_avg_ptr": "*fp32", "exp_avg_sq_ptr": "*fp32",
       "mask_ptr": "*u8", "copy_ptr": f"*{copy_dtype or 'fp32'}", "n": "i64"}
sig.update({k: "fp32" for k in ("decay_factor", "grad_scale", "lerp_weight", "beta2", "one_minus_beta2",
                                "bias_correction2_sqrt", "eps", "neg_step_size")})
sig.update({k: "constexpr" for k in ("HAS_MASK", "HAS_COPY", "BLOCK")})
src = ASTSource(JITFunction(adam._adamw_kernel), signature=sig,
                constexprs={"HAS_MASK": True, "HAS_COPY": copy_dtype is not None, "BLOCK": block},
                attrs={(i,): [["tt.divisibility", 16]] for i in range(7)})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]
print(json.dumps({"ptx": ptx, "per_thread": block // (32 * warps)}))
"""


@pytest.mark.parametrize("grad_dtype,copy_dtype", [("bf16", "bf16"), ("fp32", "none")])
def test_compiles_for_hopper(grad_dtype, copy_dtype, tmp_path):
    """The compiled (non-interpreted) path lowers for sm_90 without a GPU; check the PTX for what the design
    relies on: 128-bit vector loads/stores, IEEE sqrt/div, and exactly one fma per element (torch's lerp).
    Compiled in a fresh process without TRITON_INTERPRET (the mode is fixed when triton is imported)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile; keep ~/.triton clean
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER, root, grad_dtype, copy_dtype],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ptx = out["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "sqrt.rn.f32" in ptx and "sqrt.approx" not in ptx
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert ptx.count("fma.rn.f32") == out["per_thread"]  # elements per thread


def test_rejects_bad_buffers():
    n = 3001
    master, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="grad"):
        adamw_step_triton(master, torch.zeros(2 * n)[::2], m, v, **kw)  # not contiguous
    with pytest.raises(ValueError, match="exp_avg_sq"):
        adamw_step_triton(master, torch.zeros(n), m, torch.zeros(n - 1), **kw)
    with pytest.raises(ValueError, match="master"):
        adamw_step_triton(torch.zeros(n, dtype=torch.float16), torch.zeros(n), m, v, **kw)


def test_resolve_impl(monkeypatch):
    assert triton_available()  # interpreter on, triton imported
    assert resolve_impl("torch", "cpu") == "torch"
    assert resolve_impl("torch", "cuda") == "torch"
    assert resolve_impl("fused", "cpu") == "fused"
    assert resolve_impl("fused", "cuda") == "fused"
    assert resolve_impl("auto", "cpu") == "fused"  # the interpreter is for tests, never chosen by "auto"
    assert resolve_impl("auto", "cuda") == "triton"
    assert resolve_impl("triton", "cpu") == "triton"  # TRITON_INTERPRET=1
    assert resolve_impl("triton", "cuda") == "triton"
    with pytest.raises(UserError, match=re.escape("valid: auto | fused | torch | triton")):
        resolve_impl("apex", "cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserError) as err:
        resolve_impl("triton", "cpu")
    assert str(err.value) == ("kernels.adam='triton' needs a CUDA GPU with triton installed (or TRITON_INTERPRET=1 "
                              "to run the kernels on the CPU interpreter); valid here: auto | fused | torch")
    assert resolve_impl("auto", "cpu") == "fused"
    monkeypatch.setattr(adam, "triton", None)  # triton not importable
    assert resolve_impl("auto", "cuda") == "torch"
    with pytest.raises(UserError):
        resolve_impl("triton", "cuda")
    with pytest.raises(ValueError):
        adamw("apex", torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))
