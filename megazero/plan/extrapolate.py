"""A rank class simulated at a few small counts and extrapolated to its own (``pretrain.py --simulate``).

A full-size step costs its op count on fake tensors, and a step is microbatches x layers x ~300 ops: GPT-3
13B's stage of 20 layers at 128 microbatches takes minutes. Its figures are, however, affine in the counts
(microbatches, layers of each kind, routed experts per ep rank: ``megazero.plan.axes`` says why and picks the
counts), so a few small steps give them exactly.

So each axis is simulated at three counts, plus one point per pair of axes, and every figure (the peak,
its split by category, the model states, the host bytes, the build's peak, the bytes sent per group) is
carried on the line through the two larger counts to the real one. Checked: the increment from the
first count to the second equals the one from the second to the third, to ``TOLERANCE`` of the peak once
carried to the real count, and the peak happens at the same moment of the step in every simulation; an
axis that fails is simulated at its real count instead (every layer, or every microbatch), and says so.

What the check cannot see: the peak is the largest of the step's moments, each affine in the counts, and
the line is that of the moment seen. Another moment whose memory grows faster per layer (one where more
microbatches hold their activations, as at the start of a backward beside its end) could overtake it past
the counts simulated; the extrapolated peak is then low, by at most the layers added times the
activations of a layer in the microbatches not alive at the moment seen (2·sbh/t a microbatch with
checkpointing: 5 MB at GPT-3 13B's tp 4). ``--simulate full`` simulates every layer and microbatch.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from megazero.config.schema import Config
from megazero.plan.axes import Axis, choose_axes, rank_chunks, variant
from megazero.plan.simulate import RankResult, planned, simulate_rank

TOLERANCE = 1e-3  # of the peak: how far the two increments of an axis may disagree, times the counts added


def design(axes: list[Axis]) -> list[tuple[int, ...]]:
    """The points simulated: the smallest, two more counts along each axis, one more along each pair."""
    k = len(axes)
    unit = [tuple(int(i == j) for j in range(k)) for i in range(k)]
    points = [(0,) * k] + [tuple(2 * u for u in e) for e in unit] + unit
    points += [tuple(a + b for a, b in zip(unit[i], unit[j])) for i, j in itertools.combinations(range(k), 2)]
    return sorted(set(points))


def figures(r: RankResult) -> dict[str, float]:
    """A result's figures, flat: the ones extrapolated."""
    out = {"peak_bytes": r.peak_bytes, "host_bytes": r.host_bytes, "build_peak_bytes": r.build_peak_bytes}
    for group in ("bytes", "state_bytes", "comm_bytes"):
        out.update({f"{group}.{k}": v for k, v in getattr(r, group).items()})
    return out


@dataclass
class Fit:
    values: dict[str, float]  # each figure at the real counts
    deviation: list[float]  # per axis: its two increments' difference times the steps added, over the peak
    worst: list[str]  # per axis: the figure whose increments differ most


def fit(points: dict[tuple[int, ...], dict[str, float]], axes: list[Axis]) -> Fit:
    """Each figure at the real counts: on each axis the line through its two larger counts (x = 1 and 2),
    plus each pair's cross term (x = 1 on both less each alone) times both steps; and how far each axis' two
    increments (0 to 1, 1 to 2) disagree, carried to the real count, as a fraction of the peak there (of the
    figure itself for the bytes sent)."""
    k = len(axes)
    zero = (0,) * k
    unit = [tuple(int(i == j) for j in range(k)) for i in range(k)]
    names = sorted(set().union(*points.values()))
    values, increments = {}, {}
    for name in names:
        f = {x: figs.get(name, 0) for x, figs in points.items()}
        v = f[zero]
        for i, (a, e) in enumerate(zip(axes, unit)):
            d1, d2 = f[e] - f[zero], f[tuple(2 * u for u in e)] - f[e]
            d2 = d2 if a.two == 2 else d2 / (a.two - 1)  # per step: x = 2 is a.two steps from x = 0
            increments[name, i] = (d1, d2)
            v += d1 + (a.real - 1) * d2
        for i, j in itertools.combinations(range(k), 2):
            both = tuple(a + b for a, b in zip(unit[i], unit[j]))
            v += axes[i].real * axes[j].real * (f[both] - f[unit[i]] - f[unit[j]] + f[zero])
        values[name] = v if isinstance(points[zero].get(name, 0), float) else int(round(v))
    deviation, worst = [0.0] * k, ["peak_bytes"] * k
    for (name, i), (d1, d2) in increments.items():
        scale = max(abs(values[name]) if name.startswith("comm_bytes.") else values["peak_bytes"], 1)
        if axes[i].real * abs(d2 - d1) / scale > deviation[i]:
            deviation[i], worst[i] = axes[i].real * abs(d2 - d1) / scale, name
    return Fit(values, deviation, worst)


def simulate_class(cfg: Config, rank: int, plan, say: Callable[[str], None] = print,
                   progress: Optional[Callable[[str], None]] = None) -> RankResult:
    """One rank class's figures, extrapolated on each axis worth it that passes its check, the others at their
    real counts (all of it, when no axis is left). ``say`` hears why an axis was not extrapolated; ``progress``
    a line before each simulation, so a long one is seen working (the issue's 138 s of silence)."""
    start = time.perf_counter()
    axes, chunks = choose_axes(cfg, rank), rank_chunks(cfg, rank)
    tell = progress or (lambda text: None)
    steps = None if progress is None else (lambda text: progress(f"    rank {rank}: {text}"))
    while axes:
        runs, points = {}, design(axes)
        for n, x in enumerate(points, 1):
            counts = ", ".join(f"{a.count(xi)} {a.label(cfg, chunks)}" for a, xi in zip(axes, x))
            tell(f"  rank {rank}: simulation {n} of {len(points)} ({counts}) after {time.perf_counter() - start:.0f} s")
            runs[x] = simulate_rank(variant(cfg, chunks, axes, x), rank, plan, steps)
        f = fit({x: figures(r) for x, r in runs.items()}, axes)
        base = runs[(0,) * len(axes)]
        moved = {i for x, r in runs.items() if r.moment != base.moment for i, xi in enumerate(x) if xi}
        failed = [i for i in range(len(axes)) if f.deviation[i] > TOLERANCE or i in moved]
        if not failed:
            return _result(cfg, plan, runs, axes, chunks, f, time.perf_counter() - start)
        for i in failed:
            a = axes[i]
            why = (f"its two increments differ by {f.deviation[i]:.3%} of the peak at that count ({f.worst[i]}; "
                   f"tolerance {TOLERANCE:.1%})" if f.deviation[i] > TOLERANCE else
                   "the peak moves to another moment of the step")
            say(f"extrapolation, rank {rank}: {a.label(cfg, chunks)} simulated at the run's {a.count(a.real)}: {why}")
        axes = [a for i, a in enumerate(axes) if i not in failed]
    tell(f"  rank {rank}: simulating every layer and microbatch after {time.perf_counter() - start:.0f} s")
    return replace(simulate_rank(cfg, rank, plan, steps), seconds=time.perf_counter() - start)


def _result(cfg: Config, plan, runs: dict, axes: list[Axis], chunks: list[int], f: Fit,
            seconds: float) -> RankResult:
    base = runs[(0,) * len(axes)]
    v = f.values

    def group(name: str) -> dict:
        return {k.split(".", 1)[1]: x for k, x in v.items() if k.startswith(name + ".")}

    parts = [f"{a.count(0)}, {a.count(1)} and {a.count(2)} {a.label(cfg, chunks)} to {a.count(a.real)}"
             for a in axes]
    note = (f"extrapolated linearly from {' and from '.join(parts)} ({len(runs)} simulations); each increment "
            f"constant to {max(f.deviation):.3%} of the peak")
    return RankResult(base.rank, base.pp_rank, int(v["peak_bytes"]), group("bytes"), base.moment, int(v["host_bytes"]),
                      group("state_bytes"), group("comm_bytes"), planned(cfg, plan.stages[base.pp_rank]), seconds,
                      int(v["build_peak_bytes"]), extrapolated=note)
