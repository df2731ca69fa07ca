"""Pipeline schedules as pure functions: for every rank, the ordered list of what it does.

A schedule knows nothing of tensors or processes. It returns, per pipeline
rank, a list of :class:`Action` — forward or backward of microbatch ``mb`` of
model chunk ``chunk``, and the sends and receives around them — that one
executor (``parallel.pipeline``) runs. Model chunk ``c`` on rank ``r`` is
virtual stage ``c * pp + r`` (Narayanan et al. 2021, §2.2), so with one chunk
per rank the virtual stage is the rank.

Consecutive send/receive actions form one batch that the executor posts at
once (``batch_isend_irecv``), the way Megatron pairs ``send_forward`` with
``recv_backward``: :func:`check_deadlock_free` proves, for a given schedule,
that every batch completes even when a send cannot finish before its receive
is posted.

Schedules:

- ``gpipe`` (Huang et al. 2019): all forwards, then all backwards; m
  microbatches in flight.
- ``1f1b`` (Narayanan et al. 2021, PipeDream-Flush): rank r runs
  ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and one
  backward, then drains the backwards; at most ``min(pp - r, m)`` in flight.
  Bubble (pp - 1) / (m + pp - 1) of the step.
- ``interleaved``: v chunks per rank, 1F1B over virtual microbatches in
  Megatron's order (m must be a multiple of pp); the bubble shrinks by ~v.
- ``zb1p`` (ZB-H1, Qi et al. 2023, §3.1): 1F1B with each backward split in
  two: ``B``, the input gradient the previous stage waits for, and ``W``, the
  weight gradient nobody waits for. Rank r runs W(i - r) right after B(i) and
  the r W's it still owes at the end, so the deferred weight gradients fill
  the cooldown's idle time. With equal F, B and W costs the bubble is
  (p - 1)(F + B - W), a third of 1F1B's (p - 1)(F + B + W), and at most p
  microbatches are held on any rank (forwarded, weight gradient not yet
  taken), as in 1F1B's first stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p")
COMPUTE = ("F", "B", "W")
COMM = ("send_f", "recv_f", "send_b", "recv_b")


@dataclass(frozen=True)
class Action:
    kind: str  # F | B | W | send_f | recv_f | send_b | recv_b
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def stage_of(vs: int, pp: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage vs."""
    return vs % pp, vs // pp


def schedule_constraint(name: str, pp: int, m: int, v: int) -> str | None:
    """Why (name, pp, m, v) is not a valid schedule, or None."""
    if name not in SCHEDULES:
        return f"unknown schedule {name!r}; valid: {' | '.join(SCHEDULES)}"
    if name == "interleaved":
        if pp < 2 or v < 2:
            return "interleaved needs parallel.pp >= 2 and parallel.virtual_stages >= 2"
        if m % pp:
            return f"interleaved needs the microbatches per rank ({m}) to be a multiple of parallel.pp ({pp})"
    elif v != 1:
        return f"{name} runs one model chunk per rank: parallel.virtual_stages must be 1 (got {v})"
    return None


def _interleaved_warmup(pp: int, rank: int, m: int, v: int) -> int:
    """Forwards before the first backward (Megatron-LM): all of them when m == pp."""
    total = m * v
    return total if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)


def _compute_order(name: str, pp: int, rank: int, m: int, v: int) -> list[tuple[str, int, int]]:
    if name == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if name in ("1f1b", "zb1p"):
        warmup = min(pp - rank - 1, m)
        order = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - warmup, m)]
        return order if name == "1f1b" else _defer_weight_grads(order, rank, m)
    # interleaved: Megatron-LM's virtual-microbatch order
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

    warmup = _interleaved_warmup(pp, rank, m, v)
    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def _defer_weight_grads(order: list[tuple[str, int, int]], rank: int, m: int) -> list[tuple[str, int, int]]:
    """ZB-H1: W(i - rank) right after B(i), the rank's last W's at the end."""
    out = []
    for kind, mb, chunk in order:
        out.append((kind, mb, chunk))
        if kind == "B" and mb >= rank:
            out.append(("W", mb - rank, chunk))
    return out + [("W", i, 0) for i in range(max(m - rank, 0), m)]


def _with_comms(rank: int, pp: int, v: int, order: list[tuple[str, int, int]]) -> list[Action]:
    """Receives right before the compute that needs them, sends right after the one that produces them."""
    last = pp * v - 1
    actions: list[Action] = []
    for kind, mb, chunk in order:
        vs = virtual_stage(rank, chunk, pp)
        if kind == "F":
            actions += [Action("recv_f", mb, chunk)] if vs > 0 else []
            actions.append(Action("F", mb, chunk))
            actions += [Action("send_f", mb, chunk)] if vs < last else []
        elif kind == "W":
            actions.append(Action("W", mb, chunk))
        else:
            actions += [Action("recv_b", mb, chunk)] if vs < last else []
            actions.append(Action("B", mb, chunk))
            actions += [Action("send_b", mb, chunk)] if vs > 0 else []
    return actions


def _with_prefetched_comms(rank: int, pp: int, v: int, fwd: list[tuple[int, int]],
                           bwd: list[tuple[int, int]], warmup: int) -> list[Action]:
    """Megatron's interleaved pattern (Narayanan et al. 2021): each step's sends go out in one batch
    with the receives of the next forward and the next backward, so in the steady state a forward and
    a backward run back to back and then all four messages are exchanged at once."""
    last = pp * v - 1
    total = len(fwd)

    def recv_f(k: int) -> list[Action]:
        ok = k < total and virtual_stage(rank, fwd[k][1], pp) > 0
        return [Action("recv_f", *fwd[k])] if ok else []

    def recv_b(k: int) -> list[Action]:
        ok = k < total and virtual_stage(rank, bwd[k][1], pp) < last
        return [Action("recv_b", *bwd[k])] if ok else []

    def send_f(k: int) -> list[Action]:
        return [Action("send_f", *fwd[k])] if virtual_stage(rank, fwd[k][1], pp) < last else []

    def send_b(k: int) -> list[Action]:
        return [Action("send_b", *bwd[k])] if virtual_stage(rank, bwd[k][1], pp) > 0 else []

    steady = total - warmup
    actions = recv_f(0)
    for k in range(warmup):
        actions += [Action("F", *fwd[k])] + send_f(k) + recv_f(k + 1)
        if k == warmup - 1 and steady > 0:
            actions += recv_b(0)
    for i in range(steady):
        actions += [Action("F", *fwd[warmup + i]), Action("B", *bwd[i])]
        actions += send_f(warmup + i) + recv_f(warmup + i + 1) + send_b(i) + recv_b(i + 1)
    if steady == 0:
        actions += recv_b(0)
    for k in range(steady, total):
        actions += [Action("B", *bwd[k])] + send_b(k) + recv_b(k + 1)
    return actions


def build_schedule(name: str, pp: int, m: int, v: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """Per rank, the ordered actions of one step over m microbatches."""
    problem = schedule_constraint(name, pp, m, v)
    assert problem is None, problem
    out = []
    for rank in range(pp):
        order = _compute_order(name, pp, rank, m, v)
        if forward_only:
            out.append(_with_comms(rank, pp, v, [o for o in order if o[0] == "F"]))
        elif name == "interleaved":
            fwd = [(mb, c) for k, mb, c in order if k == "F"]
            bwd = [(mb, c) for k, mb, c in order if k == "B"]
            warmup = _interleaved_warmup(pp, rank, m, v)
            out.append(_with_prefetched_comms(rank, pp, v, fwd, bwd, warmup))
        else:
            out.append(_with_comms(rank, pp, v, order))
    return out


def peer(action: Action, rank: int, pp: int) -> tuple[int, int]:
    """(rank, chunk) on the other end of a send or receive."""
    vs = virtual_stage(rank, action.chunk, pp)
    other = vs + 1 if action.kind in ("send_f", "recv_b") else vs - 1
    return stage_of(other, pp)


def message(action: Action, rank: int, pp: int) -> tuple:
    """The identity of what a send/receive carries: (activation|grad, microbatch, from vs, to vs)."""
    vs = virtual_stage(rank, action.chunk, pp)
    return {"send_f": ("act", action.mb, vs, vs + 1), "recv_f": ("act", action.mb, vs - 1, vs),
            "send_b": ("grad", action.mb, vs, vs - 1), "recv_b": ("grad", action.mb, vs + 1, vs)}[action.kind]


def batches(actions: list[Action]) -> Iterator[tuple[str, list[Action]]]:
    """("compute", [a]) or ("comm", [consecutive sends/receives]) in order."""
    pending: list[Action] = []
    for a in actions:
        if a.kind in COMM:
            pending.append(a)
            continue
        if pending:
            yield "comm", pending
            pending = []
        yield "compute", [a]
    if pending:
        yield "comm", pending


def check_deadlock_free(sched: list[list[Action]], pp: int) -> None:
    """Run the schedule with rendezvous semantics; raise AssertionError on a deadlock or mismatch.

    A batch completes only when the peer has posted the matching operation
    (a send cannot finish before its receive exists, as with NCCL), and
    messages on each directed rank pair must be posted in the same order on
    both ends (p2p matches in order).
    """
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank, actions in enumerate(sched):
        for a in actions:
            if a.kind in COMM:
                other = peer(a, rank, pp)[0]
                key = (rank, other) if a.kind.startswith("send") else (other, rank)
                (sends if a.kind.startswith("send") else recvs).setdefault(key, []).append(message(a, rank, pp))
    assert sends.keys() == recvs.keys(), (sends.keys(), recvs.keys())
    for key in sends:
        assert sends[key] == recvs[key], f"channel {key}: sends {sends[key]} != receives {recvs[key]}"

    def end(a: Action, rank: int) -> tuple:  # ("send"|"recv", message): a send matches the receive
        return ("send" if a.kind.startswith("send") else "recv", message(a, rank, pp))

    def counterpart(a: Action, rank: int) -> tuple:
        return ("recv" if a.kind.startswith("send") else "send", message(a, rank, pp))

    programs = [list(batches(actions)) for actions in sched]
    pos = [0] * pp
    done: set = set()
    while True:
        progressed = False
        for rank in range(pp):
            if pos[rank] >= len(programs[rank]):
                continue
            kind, items = programs[rank][pos[rank]]
            if kind == "comm":
                posted = {end(a, r) for r in range(pp) if r != rank and pos[r] < len(programs[r])
                          and programs[r][pos[r]][0] == "comm" for a in programs[r][pos[r]][1]}
                if not all(counterpart(a, rank) in posted | done for a in items):
                    continue
                done.update(end(a, rank) for a in items)
            pos[rank] += 1
            progressed = True
        if all(pos[r] >= len(programs[r]) for r in range(pp)):
            return
        stuck = [programs[r][pos[r]] if pos[r] < len(programs[r]) else None for r in range(pp)]
        assert progressed, f"deadlock: ranks stuck at {stuck}"


def simulate(sched: list[list[Action]], pp: int, f_cost: float = 1.0, b_cost: float = 1.0,
             w_cost: float = 0.0) -> dict:
    """Discrete-event run with compute costs and free communication.

    Each rank runs its computes in order; a forward waits for the previous
    virtual stage's forward of the same microbatch, a backward for the next
    stage's backward (or its own forward on the last stage), a weight gradient
    for its own backward. ``b_cost`` is the input gradient and ``w_cost`` the
    weight gradient: a schedule without W actions runs both in its B. Returns
    the makespan, per-rank busy time and idle fraction, and the peak number of
    microbatches held per rank (forwarded, backward not yet complete: its W
    where the schedule has one).
    """
    v = 1 + max(a.chunk for actions in sched for a in actions)
    last = pp * v - 1
    split = any(a.kind == "W" for actions in sched for a in actions)
    cost = {"F": f_cost, "B": b_cost if split else b_cost + w_cost, "W": w_cost}
    ends = "W" if split else "B"  # the action that releases a microbatch's activations
    finish: dict[tuple, float] = {}
    clock = [0.0] * pp
    queues = [[a for a in actions if a.kind in COMPUTE] for actions in sched]
    pos = [0] * pp
    busy = [0.0] * pp
    in_flight, peak = [0] * pp, [0] * pp
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] >= len(queues[r]):
                continue
            a = queues[r][pos[r]]
            vs = virtual_stage(r, a.chunk, pp)
            if a.kind == "F":
                deps = [("F", a.mb, vs - 1)] if vs > 0 else []
            elif a.kind == "B":
                deps = [("F", a.mb, vs)] + ([("B", a.mb, vs + 1)] if vs < last else [])
            else:
                deps = [("B", a.mb, vs)]
            if any(d not in finish for d in deps):
                continue
            took = cost[a.kind] / v
            start = max([clock[r]] + [finish[d] for d in deps])
            finish[(a.kind, a.mb, vs)] = clock[r] = start + took
            busy[r] += took
            in_flight[r] += 1 if a.kind == "F" else -1 if a.kind == ends else 0
            peak[r] = max(peak[r], in_flight[r])
            pos[r] += 1
            remaining -= 1
            progressed = True
        assert progressed, "dependency deadlock"
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy, "idle_fraction": [1 - b / makespan for b in busy],
            "peak_in_flight": peak}
