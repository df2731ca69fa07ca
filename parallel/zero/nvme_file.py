"""One rank's scratch file of optimizer states on a local disk, read and written in large aligned blocks.

ZeRO-Infinity (Rajbhandari et al., SC'21, section 5) keeps the states on NVMe and streams them through a few
host buffers. The file is opened with ``O_DIRECT`` where the filesystem allows it (the page cache would
otherwise hold a second copy of what was just written, and grow the process's footprint with the model), and
with buffered I/O where it does not (tmpfs, some overlays); ``direct`` says which one ran. Every transfer is a
whole number of 4 KiB pages from a page-aligned buffer at a page-aligned offset, so both modes take the same
calls. The transfers run on a small thread pool: ``os.preadv``/``os.pwritev`` release the GIL, so the next
chunk's read and the last one's write proceed while the caller computes.

The file is megazero's own: its name carries this process's id and a random token, it is created exclusively,
and it is removed when the store is closed or collected (a later run never trusts or deletes another's).
"""
from __future__ import annotations

import errno
import os
import secrets
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from megazero.kernels.errors import UserError

PAGE = 4096
PREFIX = "megazero-states-"


def aligned_empty(nbytes: int) -> Tensor:
    """A uint8 host tensor of ``nbytes`` (a multiple of PAGE) whose first byte is page-aligned."""
    assert nbytes % PAGE == 0, nbytes
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    pad = (-raw.data_ptr()) % PAGE
    return raw[pad:pad + nbytes]


def _remove(path: str, fd: list[int], pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    os.close(fd[0])
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class NvmeFile:
    """A fixed-size scratch file under ``folder``; reads and writes of page-aligned host buffers, asynchronous."""

    def __init__(self, folder: Path, key: str, threads: int = 2, holds: str = "optimizer states"):
        """An empty file; ``grow`` reserves its space. ``key``: the config key that named ``folder``, and ``holds``:
        what the file is for, for the one-line errors."""
        self.nbytes, self.key, self.folder, self.holds = 0, key, folder, holds
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}.bin"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
            self.direct = hasattr(os, "O_DIRECT")
            try:
                fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the filesystem refuses O_DIRECT (older tmpfs)
                    raise
                self.direct, fd = False, os.open(self.path, flags, 0o600)
        except OSError as e:
            raise UserError(f"{key}={str(folder.parent)!r}: cannot create a file in {folder} ({e.strerror})") from None
        # megazero's files of earlier runs in this folder (a run that was killed leaves its file): never read,
        # never removed here (another run may be using it); the start-up line names them
        self.others = sorted(p for p in folder.glob(f"{PREFIX}*.bin") if p != self.path)
        self._fd = [fd]  # the descriptor in a box the finalizer holds (not self: it would never be collected)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme")
        self._finalizer = weakref.finalize(self, _remove, str(self.path), self._fd, self.pool)
        self.grow(PAGE)
        if self.direct and not _direct_works(fd):  # opened, but its transfers fail (some filesystems)
            self.direct, self._fd[0] = False, os.open(self.path, os.O_RDWR, 0o600)
            os.close(fd)

    @property
    def fd(self) -> int:
        return self._fd[0]

    def grow(self, nbytes: int) -> None:
        """Reserve ``nbytes`` (a whole number of pages) more at the end: blocks allocated on the disk now, so a
        disk that cannot hold the states says so before the first step, in one line."""
        assert nbytes % PAGE == 0, nbytes
        free = _free_bytes(self.folder)
        if free < nbytes:
            raise UserError(f"{self.key}={str(self.folder.parent)!r}: {self.folder} has {free:,} bytes free; this "
                            f"rank's {self.holds} need {nbytes:,} more")
        try:
            os.posix_fallocate(self.fd, self.nbytes, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # ENOSPC, EDQUOT, EIO: one line
                raise UserError(f"{self.key}={str(self.folder.parent)!r}: cannot reserve {nbytes:,} bytes more "
                                f"in {self.path} ({e.strerror})") from None
            os.ftruncate(self.fd, self.nbytes + nbytes)  # no preallocation here: a sparse file
        self.nbytes += nbytes

    def read(self, buffer: Tensor, offset: int) -> Future:
        """Fill ``buffer`` (page-aligned uint8, whole pages) from ``offset``; the future's result is the bytes."""
        return self.pool.submit(self._transfer, os.preadv, buffer, offset)

    def write(self, buffer: Tensor, offset: int) -> Future:
        """Write ``buffer`` at ``offset``; the future's result is the bytes."""
        return self.pool.submit(self._transfer, os.pwritev, buffer, offset)

    def _transfer(self, call, buffer: Tensor, offset: int) -> int:
        assert offset % PAGE == 0 and buffer.numel() % PAGE == 0 and buffer.data_ptr() % PAGE == 0
        assert offset + buffer.numel() <= self.nbytes, (offset, buffer.numel(), self.nbytes)
        view, done = memoryview(buffer.numpy()), 0
        what = "reading" if call is os.preadv else "writing"
        while done < len(view):  # a transfer may come back short (a signal, a large request): go on from there
            try:
                moved = call(self.fd, [view[done:]], offset + done)
            except OSError as e:  # a disk that fills (where blocks could not be reserved), fails or goes away
                raise UserError(f"{self.key}={str(self.folder.parent)!r}: {what} {len(view) - done:,} bytes at "
                                f"{offset + done:,} of {self.path} failed ({e.strerror})") from None
            if moved <= 0:
                raise UserError(f"{self.key}={str(self.folder.parent)!r}: {what} {self.path} moved {moved} bytes at "
                                f"{offset + done:,}")
            done += moved
        return done

    def close(self) -> None:
        """Wait for the transfers, close and remove the file."""
        self._finalizer()


def _direct_works(fd: int) -> bool:
    """One page written and read back through ``fd`` (opened O_DIRECT, sized): False where the filesystem
    accepted the flag at open but refuses the transfers (EINVAL)."""
    page = aligned_empty(PAGE)
    try:
        os.pwritev(fd, [memoryview(page.numpy())], 0)
        os.preadv(fd, [memoryview(page.numpy())], 0)
    except OSError:
        return False
    return True


class SimulatedFile:
    """What ``--simulate`` builds in place of an NvmeFile (fake tensors hold no bytes to move): no file, every
    transfer done at once; its size is the file's."""

    direct = False

    def __init__(self, folder: Path):
        self.path, self.nbytes, self.others = folder / f"{PREFIX}simulated.bin", 0, []

    def grow(self, nbytes: int) -> None:
        self.nbytes += nbytes

    def read(self, buffer: Tensor, offset: int) -> Future:
        return self.write(buffer, offset)

    def write(self, buffer: Tensor, offset: int) -> Future:
        done: Future = Future()
        done.set_result(buffer.numel())
        return done

    def close(self) -> None:
        pass


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
