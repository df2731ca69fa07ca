"""kernels.attention "blocks": document-masked causal attention on the CPU with no (seq, seq) tensor, equal to the
dense mask's SDPA, and what ``auto`` resolves to under a document mask.

Tolerances: float64 agrees to 1e-12 (only the order of sums differs). fp32 against fp32 SDPA with the dense
mask, relative to the tensor's scale: the output within 1e-6 (measured <= 3e-7: both run torch's fused CPU op,
which sums over a span's keys instead of the whole row), the gradients within 1e-5 (measured <= 4.3e-6: a key's
dK/dV adds the contributions of up to four query blocks, one rounding each, and of both query heads of its
group).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.errors import UserError
from megazero.kernels.attend import attention, document_mask, resolve_impl
from megazero.kernels.document_attention import spans
from megazero.plan.tracker import MemoryTracker


def packed(batch: int, seq: int, shortest: int, longest: int, seed: int) -> torch.Tensor:
    """(batch, seq) document ids of samples packed with documents of random lengths in [shortest, longest]."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(shortest, longest + 1, (1,), generator=g)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq])
    return torch.stack(rows)


def _grads(impl, q, k, v, docs, dout, block=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if block is None:
        out = attention(q, k, v, True, impl, documents=docs)
    else:
        from megazero.kernels.document_attention import document_attention

        out = document_attention(q, k, v, docs, block)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def working_memory(fn, q, k, v, dout, docs):
    """(the memory tracker's peak beyond q, k, v, dout and the documents, less the output and the three gradients,
    which every path holds; those four) of ``fn(q, k, v)`` forward and backward."""
    tracker = MemoryTracker()
    with tracker:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        tracker.name([*leaves, dout, docs], "params")
        tracker.restart_peak("step")
        base = tracker.device_bytes
        out = fn(*leaves)
        out.backward(dout)
        peak = tracker.report().peak_bytes - base
    got = (out.detach(), *(t.grad for t in leaves))
    return peak - sum(t.numel() * t.element_size() for t in got), got


def _scaled_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("dtype, out_tol, grad_tol", [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-6, 1e-5)])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 16, 64), (1, 4, 4, 1000, 32, 128), (2, 4, 1, 257, 8, 512)],
                         ids=["gqa2-blocks-of-64", "mha-blocks-of-128", "one-kv-head-one-block"])
def test_blocks_equal_the_dense_mask(dtype, out_tol, grad_tol, shape):
    """Batch of 2 with different documents per row, grouped-query heads, a sequence the block does not divide,
    documents shorter and longer than a block (5-120 tokens), and one block holding the whole sequence."""
    b, h, kv, s, d, block = shape
    g = torch.Generator().manual_seed(s)
    q = torch.randn(b, h, s, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, kv, s, d, generator=g, dtype=dtype) for _ in range(2))
    docs, dout = packed(b, s, 5, 120, seed=s), torch.randn(b, h, s, d, generator=g, dtype=dtype)
    got = _grads(None, q, k, v, docs, dout, block=block)
    want = _grads("torch", q, k, v, docs, dout)
    assert _scaled_error(got[0], want[0]) <= out_tol
    for name, a, w in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert _scaled_error(a, w) <= grad_tol, name


def test_a_blocks_keys_begin_at_the_earliest_document_start_of_its_first_row():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 2, 2]])
    # rows 0-3: from 0; rows 4-7: row 4 is in document 1, which starts at 3 and 1 -> 1; rows 8-9: 7 and 8 -> 7
    assert spans(docs, 4) == [(0, 4, 0), (4, 8, 1), (8, 10, 7)]


def test_at_seq_8192_the_working_memory_is_over_8x_below_the_dense_masks():
    """One process, 4 heads of 64, documents of 100-2,000 tokens (the issue's case), fp32, forward and backward.
    Working memory: the memory tracker's peak beyond q, k, v and the incoming gradient, less the output and the
    three gradients, which every path holds. The dense path's is its boolean (1, 1, s, s) mask and the float
    copy SDPA makes of it (320 MiB); the blocks' is one block's (256 x span) mask and the per-block copies.
    The output and gradients agree as in the small cases."""
    s = 8192
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, s, 64, generator=g) for _ in range(4))
    docs = packed(1, s, 100, 2000, seed=0)
    dense, want = working_memory(lambda q, k, v: attention(q, k, v, True, "torch", documents=docs), q, k, v, dout,
                                 docs)
    blocks, got = working_memory(lambda q, k, v: attention(q, k, v, True, "blocks", documents=docs), q, k, v,
                                 dout, docs)
    assert dense >= 2 * s * s, dense  # the boolean mask and more: the dense path was measured
    print(f"working memory: dense {dense / 2**20:.1f} MiB, blocks {blocks / 2**20:.1f} MiB, {dense / blocks:.1f}x")
    assert blocks * 8 <= dense, (blocks, dense)
    assert _scaled_error(got[0], want[0]) <= 1e-6
    for a, w in zip(got[1:], want[1:]):
        assert _scaled_error(a, w) <= 1e-5


def test_auto_picks_a_path_without_a_dense_mask_under_documents():
    assert resolve_impl("auto", "cpu", 64, documents=True) == "blocks"
    assert resolve_impl("auto", "cpu", 64) == "torch"  # no documents: SDPA's own causal path
    assert resolve_impl("torch", "cpu", 64, documents=True) == "torch"  # the dense mask, asked for by name
    assert resolve_impl("blocks", "cpu", 64) == "blocks"
    with pytest.raises(UserError, match=r"^kernels.attention='blocks' runs torch's CPU attention op, this run is "
                                        r"on cuda; valid here: auto \| torch \| triton$"):
        resolve_impl("blocks", "cuda", 64)


def test_without_documents_blocks_is_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, True, "blocks"), F.scaled_dot_product_attention(q, k, v,
                                                                                                  is_causal=True),
                               rtol=0, atol=0)


def test_the_dense_mask_is_what_the_reference_uses():
    """The comparison above is against the mask this module's dense path builds: same document, not later."""
    docs = torch.tensor([[0, 0, 1, 1]])
    assert document_mask(docs, True)[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                                        [False, False, True, False], [False, False, True, True]]


@pytest.mark.parametrize("causal", [True, False])
def test_a_ring_blocks_rows_in_blocks_equal_one_mask(causal):
    """A cp ring's block (parallel.context_blocks) run 8 query rows at a time equals the one (rows x keys) mask,
    float64, forward and backward, with grouped-query heads and rows that see no key of the block (out 0, lse
    -inf: the ring's merge skips them)."""
    from megazero.kernels.document_attention import (masked_attention, masked_attention_backward, masked_rows,
                                                     masked_rows_backward, visible_bias)

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q_doc = torch.tensor([[0] * 6 + [1] * 14, [2] * 20])  # row 1: no key of document 2 below
    k_doc = torch.tensor([[0] * 10 + [1] * 10, [0] * 4 + [2] * 16]) if causal else torch.tensor([[1] * 20, [0] * 20])
    bias = visible_bias(q_doc, k_doc, 0 if causal else None, q.dtype)
    want_out, want_lse = masked_attention(q, k, v, bias)
    out, lse = masked_rows(q, k, v, q_doc, k_doc, causal, block=8)
    assert torch.isinf(want_lse).any() and not torch.isinf(want_lse).all()  # blind rows and seeing ones
    torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=1e-12, atol=1e-12)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    want = masked_attention_backward(dout, q, k, v, want_out, want_lse, bias)
    got = masked_rows_backward(dout, q, k, v, out, lse, q_doc, k_doc, causal, block=8)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocks_in_16_bits_are_as_close_to_float64_as_the_dense_path(dtype):
    """16-bit q, k, v (transposed views, as the model passes them), grouped-query heads, batch 2: the blocks'
    output and gradients are within 1e-2 of float64's scale, as the dense path's are (measured: bf16 ~5e-3, fp16
    ~6e-4 for both; bf16 keeps 8 bits of mantissa, 4e-3 a rounding, over a few roundings in the softmax chain);
    and under CPU autocast from fp32 inputs, blocks come out in the autocast dtype as SDPA does."""
    b, h, kv, s, d = 2, 4, 2, 300, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(b, s, kv, d, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    docs, dout = packed(b, s, 5, 120, seed=3), torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    want = _grads("torch", q, k, v, docs, dout)
    for impl in ("blocks", "torch"):
        got = _grads(impl, q.to(dtype), k.to(dtype), v.to(dtype), docs, dout.to(dtype))
        for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.dtype == dtype and _scaled_error(a.double(), w) <= 1e-2, (impl, name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [attention(q.float(), k.float(), v.float(), True, impl, documents=docs) for impl in ("blocks", "torch")]
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.bfloat16]


def test_a_sequence_of_one_block_takes_the_dense_mask():
    """Up to one block (256 tokens) the blocks path is one block over the whole sequence: SDPA with the dense
    mask is that, and faster (kernels/attend.py), so it runs; past it, the blocks (their autograd node)."""
    for s, blocks_node in ((256, False), (257, True)):
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(1, 2, s, 16, generator=g).requires_grad_() for _ in range(3))
        docs = packed(1, s, 5, 120, seed=s)
        blocks, dense = (attention(q, k, v, True, impl, documents=docs) for impl in ("blocks", "torch"))
        assert ("DocumentAttention" in type(blocks.grad_fn).__name__) == blocks_node, (s, blocks.grad_fn)
        torch.testing.assert_close(blocks, dense, rtol=1e-6, atol=1e-6)
