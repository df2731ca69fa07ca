"""The Triton FlashAttention-2 kernels against float64 attention, on the CPU through the Triton interpreter.

Expected values come from an explicit float64 softmax(Q K^T * scale + mask) V written here (and its
autograd gradients), never from the kernels or from torch's SDPA.

Only fp32 and fp16 are tested: the interpreter stores bf16 as uint16 and computes bf16 arithmetic and
bf16 ``tl.dot`` wrongly without any error, so a bf16 test here would test the interpreter, not the kernel
(bench/kernels.py checks bf16 against SDPA on a GPU).
"""
import math

import pytest
import torch

import triton  # noqa: E402  (a test dependency; tests/conftest.py set TRITON_INTERPRET=1 before this import)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

assert isinstance(triton.language.zeros, InterpretedFunction), "the kernel tests need TRITON_INTERPRET=1"

import kernels.attend as A  # noqa: E402
import kernels.flash_attention as FA  # noqa: E402
import kernels.flash_blocks as FB  # noqa: E402
from megazero.errors import UserError  # noqa: E402

assert isinstance(FA._fwd_kernel, InterpretedFunction)

# Error relative to the tensor's scale (max |expected|). fp32: the kernels accumulate in fp32 over at most
# a few hundred terms, ~1e-6 observed, 1e-5 allowed. fp16: the reference sees the same fp16 inputs, so the
# error is the kernel's own fp16 roundings of P, dS and the outputs (2^-11 = 4.9e-4 each), ~5e-4 observed,
# 2e-3 allowed.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# (batch, heads, seq): seq 1, ragged 17 and 100, and 64 (a multiple of every interpreter block).
SHAPES = [(2, 2, 1), (2, 2, 17), (1, 2, 64), (1, 2, 100)]


def reference(q, k, v, causal):
    """float64 leaves, output and LSE of softmax(q k^T / sqrt(d) + mask) v."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (q, k, v), torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def close(actual, expected, tol, what):
    """max |actual - expected| <= tol * scale; scale = max |expected|, floored at 1 (the inputs' scale) where
    the exact value is 0 (seq 1: a softmax over one key has no gradient)."""
    scale = max(expected.abs().max().item(), 1.0 if expected.abs().max() == 0 else 0.0)
    err = (actual.double() - expected).abs().max().item() / scale
    assert err <= tol, f"{what}: error {err:.3g} of scale {scale:.3g} > {tol}"


def qkv_like_model(b, h, s, d, dtype, layout):
    """q, k, v leaves laid out as the model makes them: strided views of one (b, s, h, 3, d) qkv."""
    if layout == "contiguous":
        return [torch.randn(b, h, s, d, dtype=dtype).requires_grad_() for _ in range(3)], None
    qkv = torch.randn(b, s, h, 3, d, dtype=dtype).requires_grad_()
    return [qkv[:, :, :, i].transpose(1, 2) for i in range(3)], qkv


def check(b, h, s, d, dtype, causal, layout="model", dq_mode="separate"):
    torch.manual_seed(1000 * s + d)
    (q, k, v), leaf = qkv_like_model(b, h, s, d, dtype, layout)
    out = A.attention(q, k, v, causal=causal, impl="triton", dq_mode=dq_mode)
    assert out.shape == q.shape and out.dtype == dtype
    lse = out.grad_fn.saved_tensors[4]  # what the forward saved for the backward (freed by backward())
    dout = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)  # a strided dO, too
    out.backward(dout)
    grads = [leaf.grad[:, :, :, i].transpose(1, 2) for i in range(3)] if leaf is not None else [x.grad for x in (q, k, v)]
    ref_leaves, ref_out, ref_lse = reference(q, k, v, causal)
    ref_out.backward(dout.double())
    tol = TOL[dtype]
    close(out, ref_out, tol, "O")
    for name, g, r in zip(("dQ", "dK", "dV"), grads, ref_leaves):
        close(g, r.grad, tol, name)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-5)  # fp32 either way


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, d, causal, dtype):
    check(*shape, d, dtype, causal)


@pytest.mark.parametrize("d,dtype,causal,layout", [(16, torch.float32, True, "model"),
                                                   (32, torch.float16, False, "model"),
                                                   (64, torch.float32, True, "contiguous"),
                                                   # padded to a power of two inside the kernels:
                                                   (80, torch.float32, True, "model"),
                                                   (96, torch.float16, False, "model"),
                                                   (40, torch.float32, False, "contiguous"),
                                                   (8, torch.float16, True, "model")])
def test_other_head_dims_and_contiguous_inputs(d, dtype, causal, layout):
    check(2, 2, 33, d, dtype, causal, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("shape", [(2, 2, 17), (1, 2, 100)], ids=lambda s: "x".join(map(str, s)))
def test_atomic_dq_matches_float64_reference(shape, d, causal, dtype):
    """The one-pass backward (dQ by atomic adds, Dao 2023 §3.2) against the same float64 reference."""
    check(*shape, d, dtype, causal, dq_mode="atomic")


def test_rejects_unsupported_inputs():
    q = torch.randn(1, 1, 8, 160)
    with pytest.raises(ValueError, match="head_dim"):
        A.attention(q, q, q, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        A.attention(q, q, q, impl="cuda")


# --- causal skipping: the blocks the kernels visit -----------------------------------------------


def visits_forward(s, bm, bn, causal):
    """Per query block, how many key blocks the bounds make the forward / dQ pass visit."""
    out = []
    for i in range(-(-s // bm)):
        split, end = FB.forward_key_range(i, bm, bn, s, causal)
        out.append(len(range(0, split, bn)) + len(range(split, end, bn)))
    return out


def visits_backward(s, bm, bn, causal):
    """Per key block, how many query blocks the bounds make the dK/dV pass visit."""
    out = []
    for j in range(-(-s // bn)):
        begin, split, end = FB.backward_query_range(j, bm, bn, s, causal)
        out.append(len(range(begin, split, bm)) + len(range(split, end, bm)))
    return out


def needed(s, bm, bn, causal):
    """(query block, key block) pairs holding at least one unmasked score: the least any kernel must visit."""
    return {(i, j) for i in range(-(-s // bm)) for j in range(-(-s // bn))
            if not causal or min(s - 1, i * bm + bm - 1) >= j * bn}


@pytest.mark.parametrize("s", [1, 15, 16, 17, 100, 128, 257, 4096])
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 16), (16, 32), (64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_bounds_visit_exactly_the_needed_blocks(s, bm, bn, causal):
    pairs = needed(s, bm, bn, causal)
    rows = [sum(1 for i, _ in pairs if i == r) for r in range(-(-s // bm))]
    cols = [sum(1 for _, j in pairs if j == c) for c in range(-(-s // bn))]
    assert visits_forward(s, bm, bn, causal) == rows
    assert visits_backward(s, bm, bn, causal) == cols


def test_causal_skipping_halves_the_work():
    s, bm, bn = 4096, 128, 64
    full, causal = sum(visits_forward(s, bm, bn, False)), sum(visits_forward(s, bm, bn, True))
    n = s // bm
    assert full == n * (s // bn)
    assert causal == sum((i + 1) * bm // bn for i in range(n))  # query block i reads keys [0, (i+1)*bm) only
    assert causal < 0.52 * full


@pytest.mark.parametrize("causal", [True, False])
def test_kernels_visit_what_the_bounds_say(causal):
    """The kernels count their own loop iterations; they must equal the pure bounds above."""
    s, bh = 100, 2
    q, k, v = (torch.randn(1, bh, s, 16) for _ in range(3))
    fwd, kv, dq_blocks = (32, 16), (16, 32), (64, 16)
    o, lse, visits = FA.flash_forward(q, k, v, causal, blocks=fwd, count_visits=True)
    assert visits.tolist() == [visits_forward(s, *fwd, causal)] * bh
    *_, (kv_visits, q_visits) = FA.flash_backward(q, k, v, o, lse, torch.randn_like(o), causal,
                                                 blocks=(kv, dq_blocks), count_visits=True)
    assert kv_visits.tolist() == [visits_backward(s, *kv, causal)] * bh
    assert q_visits.tolist() == [visits_forward(s, *dq_blocks, causal)] * bh
    *_, (fused_visits, none) = FA.flash_backward(q, k, v, o, lse, torch.randn_like(o), causal, blocks=(kv, None),
                                                count_visits=True, dq_mode="atomic")
    assert fused_visits.tolist() == [visits_backward(s, *kv, causal)] * bh and none is None


@pytest.mark.parametrize("causal", [True, False])
def test_autotuned_launch_covers_every_block(monkeypatch, causal):
    """The GPU launch path (autotuned, grid from the chosen config) with one config per kernel, so the
    autotuner picks without timing: its grid must cover every query / key block, like explicit blocks do.
    The held block (queries for fwd and dQ, keys for dK/dV) is the smaller one, so a grid counted in the
    other block size launches too few programs and leaves rows unwritten."""
    blocks = {"fwd": (16, 32), "dkdv": (32, 16), "dq": (16, 32), "dkdvq": (32, 16)}
    tuned = {(kind, d): triton.autotune([triton.Config({"BLOCK_M": blocks[kind][0], "BLOCK_N": blocks[kind][1]})],
                                        key=FA._KEY)(FA._KERNELS[kind]) for kind in blocks for d in (64, 128)}
    s, d = 100, 64
    torch.manual_seed(5)
    q, k, v, do = (torch.randn(2, 2, s, d) for _ in range(4))
    o_ref, lse_ref, _ = FA.flash_forward(q, k, v, causal, blocks=blocks["fwd"])
    grads_ref = FA.flash_backward(q, k, v, o_ref, lse_ref, do, causal, blocks=(blocks["dkdv"], blocks["dq"]))[:3]
    monkeypatch.setattr(FA, "_TUNED", tuned)
    monkeypatch.setattr(FA, "_interpreting", lambda: False)  # take the autotuned branch of _launch
    o, lse, _ = FA.flash_forward(q, k, v, causal)
    grads = FA.flash_backward(q, k, v, o, lse, do, causal)[:3]
    for name, got, want in zip(("O", "LSE", "dQ", "dK", "dV"), (o, lse, *grads), (o_ref, lse_ref, *grads_ref)):
        assert torch.equal(got, want), name
    atomic = FA.flash_backward(q, k, v, o, lse, do, causal, dq_mode="atomic")[:3]  # dK/dV identical, dQ summed
    torch.testing.assert_close(atomic[0], grads_ref[0], rtol=0, atol=1e-5)  # in another order
    assert torch.equal(atomic[1], grads_ref[1]) and torch.equal(atomic[2], grads_ref[2])
    _, expected, _ = reference(q, k, v, causal)
    close(o, expected, TOL[torch.float32], "O")


# --- choosing the implementation -----------------------------------------------------------------


def test_resolve_impl(monkeypatch):
    assert A.resolve_impl("auto", "cpu") == "torch"
    assert A.resolve_impl("torch", "cpu") == "torch"
    assert A.triton_available()
    assert A.resolve_impl("triton", "cpu") == "triton"  # TRITON_INTERPRET=1
    with pytest.raises(UserError, match="kernels.attention='cuda'"):
        A.resolve_impl("cuda", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a GPU: auto is SDPA (its cuDNN backend outran the kernel on an H200, docs/benchmarks.md); triton is a choice
    assert A.resolve_impl("auto", "cuda", head_dim=128) == "torch"
    assert A.resolve_impl("triton", "cuda", head_dim=128) == "triton"
    assert A.resolve_impl("triton", "cuda", head_dim=80) == "triton"  # padded to 128 inside the kernel
    assert A.resolve_impl("auto", "cuda", head_dim=256) == "torch"
    with pytest.raises(UserError, match=r"this model's is 256; valid here: auto \| torch$"):
        A.resolve_impl("triton", "cuda", head_dim=256)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not A.triton_available()
    assert A.resolve_impl("auto", "cpu") == "torch"
    with pytest.raises(UserError, match=r"needs a CUDA GPU .* valid here: auto \| torch$"):
        A.resolve_impl("triton", "cpu")
