"""Where one rank's pipeline schedule becomes periodic: the fewest microbatches a simulation of that rank needs.

``activations.peak_microbatches`` bounds every rank of a schedule at once (2pp + 2 for 1F1B and zb1p, 4pp
interleaved): the plan walks all ranks together. A simulation runs one rank's action list only (the fake
process group couples no ranks), and that list turns periodic much sooner. 1F1B rank r runs pp - r - 1
warm-up forwards and then forward-backward pairs; zb1p adds a W after each backward from its r-th on, so each
of its ranks repeats (F, B, W) once pp microbatches have started. Past that point one more microbatch inserts
one more period into the steady state and changes nothing else: the same actions before it, the same
cool-down after it, the first and the last microbatch where they were.

This module finds that point from the schedule itself (``parallel.schedules``), not from a formula: each
action is reduced to what decides its memory (its kind and chunk, whether it is the step's first or last
microbatch, which make the gradient reductions fire, and how many microbatches each chunk holds after it
at each stage of their life), and ``m + step`` microbatches must equal ``m`` with one block inserted that
repeats the block before it, for every count from the one returned to the run's. The memory at each action
is then the same as at the action it repeats, and every figure is affine in the count (the token ids of the
step, the sends): ``megazero.plan.extrapolate`` checks that on three counts and carries it.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from megazero.parallel.schedules import Action, rank_schedule, schedule_constraint

_HELD = (("recv_f", "F"), ("F", "B"), ("B", "W"), ("recv_b", "B"))  # (opens, closes): what a microbatch holds


def signature(actions: list[Action], m: int, split_backward: bool) -> list[tuple]:
    """Each action as what decides its memory: (kind, chunk, first microbatch, last microbatch) and, per chunk,
    the microbatches received but not run forward, run forward but not backward, run backward with their
    weight gradient still owed (zb1p), and with an output gradient received but not run backward."""
    opened: Counter = Counter()
    chunks = sorted({a.chunk for a in actions})
    present = {(a.kind, a.chunk) for a in actions}  # the first stage receives no input, the last no gradient
    pairs = [(i, c) for c in chunks for i, (opens, closes) in enumerate(_HELD)
             if (opens, c) in present and (closes != "W" or split_backward)]
    out = []
    for a in actions:
        for i, c in pairs:
            if c == a.chunk:
                opened[i, c] += (a.kind == _HELD[i][0]) - (a.kind == _HELD[i][1])
        held = tuple(opened[pair] for pair in pairs)
        out.append((a.kind, a.chunk, a.mb == 0, a.mb == m - 1, held))
    return out


def repeats_a_period(shorter: list[tuple], longer: list[tuple]) -> bool:
    """``longer`` is ``shorter`` with one block inserted right after an equal block (one more period)."""
    n, extra = len(shorter), len(longer) - len(shorter)
    if extra <= 0:
        return False
    prefix = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), n)
    suffix = next((i for i, (a, b) in enumerate(zip(reversed(shorter), reversed(longer))) if a != b), n)
    for p in range(max(n - suffix, extra), min(prefix, n) + 1):  # where the block may go: after p actions
        if longer[p:p + extra] == shorter[p - extra:p]:
            return True
    return False


def periodic_microbatches(schedule: str, pp: int, rank: int, m: int, v: int = 1, overlap_p2p: bool = False,
                          step: int = 1) -> Optional[int]:
    """The fewest microbatches (``m`` less a multiple of ``step``) from which every ``step`` more, up to ``m``,
    only repeat the steady state of pipeline rank ``rank``'s schedule (see the module); None when even ``m -
    step`` does not (GPipe: every microbatch is held at once)."""
    if schedule == "gpipe" or m <= step:
        return None

    def actions(n: int) -> Optional[list[tuple]]:
        if schedule_constraint(schedule, pp, n, v) is not None:
            return None
        listed = rank_schedule(schedule, pp, rank, n, v, overlap_p2p=overlap_p2p)
        return signature(listed, n, schedule == "zb1p")

    found, longer = None, actions(m)
    for n in range(m - step, 0, -step):  # down from the run's count while each step repeats a period
        shorter = actions(n)
        if shorter is None or longer is None or not repeats_a_period(shorter, longer):
            break
        found, longer = n, shorter
    return found
