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

import megazero.kernels.attend as A  # noqa: E402
import megazero.kernels.flash_attention as FA  # noqa: E402
import megazero.kernels.flash_blocks as FB  # noqa: E402
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
    """float64 leaves, output and LSE of softmax(q k^T / sqrt(d) + mask) v.

    GQA (k, v with fewer heads): each k/v head repeated for its group of q heads (repeat_interleave), the plain
    definition, so the leaves' gradients are the sums over each group."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kr, vr = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scores = q @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (q, k, v), torch.softmax(scores, -1) @ vr, torch.logsumexp(scores, -1)


def close(actual, expected, tol, what):
    """max |actual - expected| <= tol * scale; scale = max |expected|, floored at 1 (the inputs' scale) where
    the exact value is 0 (seq 1: a softmax over one key has no gradient)."""
    scale = max(expected.abs().max().item(), 1.0 if expected.abs().max() == 0 else 0.0)
    err = (actual.double() - expected).abs().max().item() / scale
    assert err <= tol, f"{what}: error {err:.3g} of scale {scale:.3g} > {tol}"


def qkv_like_model(b, h, s, d, dtype, layout, kv_heads=None):
    """q, k, v leaves laid out as the model makes them: strided views of one (b, s, h, 3, d) qkv; with
    ``kv_heads`` (GQA), of one (b, s, h + 2 * kv_heads, d) projection: q's heads, then k's, then v's."""
    kv = h if kv_heads is None else kv_heads
    if layout == "contiguous":
        return [torch.randn(b, n, s, d, dtype=dtype).requires_grad_() for n in (h, kv, kv)], None
    if kv_heads is None:
        qkv = torch.randn(b, s, h, 3, d, dtype=dtype).requires_grad_()
        return [qkv[:, :, :, i].transpose(1, 2) for i in range(3)], qkv
    qkv = torch.randn(b, s, h + 2 * kv, d, dtype=dtype).requires_grad_()
    return list(_split_heads(qkv, h, kv)), qkv


def _split_heads(x, h, kv):
    """The (b, heads, s, d) q, k, v views of a (b, s, h + 2 * kv, d) tensor."""
    return (x[:, :, lo:hi].transpose(1, 2) for lo, hi in ((0, h), (h, h + kv), (h + kv, h + 2 * kv)))


def check(b, h, s, d, dtype, causal, layout="model", dq_mode="separate", kv_heads=None):
    torch.manual_seed(1000 * s + d)
    (q, k, v), leaf = qkv_like_model(b, h, s, d, dtype, layout, kv_heads)
    out = A.attention(q, k, v, causal=causal, impl="triton", dq_mode=dq_mode)
    assert out.shape == q.shape and out.dtype == dtype
    saved_k, saved_v, lse = (out.grad_fn.saved_tensors[i] for i in (1, 2, 4))  # freed by backward()
    assert saved_k.data_ptr() == k.data_ptr() and saved_v.data_ptr() == v.data_ptr()  # k, v themselves, no copy
    dout = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)  # a strided dO, too
    out.backward(dout)
    if leaf is None:
        grads = [x.grad for x in (q, k, v)]
    elif kv_heads is None:
        grads = [leaf.grad[:, :, :, i].transpose(1, 2) for i in range(3)]
    else:
        grads = list(_split_heads(leaf.grad, h, kv_heads))
    ref_leaves, ref_out, ref_lse = reference(q, k, v, causal)
    ref_out.backward(dout.double())
    tol = TOL[dtype]
    close(out, ref_out, tol, "O")
    for name, g, r in zip(("dQ", "dK", "dV"), grads, ref_leaves):
        close(g, r.grad, tol, name)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-5)  # fp32 either way


# fp16 changes the loads, the casts and the stores, not the blocks a shape visits: at the ragged shapes only
CASES = [(shape, dtype) for shape in SHAPES for dtype in (torch.float32, torch.float16)
         if dtype == torch.float32 or shape[2] in (17, 100)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple)
                         else str(c).replace("torch.float", "fp"))
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


# --- grouped-query attention (Ainslie et al. 2023): k, v with fewer heads, read in place ------------


GQA_CASES = [(1, 8, True, "separate"), (1, 8, False, "separate"),  # group 1: multi-head attention, same path
             (2, 4, True, "separate"), (2, 4, False, "separate"), (2, 4, True, "atomic"),
             (2, 1, True, "separate"), (2, 1, False, "separate"), (2, 1, False, "atomic")]


@pytest.mark.parametrize("b,kv_heads,causal,dq_mode", [
    pytest.param(*c, id=f"b{c[0]}-group{8 // c[1]}-{'causal' if c[2] else 'full'}-{c[3]}") for c in GQA_CASES])
def test_gqa_matches_repeated_float64_reference(b, kv_heads, causal, dq_mode):
    """8 query heads over 8, 4 and 1 key/value heads (groups 1, 2, 8); batch 2 with groups (the kernels split a
    program's (batch, head) index by the kv heads); seq 33 (several blocks, ragged for every interpreter block);
    against the float64 reference on k, v repeated per group (repeat_interleave), so dK, dV must be each group's
    sum. fp32: TOL as above, a dK/dV element now sums over up to 8 heads' query rows (8 * 33 terms), still a
    few hundred fp32 additions; <= 6.4e-7 observed."""
    check(b, 8, 33, 16, torch.float32, causal, dq_mode=dq_mode, kv_heads=kv_heads)


def test_gqa_contiguous_inputs():
    check(1, 4, 20, 32, torch.float32, True, layout="contiguous", kv_heads=2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gqa_torch_impl_matches_repeated_reference(causal):
    """impl="torch" (SDPA, enable_gqa) against the same repeated float64 reference: one meaning for both impls.
    fp32 with SDPA's own kernels: TOL as above."""
    torch.manual_seed(7)
    (q, k, v), leaf = qkv_like_model(2, 8, 33, 16, torch.float32, "model", kv_heads=2)
    out = A.attention(q, k, v, causal=causal, impl="torch")
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves, ref_out, _ = reference(q, k, v, causal)
    ref_out.backward(dout.double())
    close(out, ref_out, TOL[torch.float32], "O")
    for name, g, r in zip(("dQ", "dK", "dV"), _split_heads(leaf.grad, 8, 2), ref_leaves):
        close(g, r.grad, TOL[torch.float32], name)


@pytest.mark.parametrize("kv_shape", [(1, 4, 8, 16), (1, 0, 8, 16), (2, 3, 8, 16), (1, 3, 9, 16), (1, 3, 8, 32)],
                         ids=["4-of-6-heads", "0-heads", "batch", "seq", "head_dim"])
def test_gqa_rejects_mismatched_kv(kv_shape):
    q = torch.randn(1, 6, 8, 16)
    k = torch.randn(kv_shape)
    with pytest.raises(ValueError, match=r"kv_heads dividing heads") as err:
        A.attention(q, k, k, impl="triton")
    assert "\n" not in str(err.value) and str(tuple(kv_shape)) in str(err.value)


def test_gqa_rejects_k_and_v_of_two_shapes():
    q = torch.randn(1, 6, 8, 16)
    with pytest.raises(ValueError, match=r"kv_heads dividing heads"):
        A.attention(q, torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), impl="triton")
    with pytest.raises(ValueError, match=r"dividing q's 6 heads, got 4"):  # the launcher's own check
        FA.flash_forward(q, torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16), True)


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


def test_gqa_dkdv_programs_visit_each_query_head():
    """GQA: a dK/dV program (one per key block of each (batch, kv head)) walks the causal bounds once per query
    head of its group, skipping the same blocks; the forward and dQ programs, one per query head, are unchanged."""
    s, group = 100, 3
    q, k, v = torch.randn(1, group, s, 16), torch.randn(1, 1, s, 16), torch.randn(1, 1, s, 16)
    fwd, kv, dq_blocks = (32, 16), (16, 32), (64, 16)
    o, lse, visits = FA.flash_forward(q, k, v, True, blocks=fwd, count_visits=True)
    assert visits.tolist() == [visits_forward(s, *fwd, True)] * group
    *_, (kv_visits, q_visits) = FA.flash_backward(q, k, v, o, lse, torch.randn_like(o), True,
                                                 blocks=(kv, dq_blocks), count_visits=True)
    assert kv_visits.tolist() == [[group * n for n in visits_backward(s, *kv, True)]]
    assert q_visits.tolist() == [visits_forward(s, *dq_blocks, True)] * group


@pytest.mark.parametrize("causal", [True, False])
def test_autotuned_launch_covers_every_block(monkeypatch, causal):
    """The GPU launch path (autotuned, grid from the chosen config) with one config per kernel, so the
    autotuner picks without timing: its grid must cover every query / key block, like explicit blocks do.
    The held block (queries for fwd and dQ, keys for dK/dV) is the smaller one, so a grid counted in the
    other block size launches too few programs and leaves rows unwritten."""
    blocks = {"fwd": (16, 32), "dkdv": (32, 16), "dq": (16, 32), "dkdvq": (32, 16)}
    tuned = {(kind, d, docs): triton.autotune([triton.Config({"BLOCK_M": blocks[kind][0],
                                                             "BLOCK_N": blocks[kind][1]})],
                                              key=FA._KEY)(FA._KERNELS[kind])
             for kind in blocks for d in (64, 128) for docs in (False, True)}
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
