"""The counts a rank class's simulation is extrapolated in, and the smaller config at each point
(``megazero.plan.extrapolate`` simulates those points and carries the figures to the run's counts).

- **Microbatches.** Once the rank's own 1F1B, zb1p or interleaved schedule has begun to repeat its steady
  state (``megazero.plan.periodic``: zb1p at pp + 2 microbatches on every rank, 1F1B rank r at pp - r + 2),
  more microbatches repeat held amounts: the peak grows only by the step's token ids (the data loader hands
  over the whole step's), the bytes sent grow by one microbatch's sends each, the model states do not
  change. GPipe holds every microbatch at once: it is simulated at its own count.
- **Layers of one kind.** Each middle layer of a chunk adds its parameters, gradients and optimizer states,
  its saved activations in every microbatch alive at the peak and its sends; what a layer holds only while
  it runs (ZeRO-3's gathered layer, the layer being recomputed, the bucket reductions in flight) is the
  same at every count, and the embeddings, head and logits are fixed. A chunk keeps its first and last
  layer (the first saves the received input, the last's output is sent); the ones between are removed,
  each kind (``layer_kind``) on its own axis, the same number from each of the rank's chunks, so uneven
  stages and virtual stages stay as uneven. The smallest count keeps two middle layers of each kind: below
  that the increments still change (ZeRO-3's at 2 and 3 layers per stage, the build's transients).
- **Routed experts per ep rank.** Each adds its parameters, gradients and optimizer states, its row of the
  router and of the per-expert counts; the simulated dispatch is balanced, so the rows an ep rank's experts
  receive do not change, only how they are grouped, and the counts simulated keep the run's grouping
  (``expert_axis``). At 65,536 experts a rank class is 3 small simulations, not minutes of building and
  stepping 32,768 experts a rank. There (configs/tiny-moe.yaml) the figures are within 0.13% of the full
  simulation's: most of the run's experts receive no rows, which no small count shows.
- The bytes sent have a microbatches x layers term (every layer's tp collectives run once per
  microbatch), measured at one point with both counts raised.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from megazero.config.schema import Config
from megazero.plan.periodic import periodic_microbatches

EXPERTS = "routed experts"  # the kind of the expert-count axis (a layer kind is a class name)
MIDDLE = 2  # the middle layers of each kind a chunk keeps at the smallest count (4 layers: first, 2, last)
REACH = 3  # an axis is worth it when the real count is at least this many steps past the smallest


def layer_kind(cfg: Config, chunk: range, position: int) -> str:
    """The kind of the layer at ``position`` of a chunk (the global layer ids it holds): layers of one kind
    add the same bytes each. The block's MLP class (one per model today), and whether the layer is
    recomputed in backward where ``model.checkpoint_layers`` recomputes only the chunk's first layers. A
    model with blocks of several kinds (dense and mixture-of-experts) names them here, and ``variant``
    learns which config keys build fewer of each (it asserts the smaller chunks hold the kinds asked for)."""
    from megazero.models.parts import parts_of

    m = cfg.model
    moe = getattr(m, "moe", None)
    mixture = moe is not None and moe.is_moe_layer(chunk[position])
    kind = parts_of(m).experts.__name__ if mixture else parts_of(m).mlp.__name__
    if m.activation_checkpointing and 0 < m.checkpoint_layers < len(chunk):
        kind += " recomputed" if position < m.checkpoint_layers else " kept"
    return kind


def _ranges(cfg: Config) -> list[range]:
    from megazero.parallel.pipeline import partition_layers

    p = cfg.parallel
    return partition_layers(cfg.model.layers, p.pp * p.virtual_stages, p.pp_layers)


def _middle(cfg: Config, chunk: range) -> Counter:
    """The kinds of a chunk's middle layers (all but its first and last)."""
    return Counter(layer_kind(cfg, chunk, i) for i in range(1, len(chunk) - 1))


@dataclass(frozen=True)
class Axis:
    """One count extrapolated in: x = 0, 1, 2 are simulated, ``real`` is the run's x. ``kind`` is a layer
    kind (x adds that many of its layers to each of the rank's chunks) or None for the microbatches."""

    kind: Optional[str]  # or EXPERTS: routed experts per ep rank (ep times it is model.moe.experts)
    low: int  # the count at x = 0: microbatches, or the layers of this kind in the rank's chunk with fewest
    step: int  # what x = 1 adds
    real: int
    doubling: bool = False  # x = 2 is at 4 x low (position 3), not 3 x low: the expert axis where every count
    # simulated must divide the rows, as the run's does (its balanced experts then take one batched matmul)

    def count(self, x: int) -> int:
        return self.low << x if self.doubling and x <= 2 else self.low + x * self.step

    @property
    def two(self) -> int:
        """The position of x = 2, in steps from x = 0."""
        return 3 if self.doubling else 2

    def label(self, cfg: Config, chunks: list[int]) -> str:
        """What is counted: the kind is named where a chunk holds several."""
        if self.kind is None:
            return "microbatches"
        if self.kind == EXPERTS:
            return "routed experts per ep rank"
        ranges = _ranges(cfg)
        several = any(len({layer_kind(cfg, ranges[vs], i) for i in range(len(ranges[vs]))}) > 1 for vs in chunks)
        return (f"{self.kind} " if several else "") + ("layers per model chunk" if len(chunks) > 1 else
                                                       "layers per stage")


def choose_axes(cfg: Config, rank: int) -> list[Axis]:
    """The axes worth extrapolating for this rank: each at least ``REACH`` steps from its real count. The
    microbatches from where this rank's own schedule repeats its steady state (``megazero.plan.periodic``:
    pp + 2 for zb1p, not the 2pp + 2 every rank of it needs)."""
    from megazero.parallel.dims import ParallelDims

    p, axes = cfg.parallel, []
    m = cfg.microbatches
    step = p.pp if p.schedule == "interleaved" else 1
    pp_rank = ParallelDims.of(p).coords(rank).pp
    low = periodic_microbatches(p.schedule, p.pp, pp_rank, m, p.virtual_stages, p.overlap_p2p, step)
    if low is not None and (m - low) // step >= REACH:
        axes.append(Axis(None, low, step, (m - low) // step))
    chunks = [_ranges(cfg)[vs] for vs in rank_chunks(cfg, rank)]
    middles = [_middle(cfg, r) for r in chunks]
    for kind in sorted(set().union(*middles)):
        fewest = min(mid[kind] for mid in middles)
        if fewest - MIDDLE >= REACH:
            r = next(r for r, mid in zip(chunks, middles) if mid[kind] == fewest)
            held = sum(layer_kind(cfg, r, i) == kind for i in range(len(r)))  # its first or last may be one too
            axes.append(Axis(kind, held - fewest + MIDDLE, 1, fewest - MIDDLE))
    moe = getattr(cfg.model, "moe", None)
    if moe is not None and any(moe.is_moe_layer(i) for r in chunks for i in r):
        axes += [a for a in (expert_axis(cfg),) if a is not None]
    return axes


def expert_axis(cfg: Config) -> Optional[Axis]:
    """Routed experts per ep rank, at counts that take the run's path through the simulated (balanced)
    dispatch: where the count divides the rows an ep rank receives, every expert has as many and they run as
    one batched matmul, whose cast of the stacked weights grows twice as fast per expert as the uneven
    groups' matmuls; so counts that divide the rows where the run's does (low, 2 low, 4 low), or three in a
    row that do not where it does not."""
    p, m, moe = cfg.parallel, cfg.model, cfg.model.moe
    local = moe.experts // p.ep
    least = max(2, -(-moe.top_k // p.ep))  # top_k experts in all; 2 a rank (1 takes another dispatch path)
    rows = cfg.train.micro_batch * m.seq_len * moe.top_k // (p.tp * p.cp)  # a microbatch's, each rank's
    if rows % local == 0:
        low = next((d for d in range(least, local // 8 + 1) if local % (4 * d) == 0), None)
        return None if low is None else Axis(EXPERTS, low, low, local // low - 1, doubling=True)
    low = next((n for n in range(least, local - REACH + 1) if all(rows % (n + i) for i in range(3))), None)
    return None if low is None else Axis(EXPERTS, low, 1, local - low)


def rank_chunks(cfg: Config, rank: int) -> list[int]:
    """The virtual stages the rank's chunks run."""
    from megazero.parallel.schedules import virtual_stage
    from megazero.parallel.dims import ParallelDims

    p = cfg.parallel
    pp_rank = ParallelDims.of(p).coords(rank).pp
    return [virtual_stage(pp_rank, c, p.pp) for c in range(p.virtual_stages)]


def variant(cfg: Config, chunks: list[int], axes: list[Axis], x: tuple[int, ...]) -> Config:
    """The config whose rank (running virtual stages ``chunks``) is at ``x`` on each axis: fewer microbatches
    (train.global_batch), and ``real - x`` fewer middle layers of each kind on an axis in every chunk
    (parallel.pp_layers and model.layers; model.checkpoint_layers when the recomputed ones are cut). The
    other ranks' chunks are cut alike, kept at their first and last layer: they do not reach this rank."""
    out = copy.deepcopy(cfg)
    less = {}
    for a, xi in zip(axes, x):
        if a.kind is None:
            out.train.global_batch = a.count(xi) * cfg.train.micro_batch * cfg.parallel.dp
        elif a.kind == EXPERTS:
            out.model.moe.experts = a.count(xi) * cfg.parallel.ep
        else:
            less[a.kind] = a.real - xi
    if not less:
        return out
    ranges = _ranges(cfg)
    counts, wants, recomputed = [], [], set()
    for vs, r in enumerate(ranges):
        mid = _middle(cfg, r)
        want = +Counter({k: n - less.get(k, 0) for k, n in mid.items()})
        counts.append(len(r) - sum(mid.values()) + sum(want.values()))
        wants.append(want)
        if vs in chunks and layer_kind(cfg, r, len(r) - 1).endswith(" kept"):  # recomputes its first k
            recomputed.add(1 + sum(n for k, n in want.items() if k.endswith(" recomputed")))
    assert len(recomputed) <= 1, recomputed  # each chunk keeps model.checkpoint_layers' first layers and loses alike
    if recomputed:
        out.model.checkpoint_layers = recomputed.pop()
    out.model.layers, out.parallel.pp_layers = sum(counts), counts
    for vs in chunks:  # the rank's chunks hold the same kinds, fewer of them
        r, was = _ranges(out)[vs], ranges[vs]
        assert (layer_kind(out, r, 0), layer_kind(out, r, len(r) - 1), _middle(out, r)) == (
            layer_kind(cfg, was, 0), layer_kind(cfg, was, len(was) - 1), wants[vs]), (vs, r, was)
    return out
