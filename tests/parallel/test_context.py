"""Ring attention over a head-tail split sequence (parallel.context) against whole-sequence causal attention.

float64 on gloo: the ring only regroups the same sums (block log-sum-exps merged, gradients added per block),
so values agree to ~1e-15; 1e-10 leaves room for the merge's exp/log round trips and no more."""
from __future__ import annotations

import torch

from megazero.parallel.context import context_attention, head_tail_join, head_tail_positions, head_tail_split
from tests.dist import run_ranks

# (batch, heads, kv heads, sequence, head dim, impl, dtype, tolerance): grouped-query with fewer k/v heads than
# cp ranks, and plain; torch's CPU op in float64 (1e-10, above), the Triton kernel in the interpreter in fp32
# (its sums are fp32: 1e-5 of values near 1)
CASES = {"gqa": (2, 4, 1, 32, 8, "torch", torch.float64, 1e-10), "mha": (1, 2, 2, 16, 4, "torch", torch.float64, 1e-10),
         "triton_gqa": (1, 4, 2, 32, 16, "triton", torch.float32, 1e-5)}


def _inputs(case: str):
    b, h, hkv, s, d, _, dtype, _ = CASES[case]
    g = torch.Generator().manual_seed(list(CASES).index(case))
    q, k, v, dout = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64).to(dtype) for n in (h, hkv, hkv, h))
    return q, k, v, dout


def _ring(rank, world):
    """Each case's output and input gradients, this rank's head-tail parts (numpy for the queue)."""
    import torch.distributed as dist

    from megazero.parallel.comm import Comm, CommCounter

    counter = CommCounter()
    comm = Comm(dist.group.WORLD, "cp", counter)
    out = {}
    for case in CASES:
        q, k, v, dout = (head_tail_split(t, 2, world, rank) for t in _inputs(case))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        o = context_attention(q, k, v, comm, impl=CASES[case][5])
        o.backward(dout)
        out[case] = [t.detach().numpy() for t in (o, q.grad, k.grad, v.grad)]
    # per hop one message, k and v stacked: cp - 1 hops forward, cp - 1 + cp backward (K/V again, gradients home)
    out["sends"] = (counter.count("send", "cp", "context_kv"), counter.count("send", "cp", "context_grad"))
    return out


def test_ring_attention_equals_whole_sequence_causal_attention():
    """cp 4 takes every branch of the block plan on every rank but the ends (an earlier source, a later one, its
    own), and 3 hops; cp 2 adds no other (one spawn: the model-level parity runs take cp 2)."""
    cp = 4
    results = run_ranks(cp, _ring)
    for case in CASES:
        q, k, v, dout = (t.double() for t in _inputs(case))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=k.shape[1] != q.shape[1])
        want.backward(dout)
        for i, ref in enumerate((want, q.grad, k.grad, v.grad)):
            got = head_tail_join([torch.from_numpy(r[case][i]) for r in results], dim=2).double()
            assert torch.allclose(got, ref.detach(), rtol=0, atol=CASES[case][7]), (case, i, (got - ref).abs().max())
    kv_steps = cp - 1
    assert all(r["sends"] == (len(CASES) * 2 * kv_steps, len(CASES) * cp) for r in results), results


def test_head_tail_split_balances_causal_work_and_round_trips():
    """Rank i holds chunks i and 2cp-1-i: every rank's causal (query, key) pairs are equal, and join inverts."""
    seq, cp = 64, 4
    x = torch.arange(seq)
    parts = [head_tail_split(x, 0, cp, r) for r in range(cp)]
    assert torch.equal(head_tail_join(parts, 0), x)
    work = [int((head_tail_positions(seq, cp, r) + 1).sum()) for r in range(cp)]  # keys each query sees
    assert len(set(work)) == 1, work
    assert all(torch.equal(head_tail_positions(seq, cp, r), parts[r]) for r in range(cp))


def test_the_ring_block_plan_gives_every_rank_the_same_attention_work():
    """The (query, key) pairs each rank's ring actually computes (its block plan, causal blocks counting their
    lower triangle): at cp 4 the busiest rank is within 5% of the least busy (the issue's bound; the
    head-tail plan makes them equal), and together they cover the causal mask exactly once."""
    from megazero.parallel.context import _block_plan

    seq, cp = 64, 4
    chunk = seq // (2 * cp)

    def pairs(rows: slice, keys: slice, causal: bool) -> int:
        n, m = rows.stop - rows.start, keys.stop - keys.start
        return n * (n + 1) // 2 + (m - n) * n if causal else n * m

    work = [sum(pairs(*block) for step in range(cp) for block in _block_plan(step, (r - step) % cp, r, chunk))
            for r in range(cp)]
    assert max(work) <= 1.05 * min(work), work
    assert sum(work) == seq * (seq + 1) // 2
