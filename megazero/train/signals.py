"""Graceful stops: SIGTERM, SIGINT and SIGUSR1 end a run at a step boundary, after a checkpoint.

A cluster preempts a job with SIGTERM (torchrun passes it to every worker; Slurm's ``--signal=USR1@T``
warns T seconds ahead), and a person stops one with Ctrl-C. Either way the steps since the last save
should not be lost: the handler only notes the signal, the training loop finishes the step it is in,
every rank agrees to stop at the same step (the flag rides on the step's own all-reduce), saves and
exits with :data:`exit_code`, 128 + the signal's number, as a shell reports a process a signal ended.
A second signal while the first is being served stops at once (:class:`Interrupted`), without a save.

Before the loop begins (the data prepared, which can take many minutes on a large corpus; the model built; a
checkpoint loaded) there is nothing to save: a stop signal then ends the run at once (:class:`StoppedEarly`).
The loop calls :meth:`StopSignals.defer` before it changes anything in log.dir; from then on signals wait
for a step boundary.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Callable, Optional, Union

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_Handler = Union[Callable[[int, Optional[FrameType]], object], int, None]


def exit_code(signum: int) -> int:
    """What a shell reports for a process the signal ended: 130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(BaseException):
    """A second stop signal: the run ends now, not at the next step boundary, and saves nothing.

    A BaseException, as KeyboardInterrupt is: no ``except Exception`` on the way out may take it for an
    ordinary failure (a checkpoint write it happened to interrupt, say)."""

    def __init__(self, signum: int, message: str = "received twice; stopped without saving"):
        super().__init__(f"{signal_name(signum)} {message}")
        self.signum = signum


class StoppedEarly(Interrupted):
    """A stop signal before the first step: nothing is saved because nothing was trained; the run ends now."""

    def __init__(self, signum: int):
        super().__init__(signum, "received before the first step (while the data, the model or the checkpoint to "
                                 "resume were being prepared); stopped at once, nothing to save")


class StopSignals:
    """Ends the run at once on a stop signal until :meth:`defer` is called, then notes the first one for the
    training loop to act on; a context manager that restores the handlers it replaced. Outside the main
    thread (where Python delivers signals) it installs nothing."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.deferring = False
        self._previous: dict[int, _Handler] = {}

    def defer(self) -> None:
        """From now on a stop waits for the end of the step (the training loop is about to begin)."""
        self.deferring = True

    @property
    def stopped_early(self) -> bool:
        """A signal came before the loop began: whatever failed after it (a collective whose peer stopped first,
        say) failed because of it."""
        return self.received is not None and not self.deferring

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is not None:
            raise Interrupted(signum)
        self.received = signum
        if not self.deferring:
            raise StoppedEarly(signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
