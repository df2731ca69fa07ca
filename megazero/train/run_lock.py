"""One run per log.dir: the writing rank holds an exclusive lock on ``log.dir/run.lock`` for the life of the run.

Two runs writing one folder destroy each other (one's save deletes the other's step_N.tmp, a fresh run
truncates the other's metrics and deletes its TensorBoard files), so a run takes the lock after its process
group starts and before it looks for a checkpoint in the folder or changes anything there, and a second run
is refused in one line naming the holder's pid and host, which the holder writes into the file.

The lock is ``flock``: the kernel drops it when the holding process ends, however it ends, so a file left
behind by a killed run blocks nothing; the file is never deleted (deleting a lock file lets two runs lock two
different files of one name). ``flock`` locks an open file, not a process: a second open in the same process
is refused as well, and closing some other descriptor of the file does not release it; Linux's NFS client
maps it onto NFS byte-range locks, so runs on different nodes exclude each other through a shared folder.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.parallel.topology import Grid, coords_to_rank

LOCK_NAME = "run.lock"
_HOLDER_WAIT_S = 1.0  # how long a refused run waits for a holder that has just locked to write its name


def writer_rank(grid: Grid) -> int:
    """The rank that writes the run's logs and commits its checkpoints: the last stage's first rank (it holds
    the loss)."""
    return coords_to_rank(grid.pp - 1, 0, 0, grid.tp, grid.dp, 0, grid.cp)


class RunLock:
    """The held lock: an open descriptor of ``log.dir/run.lock`` under ``flock(LOCK_EX)``."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        """Empty the file (no holder named in it) and drop the lock."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = -1


def take_lock(cfg: Config) -> Optional[RunLock]:
    """Lock log.dir for this process, or raise the one-line refusal naming the holder. None (with a warning on
    stdout) where the file system supports no locks: the run goes on unguarded rather than not at all."""
    folder = Path(cfg.log.dir)
    path = folder / LOCK_NAME
    try:  # O_NOFOLLOW: a link planted under the name is refused, never followed out of log.dir
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r}: cannot open its lock file {path} ({e.strerror}); "
                        f"it must be a plain file megazero may write (move it away) or choose another log.dir") \
            from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} holds {LOCK_NAME}, which is not a plain file; "
                            f"move it away or choose another log.dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} is in use by another run ({_holder(fd)}, "
                            f"holding {path}); wait for it to end, stop it, or choose another log.dir") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            print(f"warning: {path}: this file system cannot lock files ({e.strerror}); a second run started on "
                  f"log.dir={cfg.log.dir!r} would not be refused", flush=True)
            os.close(fd)
            return None
        _name_holder(fd)
    except OSError as e:  # a full disk, say: one line on every rank, not a traceback on one and a hang elsewhere
        os.close(fd)
        raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r}: cannot lock or write {path} ({e.strerror})") \
            from None
    except BaseException:
        os.close(fd)
        raise
    return RunLock(fd, path)


def _name_holder(fd: int) -> None:
    """Write this process's pid and host into the held lock file. A full disk leaves the lock held and the file
    empty (a refused run then says the holder is unknown): the run goes on to the writer that needs the room,
    which says so in its own line."""
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.ftruncate(fd, 0)


def _holder(fd: int) -> str:
    """'pid N on HOST' from the holder's line; it writes it just after locking, so a moment is allowed for it."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace")
        words = text.split()
        if text.endswith("\n") and len(words) == 4 and words[0] == "pid" and words[2] == "host":
            return f"pid {words[1]} on host {words[3]}"
        if time.monotonic() >= deadline:
            return "pid and host unknown: the lock file does not name them"
        time.sleep(0.05)


def lock_run(cfg: Config, grid: Grid) -> Optional[RunLock]:
    """Collective, after the process group starts and before the run looks into log.dir or changes it: the writing
    rank takes the lock and every rank learns whether it could, so a refused run exits on all ranks at once
    (exit 2) instead of leaving the others waiting in a collective for launch.timeout_minutes."""
    lock, refusal = None, None
    if grid.rank == writer_rank(grid):
        try:
            lock = take_lock(cfg)
        except UserError as e:
            refusal = str(e)
    if dist.is_initialized():
        box = [refusal]
        dist.broadcast_object_list(box, src=writer_rank(grid))
        refusal = box[0]
    if refusal is not None:
        if lock is not None:
            lock.release()
        raise UserError(refusal)
    return lock
