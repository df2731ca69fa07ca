"""What a schedule does when run: whether it can deadlock, and how long it takes with given costs.

Both take the per-rank action lists of ``parallel.schedules`` and model the
executor (``parallel.pipeline``) without tensors or processes.
"""
from __future__ import annotations

from megazero.parallel.schedules import COMM, COMPUTE, Action, events, message, peer, virtual_stage


def check_deadlock_free(sched: list[list[Action]], pp: int, overlap_p2p: bool = False) -> None:
    """Run the schedule as the executor would (:func:`~parallel.schedules.events`); raise AssertionError on
    a deadlock or a mismatch.

    Messages on each directed rank pair must be posted in the same order on both ends (p2p matches in
    order). Each batch is one group (``batch_isend_irecv``), and a rank's groups run in the order it posted
    them, whatever their peers: NCCL runs a process group's batched transfers on one stream (torch picks the
    group's communicator for them, as for a collective). A group starts once every group its rank posted
    before it has completed, and completes once the group holding each of its counterparts has started: a
    send cannot finish before its receive is running. A wait blocks its rank until the group completes.
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

    programs = [events(actions, overlap_p2p) for actions in sched]
    pos = [0] * pp
    queues: list[list] = [[] for _ in range(pp)]  # per rank: its groups in posting order, [counterparts, done]
    by_id: list[dict] = [{} for _ in range(pp)]  # per rank: batch id -> its group
    where: dict[tuple, tuple[int, int]] = {}  # an end -> (rank, index of its group in that rank's queue)
    while True:
        progressed = False
        for rank in range(pp):
            while pos[rank] < len(programs[rank]):
                ev = programs[rank][pos[rank]]
                if ev[0] == "post":
                    for a in ev[2]:
                        where[end(a, rank)] = (rank, len(queues[rank]))
                    group = [[counterpart(a, rank) for a in ev[2]], False]
                    queues[rank].append(group)
                    by_id[rank][ev[1]] = group
                elif ev[0] == "wait" and not by_id[rank][ev[1]][1]:
                    break
                pos[rank] += 1
                progressed = True

        def started(r: int, k: int) -> bool:
            return all(g[1] for g in queues[r][:k])

        for rank in range(pp):
            for k, g in enumerate(queues[rank]):
                if g[1]:
                    continue
                if not started(rank, k) or not all(c in where and started(*where[c]) for c in g[0]):
                    break
                g[1] = progressed = True
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
