"""Where the pieces of each whole matrix are, and who assembles it: the plan of Muon's gather and scatter.

Muon orthogonalises each logical matrix whole, but under tensor parallelism and a sharded optimizer no rank
holds one: rank (g, t) of a stage holds its slice g of the flat buckets (ZeRO's shard group, size G; the whole
bucket when the states are not sharded) of its tp shard t. Each matrix gets an owner among the stage's ranks
(the matrices dealt out by Newton-Schulz flops, largest first, one per rank and round); in round r every owner
assembles its r-th matrix from the pieces the other ranks send it (one all-to-all), orthogonalises it, and
sends each holder its pieces of the update (a second all-to-all). One matrix per rank is in flight at a time.

A piece is a run of one tp shard's flat elements inside one shard-group slice. Pieces held by several ranks (a
tp-replicated parameter; k/v heads replicated over r tp ranks; any piece under an unsharded optimizer) are
sent once, by the holder nearest the owner (its own tp rank and slice where it holds them), and their update
goes back to every holder. Every rank of a stage has the same buckets (same names, shapes and offsets: tp
shards are equal), so each rank derives every other rank's pieces from its own layout: no metadata travels.
Stacked experts (``ep_split_dim`` 0) are one matrix per expert, held by the ep rank whose slice holds it.

Stage ranks are ordered tp fastest, as the grid's: ``s = ((d * cp) + c) * tp + t`` with d the dp rank, and
d = edp * ep + e with expert parallelism (``parallel.topology``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megazero.kernels.newton_schulz import newton_schulz_flops
from megazero.parallel.zero.declared import DENSE, reduce_group
from megazero.parallel.zero.layout import BucketLayout

Slice = tuple[int, int, int]  # (bucket index, start, end) in this rank's optimizer range of the bucket
Span = tuple[int, int]  # [start, end) in an owner's assembled buffer of a matrix


@dataclass(frozen=True)
class StagePlace:
    """How a stage rank's index maps to (shard-group rank, tp rank, ep rank) for one partition's layout."""

    tp: int
    cp: int
    ep: int
    experts: bool  # the experts' partition (shard group edp x cp) rather than the dense one (dp x cp)
    stage_size: int  # ranks in the stage: dp * cp * tp

    def coords(self, s: int) -> tuple[int, int, int]:
        t, c, d = s % self.tp, (s // self.tp) % self.cp, s // (self.tp * self.cp)
        if self.experts:
            return (d // self.ep) * self.cp + c, t, d % self.ep
        return d * self.cp + c, t, 0

    def rank(self, g: int, t: int, e: int) -> int:
        c, outer = g % self.cp, g // self.cp
        d = outer * self.ep + e if self.experts else outer
        return (d * self.cp + c) * self.tp + t


@dataclass(frozen=True)
class Matrix:
    """One logical matrix of the stage: a parameter's, or one expert's of a stacked expert tensor."""

    index: int  # position in the stage's list (the same on every rank)
    name: str
    expert: Optional[int]  # global expert index (stacked experts), else None
    bucket: int
    offset: int  # element offset in the bucket of the tp shard (this expert's matrix)
    shape: tuple[int, int]  # the tp shard's
    split_dim: Optional[int]  # the tp split (None: the same on every tp rank)
    positions: int  # distinct tp shards the logical matrix is made of
    replicas: int  # consecutive tp ranks holding the same shard
    holder_ep: int  # the ep rank that holds it (0 for a dense matrix: every rank)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def logical_shape(self) -> tuple[int, int]:
        rows, cols = self.shape
        if self.split_dim == 0:
            return rows * self.positions, cols
        if self.split_dim == 1:
            return rows, cols * self.positions
        return rows, cols

    def tp_holders(self, q: int, tp: int) -> range:
        """The tp ranks holding shard position q."""
        if self.split_dim is None:
            return range(tp)
        return range(q * self.replicas, (q + 1) * self.replicas)


@dataclass
class Round:
    """One rank's part of one round: what it sends and receives in the gather and in the scatter."""

    matrix: Optional[Matrix]  # the matrix this rank assembles in this round (None: none left)
    gather_send: list[list[Slice]] = field(default_factory=list)  # per stage rank
    gather_recv: list[list[Span]] = field(default_factory=list)  # per stage rank, into the assembled buffer
    scatter_send: list[list[Span]] = field(default_factory=list)
    scatter_recv: list[list[Slice]] = field(default_factory=list)


def stage_matrices(layout: BucketLayout, is_matrix: dict[int, bool], tp: int, ep: int) -> list[Matrix]:
    """The stage's matrices, in bucket order; ``is_matrix[id(param)]`` says which parameters Muon takes."""
    out: list[Matrix] = []
    for b in layout.buckets:
        for (name, p), off in zip(b.params, b.offsets):
            if not is_matrix.get(id(p), False):
                continue
            split = getattr(p, "tp_split_dim", None)
            replicas = getattr(p, "tp_replicas", 1)
            positions = 1 if split is None or tp == 1 else tp // replicas
            if getattr(p, "ep_split_dim", None) == 0:
                assert p.dim() == 3 and split is None, (name, tuple(p.shape), split)
                local = p.shape[0]
                for x in range(local * ep):
                    e, j = divmod(x, local)
                    out.append(Matrix(len(out), name, x, b.index, off + j * p.shape[1] * p.shape[2],
                                      (p.shape[1], p.shape[2]), None, 1, 1, e))
            else:
                # an expert's 2-D matrix would be held by one ep rank, which holder_ep 0 does not say
                assert p.dim() == 2 and reduce_group(p) == DENSE, (name, tuple(p.shape))
                out.append(Matrix(len(out), name, None, b.index, off, (p.shape[0], p.shape[1]),
                                  split if positions > 1 else None, positions, replicas if positions > 1 else 1, 0))
    return out


def assign_owners(matrices: list[Matrix], ranks: int, steps: int) -> list[list[Matrix]]:
    """Each stage rank's matrices, in its rounds' order: the matrices sorted by Newton-Schulz flops, largest
    first, dealt out a round at a time, the direction alternating (a snake), so there are ceil(M / ranks)
    rounds and no rank does more than the largest matrix's flops above the mean (each round's matrices are
    no larger than the previous round's smallest)."""
    owned: list[list[Matrix]] = [[] for _ in range(ranks)]
    ordered = sorted(matrices, key=lambda m: (-newton_schulz_flops(*m.logical_shape, steps), m.index))
    for k, m in enumerate(ordered):
        r, i = divmod(k, ranks)
        owned[i if r % 2 == 0 else ranks - 1 - i].append(m)
    return owned


class MatrixPlan:
    """This rank's rounds: for each, the slices it sends and the spans it receives, per stage rank."""

    def __init__(self, layout: BucketLayout, matrices: list[Matrix], place: StagePlace, me: int, steps: int):
        self.layout, self.place, self.me = layout, place, me
        g_me, t_me, e_me = place.coords(me)
        assert g_me == layout.dp_rank and e_me < place.ep, (me, g_me, layout.dp_rank)
        ranks = place.stage_size
        owned = assign_owners(matrices, ranks, steps)
        owner = {m.index: r for r, ms in enumerate(owned) for m in ms}
        round_of = {m.index: i for ms in owned for i, m in enumerate(ms)}
        self.rounds = [Round(owned[me][i] if i < len(owned[me]) else None,
                             [[] for _ in range(ranks)], [[] for _ in range(ranks)],
                             [[] for _ in range(ranks)], [[] for _ in range(ranks)])
                       for i in range(max((len(ms) for ms in owned), default=0))]
        sharded = layout.policy.shard_optimizer
        for m in matrices:
            o, r = owner[m.index], self.rounds[round_of[m.index]]
            g_o, t_o, _ = place.coords(o)
            mine = m.holder_ep == e_me or not place.experts
            for q in range(m.positions):
                holders_t = m.tp_holders(q, place.tp)
                t_send = t_o if t_o in holders_t else holders_t[0]
                for g, c0, c1 in self._segments(m, sharded):
                    span = (q * m.numel + c0, q * m.numel + c1)
                    sender = place.rank(g if g is not None else g_o, t_send, m.holder_ep)
                    held_here = mine and t_me in holders_t and (g is None or g == g_me)
                    if held_here:
                        local = self._local(m, c0, c1)
                        r.scatter_recv[o].append(local)
                        if sender == me:
                            r.gather_send[o].append(local)
                    if o == me:
                        r.gather_recv[sender].append(span)
                        for g_h in ([g] if g is not None else range(layout.dp)):
                            for t_h in holders_t:
                                r.scatter_send[place.rank(g_h, t_h, m.holder_ep)].append(span)
        self.matrices = len(matrices)

    def _segments(self, m: Matrix, sharded: bool) -> list[tuple[Optional[int], int, int]]:
        """(shard-group rank or None for all of them, start, end) of the tp shard's elements, cut by the slices."""
        if not sharded:
            return [(None, 0, m.numel)]
        shard = self.layout.buckets[m.bucket].shard
        out = []
        for g in range(m.offset // shard, (m.offset + m.numel - 1) // shard + 1):
            a, z = max(m.offset, g * shard), min(m.offset + m.numel, (g + 1) * shard)
            out.append((g, a - m.offset, z - m.offset))
        return out

    def _local(self, m: Matrix, c0: int, c1: int) -> Slice:
        lo, _ = self.layout.range(self.layout.buckets[m.bucket])
        return m.bucket, m.offset + c0 - lo, m.offset + c1 - lo
