"""A rank's compute time in a step: the step's time less what it spent waiting on communication.

What a straggler detector compares across ranks (``megazero.train.stragglers``): a slow rank's peers wait for
it, so their step times match its own; only the time outside the waits tells them apart. Every blocking
collective and every wait of an asynchronous one goes through :class:`parallel.comm.Comm` (its works come back
as :class:`TimedWork`), which marks the wait here. On the CPU (gloo) the host blocks: the host clock around
each wait. On CUDA the host does not block (the stream does): events on the current stream around the same
points measure how long the stream waited, only on the steps the trainer measures (the logged ones), read
after their host synchronisation.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from megazero.parallel.compile_fence import host_only


class StepClock:
    def __init__(self) -> None:
        self.on = False
        self.cuda = False
        self.started: Any = None  # perf_counter() or the step's first event
        self.waited = 0.0  # seconds (CPU)
        self.pairs: list = []  # (event before, event after) per wait (CUDA); cleared every step

    def begin(self, device: torch.device, on: bool) -> None:
        """Start a step; ``on``: measure it."""
        self.on, self.cuda, self.waited = on, device.type == "cuda", 0.0
        self.pairs.clear()
        if on:
            self.started = self._now()

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @host_only  # host bookkeeping around a collective: not traced
    def mark(self) -> Any:
        """Before a wait: its start (None when the step is not measured)."""
        return self._now() if self.on else None

    @host_only
    def waited_since(self, mark: Any) -> None:
        if mark is None or not self.on:
            return
        if self.cuda:
            self.pairs.append((mark, self._now()))
        else:
            self.waited += time.perf_counter() - mark

    def end(self) -> Optional[float]:
        """The step's compute seconds (its time less its waits), or None when it was not measured. On CUDA this
        waits for the step's last event: call it where the host waits for the step anyway."""
        if not self.on:
            return None
        self.on = False
        if self.cuda:
            last = self._now()
            last.synchronize()
            total = self.started.elapsed_time(last) / 1e3
            waited = sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        else:
            total, waited = time.perf_counter() - self.started, self.waited
        self.pairs.clear()
        return max(0.0, total - waited)


class TimedWork:
    """An asynchronous collective's work handle whose ``wait`` counts as waiting; the rest is the work's."""

    __slots__ = ("work", "clock")

    def __init__(self, work: Any, clock: StepClock):
        self.work, self.clock = work, clock

    @host_only
    def wait(self, *args: Any, **kwargs: Any) -> Any:
        mark = self.clock.mark()
        out = self.work.wait(*args, **kwargs)
        self.clock.waited_since(mark)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)
