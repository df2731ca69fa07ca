"""Document masks in the Triton FlashAttention-2 kernels (Dao 2023) and the torch fallback, against float64.

A packed sample holds several documents; a query token attends only to key tokens of its own document (and,
causal, not later ones). Expected values come from an explicit float64 masked softmax written here, with its
autograd gradients; a row that sees no key at all gives output 0, LSE -inf and zero gradients.

Tolerance: fp32 inputs, error relative to the tensor's scale (max |expected|), 1e-5 as in
test_attention_kernel.py: the kernels accumulate in fp32 over at most a few hundred terms (a 300-token document;
dK/dV of a kv head sum its 2 query heads' rows, ~600 terms), each rounding ~6e-8, so ~1e-6 is expected.
"""
import math

import pytest
import torch

import triton  # noqa: F401  (tests/conftest.py set TRITON_INTERPRET=1 before this import)
from triton.runtime.interpreter import InterpretedFunction

import megazero.kernels.attend as A
import megazero.kernels.flash_attention as FA

assert isinstance(FA._fwd_kernel, InterpretedFunction), "the kernel tests need TRITON_INTERPRET=1"

TOL = 1e-5
LENGTHS = (1, 17, 300)  # ragged documents of one packed sample: seq 318, ragged for every interpreter block


def ids_of(lengths, first=0):
    """(1, sum(lengths)) int32 ids: document first, first + 1, .. of the given lengths."""
    return torch.cat([torch.full((n,), first + i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]


def reference(q, k, v, q_doc, k_doc, causal):
    """float64 leaves, output and LSE of the masked softmax; rows with no visible key: output 0, LSE -inf."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kr, vr = (x.repeat_interleave(group, dim=1) for x in (k, v))
    s = q.shape[2]
    keep = q_doc[:, :, None] == k_doc[:, None, :]
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
    keep = keep[:, None].expand(-1, q.shape[1], -1, -1)
    scores = (q @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
    seen = keep.any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, scores, 0.0), -1) * seen  # an unseen row: all zeros, no NaN
    return (q, k, v), p @ vr, torch.logsumexp(scores.detach(), -1)


def close(actual, expected, what):
    scale = max(expected.abs().max().item(), 1.0 if expected.abs().max() == 0 else 0.0)
    err = (actual.double() - expected).abs().max().item() / scale
    assert err <= TOL, f"{what}: error {err:.3g} of scale {scale:.3g} > {TOL}"


def run_kernel(q, k, v, q_doc, k_doc, causal, dq_mode="separate", blocks=None):
    """Kernel output, LSE and (dQ, dK, dV) for a random dO, and the reference's, for the same dO.

    blocks: one (BLOCK_M, BLOCK_N) for every pass, else the interpreter's fixed (uneven) ones."""
    o, lse, _ = FA.flash_forward(q, k, v, causal, blocks=blocks, q_doc=q_doc, k_doc=k_doc)
    do = torch.randn_like(o)
    bwd_blocks = None if blocks is None else (blocks, None if dq_mode == "atomic" else blocks)
    grads = FA.flash_backward(q, k, v, o, lse, do, causal, blocks=bwd_blocks, dq_mode=dq_mode, q_doc=q_doc,
                              k_doc=k_doc)[:3]
    leaves, ref_o, ref_lse = reference(q, k, v, q_doc, k_doc, causal)
    ref_o.backward(do.double())
    return (o, lse, grads), (ref_o, ref_lse, [x.grad for x in leaves])


def compare(got, want):
    (o, lse, grads), (ref_o, ref_lse, ref_grads) = got, want
    close(o, ref_o, "O")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and not lse.isnan().any()
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    for name, g, r in zip(("dQ", "dK", "dV"), grads, ref_grads):
        assert not g.isnan().any(), name
        close(g, r, name)


@pytest.mark.parametrize("causal,dq_mode", [(True, "separate"), (False, "atomic")], ids=["causal", "full-atomic"])
def test_ragged_documents_gqa_match_float64(causal, dq_mode):
    """Documents of 1, 17 and 300 tokens in one sample (seq 318, no padding: the kernels mask the ragged last
    block), 4 query heads over 2 kv heads, fp32. 64 x 64 blocks: the interpreter's cost is per block, and the
    uneven interpreter blocks are exercised by the tests below."""
    torch.manual_seed(11)
    ids = ids_of(LENGTHS)
    q, k, v = torch.randn(1, 4, 318, 16), torch.randn(1, 2, 318, 16), torch.randn(1, 2, 318, 16)
    compare(*run_kernel(q, k, v, ids, ids, causal, dq_mode, blocks=(64, 64)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_block_with_rows_that_see_nothing(causal):
    """A ring attention block: q is a later chunk of the sample than k (separate id chunks, same length 48).
    k holds documents 0..2 (the last ragged), q documents 2..4: rows of documents 3 and 4 see no key at all
    (output 0, LSE -inf, no gradient), rows of document 2 see the end of k."""
    torch.manual_seed(12)
    k_doc, q_doc = ids_of((20, 11, 17)), ids_of((5, 30, 13), first=2)
    q, k, v = torch.randn(1, 4, 48, 16), torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 16)
    got, want = run_kernel(q, k, v, q_doc, k_doc, causal)
    blind = (q_doc[0] > 2)
    assert blind.sum() == 43 and torch.isinf(want[1][0, :, blind]).all()
    compare(got, want)
    o, lse, (dq, _, _) = got
    assert (o[0, :, blind] == 0).all() and (lse[0, :, blind] == float("-inf")).all() and (dq[0, :, blind] == 0).all()


def doc_tiles_expected(ids, s, bm, bn, causal):
    """Per query block (forward, dQ pass), the key blocks visited: within the causal bounds, those whose id
    range meets the query block's (non-decreasing ids: exactly the blocks with a same-document pair)."""
    ids = ids[0].tolist()
    out = []
    for i in range(-(-s // bm)):
        rows = ids[i * bm:min(s, i * bm + bm)]
        end = min(s, i * bm + bm) if causal else s
        out.append(sum(1 for j in range(0, end, bn) if ids[j] <= rows[-1] and ids[min(s, j + bn) - 1] >= rows[0]))
    return out


def test_masked_tiles_are_not_visited():
    """count_visits: the kernels' own loop iterations. With documents the forward / dQ programs visit exactly the
    key blocks sharing a document, the dK/dV programs the query blocks, and all fewer than causal alone."""
    s, fwd, kv, dq_blocks = 200, (32, 16), (16, 32), (32, 16)
    ids = ids_of((70, 40, 60, 30))
    q, k, v = (torch.randn(1, 1, s, 16) for _ in range(3))
    o, lse, visits = FA.flash_forward(q, k, v, True, blocks=fwd, count_visits=True, q_doc=ids, k_doc=ids)
    assert visits.tolist() == [doc_tiles_expected(ids, s, *fwd, True)]
    _, _, plain = FA.flash_forward(q, k, v, True, blocks=fwd, count_visits=True)
    assert visits.sum() < 0.6 * plain.sum()
    *_, (kv_visits, q_visits) = FA.flash_backward(q, k, v, o, lse, torch.randn_like(o), True, blocks=(kv, dq_blocks),
                                                 count_visits=True, q_doc=ids, k_doc=ids)
    assert q_visits.tolist() == [doc_tiles_expected(ids, s, *dq_blocks, True)]
    # dK/dV: key block j visits query blocks from the causal start on that share a document
    t = ids[0].tolist()
    want = [sum(1 for i in range(j * kv[1] // kv[0] * kv[0], s, kv[0])
                if t[i] <= t[min(s, j * kv[1] + kv[1]) - 1] and t[min(s, i + kv[0]) - 1] >= t[j * kv[1]])
            for j in range(-(-s // kv[1]))]
    assert kv_visits.tolist() == [want]
    *_, (kv_plain, _) = FA.flash_backward(q, k, v, o, lse, torch.randn_like(o), True, blocks=(kv, dq_blocks),
                                         count_visits=True)
    assert kv_visits.sum() < 0.6 * kv_plain.sum()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_documents_both_impls_match_float64(causal):
    """kernels.attention(..., documents=): the torch fallback (SDPA, boolean mask) and the Triton kernel through
    its autograd Function, against the same float64 reference; GQA 4 over 2 heads, documents 1, 17, 30."""
    torch.manual_seed(13)
    ids = ids_of((1, 17, 30))
    for impl in ("torch", "triton"):
        q, k, v = (torch.randn(1, n, 48, 16).requires_grad_() for n in (4, 2, 2))
        out = A.attention(q, k, v, causal=causal, impl=impl, documents=ids)
        dout = torch.randn_like(out)
        out.backward(dout)
        leaves, ref_out, _ = reference(q, k, v, ids, ids, causal)
        ref_out.backward(dout.double())
        close(out, ref_out, f"{impl} O")
        for name, g, r in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), leaves):
            close(g, r.grad, f"{impl} {name}")


def test_torch_fallback_ragged_documents_gqa():
    """The torch fallback at the kernel test's sizes (documents 1, 17, 300; seq 318), causal."""
    torch.manual_seed(14)
    ids = ids_of(LENGTHS)
    q, k, v = (torch.randn(1, n, 318, 16).requires_grad_() for n in (4, 2, 2))
    out = A.attention(q, k, v, causal=True, impl="torch", documents=ids)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves, ref_out, _ = reference(q, k, v, ids, ids, True)
    ref_out.backward(dout.double())
    close(out, ref_out, "O")
    for name, g, r in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), leaves):
        close(g, r.grad, name)


def test_document_ids_are_checked():
    q = torch.randn(1, 2, 8, 16)
    ids = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="both q_doc and k_doc"):
        FA.flash_forward(q, q, q, True, q_doc=ids)
    with pytest.raises(ValueError, match=r"k_doc must be integer document ids of shape \(batch, seq\)"):
        FA.flash_forward(q, q, q, True, q_doc=ids, k_doc=torch.zeros(1, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="documents must be"):
        A.attention(q, q, q, impl="torch", documents=torch.zeros(1, 9, dtype=torch.int32))
