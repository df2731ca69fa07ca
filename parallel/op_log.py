"""The last operations a rank issued, kept for a hang's diagnosis (``megazero.hang``).

Every collective and point-to-point transfer a :class:`parallel.comm.Comm` issues leaves one entry: its number
on its group (every member of a group issues the group's collectives in the same order, so the numbers line up
across ranks), kind, group and members (global ranks), tag, bytes, the peer of a send or receive, the step and
pipeline action it was issued in, and its state: ``posted`` (a blocking call not returned yet: what a rank hangs
in), ``completed``, or ``async`` (its wait is the caller's). Bounded: the last ``size`` entries and one counter
per group, whatever the run's length.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

KEPT = 64  # entries: a few steps' worth of a small layout, the current step's tail of a large one


class OpLog:
    def __init__(self, size: int = KEPT):
        self.entries: deque = deque(maxlen=size)
        self.seqs: dict[tuple, int] = {}  # (group name, members) -> operations issued on it
        self.step = 0  # the step being run (set by the trainer)
        self.action = ""  # the pipeline action being run (set by the executor)

    def post(self, kind: str, group: str, members: tuple, tag: str, nbytes: int, peer: Optional[int] = None,
             blocking: bool = True) -> dict:
        """Note an operation as it is issued; a blocking one's caller marks it ``completed`` when it returns."""
        key = (group, members)
        seq = self.seqs[key] = self.seqs.get(key, 0) + 1
        entry = {"seq": seq, "kind": kind, "group": group, "members": list(members), "tag": tag, "bytes": nbytes,
                 "peer": peer, "state": "posted" if blocking else "async", "step": self.step,
                 "action": self.action}
        self.entries.append(entry)
        return entry

    def record(self) -> list[dict]:
        return [dict(e) for e in self.entries]
