"""Muon's exchange plan (parallel.zero.matrix_plan), built for every rank of a stage in one process from each
rank's own layout, as the ranks build it: what one rank sends another in a round is what that rank expects
from it; every owner's pieces tile its matrix once; every element a rank holds of a matrix comes back to it
exactly once; the owners' work is balanced; and the dry run's count of the bytes (megazero.plan.muon) is the
plan's own. Layouts: k/v heads replicated over tp 4, ZeRO 0 and 1 over dp 2 with several buckets (matrices
cut across the dp slices), and experts over ep 2 (one matrix per expert, replicated over tp)."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from megazero.kernels.newton_schulz import newton_schulz_flops
from megazero.config.load import load_config
from megazero.plan.muon import STATE_BYTES, muon_step
from megazero.plan.params import _planning_comm
from megazero.models.stage import GPT
from megazero.parallel.zero.declared import DENSE, EXPERT, reduce_group
from megazero.parallel.zero.layout import BucketLayout
from megazero.parallel.zero.matrix_plan import MatrixPlan, StagePlace, stage_matrices
from megazero.parallel.zero.muon import muon_matrices
from megazero.parallel.zero.policy import StagePolicy
from tests.runs import ROOT

TINY = str(ROOT / "configs" / "tiny.yaml")
LLAMA = ["model.arch=llama", "model.heads=8", "model.kv_heads=2", "model.tie_embeddings=false"]
MOE = LLAMA + ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32", "model.moe.dense_layers=1"]


def _comm(rank: int, size: int, name: str):
    comm = _planning_comm(size, name)
    comm.rank = rank
    return comm


def _stage(overrides: list[str], tp: int, dp: int, ep: int, stage: int, experts: bool):
    """Each stage rank's MatrixPlan of the dense (or the experts') partition, and the config."""
    cfg = load_config(TINY, [f"parallel.tp={tp}", f"parallel.dp={dp}", f"parallel.ep={ep}", "parallel.pp=1",
                             f"zero.stage={stage}", "model.layers=3", "model.hidden=64", "model.heads=4", "optim.name=muon"] + overrides)
    m = cfg.model
    kv = max(1, tp // m.kv_head_count) if m.arch == "llama" else 1
    place = StagePlace(tp, 1, ep, experts, dp * tp)
    plans, layouts = [], []
    for s in range(dp * tp):
        g, t, e = place.coords(s)
        d = s // tp  # the dp rank
        with torch.device("meta"):
            model = GPT(m, tp=_comm(t, tp, "tp"), layer_ids=range(m.layers), first_stage=True, last_stage=True,
                        kv_replicas=_comm(t % kv, kv, "kv"), ep=_comm(d % ep, ep, "ep"))
        want = EXPERT if experts else DENSE
        size, rank = (dp // ep, d // ep) if experts else (dp, d)
        layout = BucketLayout([model], StagePolicy.of(stage), size, rank, torch.float32, torch.float32, 0.002,
                              torch.device("cpu"), select=lambda p: reduce_group(p) == want)
        matrices = stage_matrices(layout, muon_matrices([model]), tp, ep)
        plans.append(MatrixPlan(layout, matrices, place, s, 5))
        layouts.append((layout, matrices))
    return cfg, plans, layouts


CASES = {
    "kv2_tp4_z0": (LLAMA, 4, 2, 1, 0, False),
    "kv2_tp4_z1": (LLAMA, 4, 2, 1, 1, False),
    "gpt2_tp2_dp2_z1": ([], 2, 2, 1, 1, False),
    "moe_ep2_tp2_experts": (MOE, 2, 4, 2, 1, True),
    "moe_ep2_tp2_dense_z0": (MOE, 2, 4, 2, 0, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_agrees_and_every_piece_travels_once(name):
    overrides, tp, dp, ep, stage, experts = CASES[name]
    cfg, plans, layouts = _stage(overrides, tp, dp, ep, stage, experts)
    ranks = len(plans)
    rounds = {len(p.rounds) for p in plans}
    assert len(rounds) == 1, rounds  # every rank calls the same number of all-to-alls
    sent = [0] * ranks
    for i in range(rounds.pop()):
        for a in range(ranks):
            ra = plans[a].rounds[i]
            for b in range(ranks):
                rb = plans[b].rounds[i]
                size = lambda pieces: sum(z - x for *_, x, z in pieces)  # noqa: E731
                assert size(ra.gather_send[b]) == size(rb.gather_recv[a]), (name, i, a, b)
                assert size(ra.scatter_send[b]) == size(rb.scatter_recv[a]), (name, i, a, b)
                sent[a] += size(ra.gather_send[b]) + size(ra.scatter_send[b])
            if ra.matrix is not None:  # the owner's pieces tile its matrix once
                spans = sorted(span for peer in ra.gather_recv for span in peer)
                whole = ra.matrix.numel * ra.matrix.positions
                assert spans[0][0] == 0 and spans[-1][1] == whole, (name, spans[:2], whole)
                assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), (name, i, a)
    for s, (layout, matrices) in enumerate(layouts):  # every element a rank holds of a matrix comes back once
        back = sorted((i, x, z) for r in plans[s].rounds for peer in r.scatter_recv for i, x, z in peer)
        held = []
        for m in matrices:
            lo, hi = layout.range(layout.buckets[m.bucket])
            x, z = max(m.offset, lo) - lo, min(m.offset + m.numel, hi) - lo
            if x < z and (m.holder_ep == plans[s].place.coords(s)[2] or not experts):
                held.append((m.bucket, x, z))
        merged = []
        for piece in back:  # pieces of one matrix from several rounds' owners are one run of the bucket
            if merged and merged[-1][0] == piece[0] and merged[-1][2] == piece[1]:
                merged[-1] = (piece[0], merged[-1][1], piece[2])
            else:
                merged.append(piece)
        assert merged == _merged(sorted(held)), (name, s)
    # balanced: no owner has more than the largest matrix's flops above the mean
    loads = [sum(newton_schulz_flops(*r.matrix.logical_shape) for r in p.rounds if r.matrix) for p in plans]
    largest = max(newton_schulz_flops(*m.logical_shape) for _, ms in layouts for m in ms)
    assert max(loads) - sum(loads) / ranks <= largest, (name, loads)
    matrices = len(layouts[0][1])  # the stage's list, the same on every rank
    assert len(plans[0].rounds) == -(-matrices // ranks), (name, len(plans[0].rounds), matrices)
    if not experts and ep == 1:  # the dry run's bytes and calls are the plan's (its average over the stage)
        step = muon_step(cfg, [range(cfg.model.layers)])
        assert step.sent == STATE_BYTES * sum(sent) // ranks, (name, step.sent, STATE_BYTES * sum(sent) // ranks)
        assert step.calls == 2 * len(plans[0].rounds), (name, step.calls, len(plans[0].rounds))


def _merged(pieces):
    out = []
    for piece in pieces:
        if out and out[-1][0] == piece[0] and out[-1][2] == piece[1]:
            out[-1] = (piece[0], out[-1][1], piece[2])
        else:
            out.append(piece)
    return out


class _ThreadStage:
    """An all-to-all among threads of one process (one per stage rank): what ShardedMuon asks of its stage."""

    def __init__(self, size: int):
        self.size, self.box = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def member(self, rank: int):
        stage = self

        class Member:
            def __init__(self):
                self.rank, self.size = rank, stage.size

            def all_to_all(self, x, recv, send, tag=""):
                stage.box[self.rank] = list(torch.split(x, list(send)))
                stage.barrier.wait()
                out = torch.cat([stage.box[src][self.rank] for src in range(stage.size)])
                stage.barrier.wait()  # everyone has read before the next round writes
                assert out.numel() == sum(recv)
                return out

        return Member()


@pytest.mark.parametrize("name", list(CASES))
def test_owners_assemble_the_logical_matrix_and_holders_get_their_pieces(name, monkeypatch):
    """Every rank's slices filled from a numbered logical matrix (tp shards cut from it as the layers cut
    them: rows, columns, replicas, one expert each); the real gather, assembly and scatter of ShardedMuon run
    over threads, with Newton-Schulz replaced by a recorder: each owner sees exactly its logical matrix, and
    every holder gets back exactly its own pieces, scaled."""
    import megazero.parallel.zero.muon as muon

    overrides, tp, dp, ep, stage, experts = CASES[name]
    cfg, plans, layouts = _stage(overrides, tp, dp, ep, stage, experts)
    place = plans[0].place
    matrices = layouts[0][1]
    logical, start = {}, 1.0
    for m in matrices:  # unique values, exact in fp32 (fewer than 2^24 elements in all)
        rows, cols = m.logical_shape
        logical[m.index] = torch.arange(start, start + rows * cols, dtype=torch.float32).view(rows, cols)
        start += rows * cols
    assert start < 2 ** 24
    directions, wanted = [], []
    for s, (layout, ms) in enumerate(layouts):
        _, t, e = place.coords(s)
        bufs = [torch.zeros(layout.range(b)[1] - layout.range(b)[0]) for b in layout.buckets]
        for m in ms:
            if experts and m.holder_ep != e:
                continue
            q = t // m.replicas if m.split_dim is not None else 0
            rows, cols = m.shape
            whole = logical[m.index]
            shard = whole[q * rows:(q + 1) * rows] if m.split_dim == 0 else \
                (whole[:, q * cols:(q + 1) * cols] if m.split_dim == 1 else whole)
            lo, hi = layout.range(layout.buckets[m.bucket])
            a, z = max(m.offset, lo), min(m.offset + m.numel, hi)
            if a < z:
                bufs[m.bucket][a - lo:z - lo] = shard.reshape(-1)[a - m.offset:z - m.offset]
        directions.append(bufs)
        wanted.append([b.clone() for b in bufs])
    seen, lock = {}, threading.Lock()

    def recorder(x, steps):
        with lock:
            seen.setdefault(len(seen), x.clone())
        return x.clone()

    monkeypatch.setattr(muon, "newton_schulz", recorder)
    stage_comm = _ThreadStage(len(plans))
    errors = []

    def rank(s):
        try:
            o = muon.ShardedMuon.__new__(muon.ShardedMuon)
            o.plan, o.device, o.stage = plans[s], torch.device("cpu"), stage_comm.member(s)
            o.settings = muon.MuonSettings()
            o._orthogonalise(directions[s])
        except Exception as err:  # noqa: BLE001 - reported below, with the rank
            errors.append((s, repr(err)))
            stage_comm.barrier.abort()

    threads = [threading.Thread(target=rank, args=(s,)) for s in range(len(plans))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    owned = {r.matrix.index for p in plans for r in p.rounds if r.matrix is not None}
    assert owned == {m.index for m in matrices}  # every matrix has one owner
    found = sorted(x.flatten()[0].item() for x in seen.values())
    assert found == sorted(logical[i].flatten()[0].item() for i in owned), name
    for x in seen.values():  # the owner's matrix is the logical one, element for element
        first = x.flatten()[0].item()
        m = next(m for m in matrices if logical[m.index].flatten()[0].item() == first)
        assert torch.equal(x, logical[m.index]), (name, m.name, m.expert)
    for s, (layout, ms) in enumerate(layouts):  # and each holder its own pieces, times 0.2 sqrt(max(m, n))
        for m in ms:
            lo, hi = layout.range(layout.buckets[m.bucket])
            a, z = max(m.offset, lo) - lo, min(m.offset + m.numel, hi) - lo
            if a >= z or (experts and m.holder_ep != place.coords(s)[2]):
                continue
            scale = muon.SCALE * math.sqrt(max(m.logical_shape))
            got, want = directions[s][m.bucket][a:z], wanted[s][m.bucket][a:z] * scale
            assert torch.allclose(got, want, rtol=1e-6, atol=0), (name, s, m.name, m.expert)
