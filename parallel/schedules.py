"""Pipeline schedules as pure functions: for every rank, the ordered list of what it does.

A schedule knows nothing of tensors or processes. It returns, per pipeline
rank, a list of :class:`Action` — forward or backward of microbatch ``mb`` of
model chunk ``chunk``, and the sends and receives around them — that one
executor (``parallel.pipeline``) runs. Model chunk ``c`` on rank ``r`` is
virtual stage ``c * pp + r`` (Narayanan et al. 2021, §2.2), so with one chunk
per rank the virtual stage is the rank.

Consecutive send/receive actions form one batch that the executor posts at
once (``batch_isend_irecv``), the way Megatron pairs ``send_forward`` with
``recv_backward``: ``parallel.schedule_analysis.check_deadlock_free`` proves,
for a given schedule, that every batch completes even when a send cannot
finish before its receive is posted. With ``overlap_p2p`` a batch is posted
early and waited at first use (:func:`events`), which the checker models too.

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


def _with_overlapped_comms(rank: int, pp: int, order: list[tuple[str, int, int]]) -> list[Action]:
    """One model chunk per rank, p2p overlapped with compute (Megatron's ``overlap_p2p_comm`` pattern): a
    forward's send goes out with the receive of the next forward, a backward's with the receive of the next
    backward, so each receive is in flight during the compute of the other kind before it. The receive of a
    compute not yet posted that way (the first backward) goes out right before it."""
    first, last = rank == 0, rank == pp - 1
    computes = [(k, mb) for k, mb, _ in order if k in ("F", "B")]
    fwd = [mb for k, mb in computes if k == "F"]
    bwd = [mb for k, mb in computes if k == "B"]
    nxt = {"F": 0, "B": 0}  # per kind: receives posted so far

    def recv(kind: str) -> list[Action]:
        mbs = fwd if kind == "F" else bwd
        if nxt[kind] >= len(mbs):
            return []
        nxt[kind] += 1
        needed = not first if kind == "F" else not last
        return [Action("recv_f" if kind == "F" else "recv_b", mbs[nxt[kind] - 1])] if needed else []

    actions = recv("F")
    done = 0
    early: list[Action] = []  # receives posted ahead: each rides with the next batch that sends
    for kind, mb, chunk in order:
        actions.append(Action(kind, mb, chunk))
        if kind == "W":
            continue
        done += 1
        batch = [Action("send_f", mb)] if kind == "F" and not last else []
        batch += [Action("send_b", mb)] if kind == "B" and not first else []
        if kind == "F":
            early += recv("F")
        if batch:
            batch, early = batch + early, []
        if done < len(computes):  # the next compute's receive must be posted now
            k2, mb2 = computes[done]
            wanted = "recv_f" if k2 == "F" else "recv_b"
            if nxt[k2] <= (fwd if k2 == "F" else bwd).index(mb2):
                early += recv(k2)
            if any(a.kind == wanted and a.mb == mb2 for a in early):
                batch, early = batch + early, []
        actions += batch
    return actions + early


def build_schedule(name: str, pp: int, m: int, v: int = 1, forward_only: bool = False,
                   overlap_p2p: bool = False) -> list[list[Action]]:
    """Per rank, the ordered actions of one step over m microbatches. ``overlap_p2p``: receives are posted
    ahead of the compute before the one that reads them (interleaved always posts ahead)."""
    problem = schedule_constraint(name, pp, m, v)
    assert problem is None, problem
    return [rank_schedule(name, pp, rank, m, v, forward_only, overlap_p2p) for rank in range(pp)]


def rank_schedule(name: str, pp: int, rank: int, m: int, v: int = 1, forward_only: bool = False,
                  overlap_p2p: bool = False) -> list[Action]:
    """One rank's actions of :func:`build_schedule` (a rank's simulation lists its own only)."""
    order = _compute_order(name, pp, rank, m, v)
    if forward_only:
        return _with_comms(rank, pp, v, [o for o in order if o[0] == "F"])
    if overlap_p2p and v == 1:
        return _with_overlapped_comms(rank, pp, order)
    if name == "interleaved":
        fwd = [(mb, c) for k, mb, c in order if k == "F"]
        bwd = [(mb, c) for k, mb, c in order if k == "B"]
        return _with_prefetched_comms(rank, pp, v, fwd, bwd, _interleaved_warmup(pp, rank, m, v))
    return _with_comms(rank, pp, v, order)


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


def events(actions: list[Action], overlap_p2p: bool = False) -> list[tuple]:
    """How an executor runs a rank's actions: ("post", i, batch), ("wait", i), ("compute", action).

    Each batch of sends and receives is posted as one group (``batch_isend_irecv``). Without overlap it is
    waited in place. With it, a batch is waited just before the first compute that reads one of its
    receives; a batch of sends only before the next batch is posted (so at most one is outstanding), and
    whatever is left at the end."""
    out: list[tuple] = []
    waiting: dict[tuple, int] = {}  # (kind, mb, chunk) of a compute -> the batch holding its receive
    sends_only: list[int] = []
    unwaited: list[int] = []
    for i, (kind, items) in enumerate(batches(actions)):
        if kind == "compute":
            a = items[0]
            need = waiting.pop((a.kind, a.mb, a.chunk), None)
            if need is not None and need in unwaited:
                out.append(("wait", need))
                unwaited.remove(need)
            out.append(("compute", a))
            continue
        if not overlap_p2p:
            out += [("post", i, items), ("wait", i)]
            continue
        for j in sends_only:
            if j in unwaited:
                out.append(("wait", j))
                unwaited.remove(j)
        out.append(("post", i, items))
        unwaited.append(i)
        recvs = [a for a in items if a.kind.startswith("recv")]
        for a in recvs:
            waiting[("F" if a.kind == "recv_f" else "B", a.mb, a.chunk)] = i
        sends_only = [] if recvs else [i]
    out += [("wait", j) for j in unwaited]
    return out
