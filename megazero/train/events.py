"""A TensorBoard event file written in the caller's thread, so a write the disk refuses is an error where it
happens.

torch's SummaryWriter writes from a thread of its own: a full disk there prints that thread's traceback,
and the error comes back later, from whatever call touches the writer next. This file frames the same
records (tensorboard's RecordWriter: length, CRCs, a serialized Event) and flushes once per logged step, as
metrics.jsonl does. A resume hides the events a crashed run wrote past its checkpoint the way SummaryWriter's
``purge_step`` does: a session-start event at that step.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Optional

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

PREFIX = "events.out.tfevents."
FILE_VERSION = "brain.Event:2"


class EventFile:
    """``log_dir/events.out.tfevents.<time>.<host>.<pid>.<n>``, a new file (``n`` makes the name unique).

    Raises OSError where the disk refuses a write; a file that could not even be started is removed."""

    def __init__(self, log_dir: str | Path, purge_step: Optional[int] = None):
        base = f"{PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        n = 0
        while True:
            self.path = Path(log_dir) / f"{base}.{n}"
            try:
                self._file = open(self.path, "xb")
                break
            except FileExistsError:
                n += 1
        self._records = RecordWriter(self._file)
        try:
            self._write(Event(wall_time=time.time(), file_version=FILE_VERSION))
            if purge_step is not None:
                self._write(Event(wall_time=time.time(), step=purge_step, file_version=FILE_VERSION))
                self._write(Event(wall_time=time.time(), step=purge_step,
                                  session_log=SessionLog(status=SessionLog.START)))
            self._file.flush()
        except BaseException:
            self.close(quiet=True)
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise

    def _write(self, event: Event) -> None:
        self._records.write(event.SerializeToString())

    def add_scalars(self, step: int, values: dict[str, float]) -> None:
        """One event per tag, at ``step``, then flushed."""
        now = time.time()
        for tag, value in values.items():
            self._write(Event(wall_time=now, step=step,
                              summary=Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])))
        self._file.flush()

    def close(self, quiet: bool = False) -> None:
        """Close the file (its fd is released even when the last flush fails); ``quiet``: after a failure
        already reported, a second one is not raised."""
        try:
            self._file.close()
        except OSError:
            if not quiet:
                raise
