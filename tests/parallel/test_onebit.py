"""The 1-bit compressed all-reduce (parallel.onebit): signs packed 8 per byte and back; at 4 gloo ranks, 20 calls
in a row (the error feedback carried between them) equal Tang et al. 2021's two-phase compression simulated for
4 workers in this process, on every rank, outputs and both error buffers; the bytes on the wire are at most
1/16 of an fp32 all-reduce's (1/32 and the scales); and the error feedback loses nothing over the calls.

Tolerance 1e-6 relative to the largest value (of the outputs, or of the error buffer compared): the ranks and the simulation do the same fp32 operations except
the order of the 4-term mean over workers (a few ulps), and a sign flipped by such an ulp would move an element
by two scales: it does not happen on these random values (checked: the differences are ~1e-7).

A second series leaves elements out (group 0: the padding, a chunk with none live): the reference drops those
elements outright and compresses what is left, so they must be as if absent. A third puts the live elements in
two scale groups, which the reference compresses as two separate tensors, each with its own scale per chunk;
and in one process, a group's compressed values and errors are bit-identical whatever the other group holds
(what keeps a tp-replicated parameter's copies equal)."""
from __future__ import annotations

import torch

from megazero.parallel.onebit import pack_signs, padded_length, unpack_signs
from tests.dist import run_ranks

WORLD, N, CALLS = 4, padded_length(1000, 4), 20


def test_signs_pack_eight_per_byte_and_back():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1e-30, 5.0, -5.0] * 3)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 3
    want = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), want)
    assert packed[0].item() == 0b01011101  # bit j is element j: +, -, +, + (-0.0 >= 0), +, -, +, -


def _inputs(rank: int, call: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * call + rank))


def _live() -> torch.Tensor:
    """Alive at random (group 1), 1 in 4 dead, the last 37 (padding) and all of chunk 1 dead."""
    live = (torch.rand(N, generator=torch.Generator().manual_seed(7)) > 0.25).to(torch.uint8)
    live[-37:] = 0
    live[N // WORLD:2 * N // WORLD] = 0
    return live


def _two_groups() -> torch.Tensor:
    """The live elements of ``_live`` split at random into groups 1 and 2; chunk 2 has group 2 only."""
    live = _live()
    second = torch.rand(N, generator=torch.Generator().manual_seed(8)) > 0.5
    second[2 * N // WORLD:3 * N // WORLD] = True
    return torch.where(second & (live > 0), 2, live).to(torch.uint8)


SERIES = (None, _live(), _two_groups())


def _ranks(rank, world):
    import torch.distributed as dist

    from megazero.parallel.comm import Comm, CommCounter
    from megazero.parallel.onebit import compressed_allreduce

    counter = CommCounter()
    comm = Comm(dist.group.WORLD, "dp", counter)
    series = []
    for groups in SERIES:
        counter.reset()
        worker, server = torch.zeros(N), torch.zeros(N // world)
        outs = []
        for call in range(CALLS):
            outs.append(compressed_allreduce(_inputs(rank, call), worker, server, comm, groups=groups,
                                             group_count=2 if groups is not None else 1))
        sent = counter.sent_bytes()["dp"]
        series.append((torch.stack(outs).numpy(), worker.numpy(), server.numpy(), sent))  # by value
    return series


def _reference(groups=None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Tang et al. 2021, Algorithm 1's compressed all-reduce, for WORLD workers in one process; with ``groups``,
    of the live elements only (group 0 is dropped before compression and comes out 0), each group compressed on
    its own."""
    chunk = N // WORLD
    workers = [torch.zeros(N) for _ in range(WORLD)]
    servers = [torch.zeros(chunk) for _ in range(WORLD)]
    groups = torch.ones(N, dtype=torch.uint8) if groups is None else groups
    keep = groups > 0

    def compress(v, where_groups):
        out = torch.zeros_like(v)
        for k in (1, 2):
            where = where_groups == k
            kept = v[where]
            if kept.numel():
                out[where] = kept.norm() / kept.numel() ** 0.5 * torch.where(kept >= 0, 1.0, -1.0)
        return out

    outs = []
    for call in range(CALLS):
        sent = []
        for w in range(WORLD):
            c = torch.where(keep, _inputs(w, call) + workers[w], 0.0)
            q = torch.cat([compress(part, k) for part, k in zip(c.view(WORLD, chunk), groups.view(WORLD, chunk))])
            workers[w] = c - q
            sent.append(q)
        out = []
        for r in range(WORLD):
            m = torch.stack([s[r * chunk:(r + 1) * chunk] for s in sent]).mean(0) + servers[r]
            q = compress(m, groups[r * chunk:(r + 1) * chunk])
            servers[r] = m - q
            out.append(q)
        outs.append(torch.cat(out))
    return torch.stack(outs), workers, servers


def test_four_ranks_equal_the_papers_compression_and_send_a_thirty_second():
    results = run_ranks(WORLD, _ranks)
    for series, groups in enumerate(SERIES):
        _check([r[series] for r in results], groups)


def _check(results, groups) -> None:
    want, workers, servers = _reference(groups)
    scale = want.abs().max().item()
    live = None if groups is None else (groups > 0).float()
    if live is not None:
        assert want[:, live == 0].abs().max().item() == 0 and want[:, live == 1].abs().min().item() > 0
    for rank, (outs, worker, server, sent) in enumerate(results):
        outs, worker, server = torch.from_numpy(outs), torch.from_numpy(worker), torch.from_numpy(server)
        assert (outs - want).abs().max().item() <= 1e-6 * scale, rank
        for got, ref in ((worker, workers[rank]), (server, servers[rank])):
            assert (got - ref).abs().max().item() <= 1e-6 * max(scale, ref.abs().max().item()), rank
        fp32_allreduce = CALLS * 2 * (WORLD - 1) / WORLD * N * 4
        assert sent <= fp32_allreduce / 16, (rank, sent, fp32_allreduce)
    # error feedback loses nothing: the outputs' sum is the exact means' sum less what the errors hold now
    # (sum_t q = sum_t x - e_T for every compression), to fp32 rounding over 20 sums
    exact = torch.stack([torch.stack([_inputs(w, c) for w in range(WORLD)]).mean(0) for c in range(CALLS)])
    if live is not None:
        exact = exact * live
    held = torch.stack(workers).mean(0) + torch.cat(servers)
    assert (want.sum(0) - (exact.sum(0) - held)).abs().max().item() <= 1e-5 * scale * CALLS


def test_a_groups_values_do_not_depend_on_the_other_groups():
    """Two 'tp ranks' whose buckets hold the same group-2 elements (a replicated norm) among different group-1
    elements (their own shards): group 2's output and errors come out bit-identical on both, over 20 calls."""
    from megazero.parallel.comm import Comm
    from megazero.parallel.onebit import compressed_allreduce

    groups = _two_groups()
    second = groups == 2
    runs = []
    for shard in (0, 1):
        worker, server = torch.zeros(N), torch.zeros(N)
        outs = []
        for call in range(CALLS):
            x = torch.where(second, _inputs(99, call), _inputs(shard, call) * (1 + 10 * shard))
            outs.append(compressed_allreduce(x, worker, server, Comm(None, "dp"), groups=groups, group_count=2))
        runs.append((torch.stack(outs), worker, server))
    (a, wa, sa), (b, wb, sb) = runs
    assert torch.equal(a[:, second], b[:, second]) and torch.equal(wa[second], wb[second])
    assert torch.equal(sa[second], sb[second])
    assert not torch.equal(a[:, groups == 1], b[:, groups == 1])  # the other group did differ


def test_both_ways_of_reading_the_groups_give_the_same_compression():
    """A group's norm and spread over its spans, or over the whole chunk once per group (group_layout picks the
    cheaper): the same values, to float64's summation order (1e-6 relative on fp32 results), over interleaved
    groups, a group absent from a chunk and left-out elements, at 1 rank (both phases in one process)."""
    import dataclasses

    from megazero.parallel.comm import Comm
    from megazero.parallel.onebit import compressed_allreduce, group_layout

    groups = _two_groups()
    layout = group_layout(groups, 1, 2)
    outs = []
    for by_span in (True, False):
        worker, server = torch.zeros(N), torch.zeros(N)
        forced = dataclasses.replace(layout, by_span=by_span)
        outs.append(torch.stack([compressed_allreduce(_inputs(3, call), worker, server, Comm(None, "dp"),
                                                      groups=groups, group_count=2, layout=forced)
                                 for call in range(CALLS)]))
    assert torch.allclose(outs[0], outs[1], rtol=1e-6, atol=0.0), (outs[0] - outs[1]).abs().max()
    assert outs[0][:, groups == 0].abs().max() == 0 and outs[0][:, groups > 0].abs().min() > 0
