"""Graceful stops: SIGTERM, SIGINT and SIGUSR1 end a run at a step boundary, after a checkpoint.

A cluster preempts a job with SIGTERM (torchrun passes it to every worker; Slurm's ``--signal=USR1@T``
warns T seconds ahead), and a person stops one with Ctrl-C. Either way the steps since the last save
should not be lost: the handler only notes the signal, the training loop finishes the step it is in,
every rank agrees to stop at the same step (the flag rides on the step's own all-reduce), saves and
exits with :data:`exit_code`, 128 + the signal's number, as a shell reports a process a signal ended.
A second signal while the first is being served stops at once (:class:`Interrupted`), without a save.
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

    def __init__(self, signum: int):
        super().__init__(f"{signal_name(signum)} received twice; stopped without saving")
        self.signum = signum


class StopSignals:
    """Notes the first stop signal for the training loop to act on; a context manager that restores the
    handlers it replaced. Outside the main thread (where Python delivers signals) it installs nothing."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, _Handler] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is not None:
            raise Interrupted(signum)
        self.received = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
