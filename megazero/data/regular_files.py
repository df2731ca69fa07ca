"""Every file megazero/data reads, its own cache's and the user's, is opened here, and only as a regular file.

A FIFO blocks ``open()`` until a writer comes (and the run then misses its first SIGTERM, caught inside
the C call); a device may never end; a socket or a folder cannot be read as a file. So a file is
``lstat``-ed (``stat``-ed where links are followed) before it is opened, opened with ``O_NONBLOCK`` (a FIFO
swapped in after that look still opens at once), and ``fstat``-ed: the descriptor, not the name, decides,
so nothing can swap the file between the check and the read.

Files in ``data.cache_dir`` are opened with ``O_NOFOLLOW`` too (``links=False``): megazero writes regular
files there, so a link is damage, and following it would read a file outside the cache. User inputs
(``data.paths``, ``data.tokenizer``) may be links (a Hugging Face snapshot links into its blob store):
those are followed (``links=True``). Either way what is not a regular file raises :class:`NotRegularFile`,
an ``OSError``, so a caller's handling of an unreadable file covers it: a cache entry is rebuilt, a user's
file is one line naming it and saying what it is.

When a cache entry is rebuilt, the new file is renamed over the old entry, which replaces a FIFO, socket
or link (the link itself, never what it points to). ``make_room`` removes an empty folder there, which a
rename cannot replace; a folder with files in it is not megazero's to delete. ``own_folder`` makes a
subfolder of the cache a real folder before anything is written in it, so no write follows a link out.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from megazero.errors import UserError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"))


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, for an error line: ``a FIFO``, ``a folder``, ... or ``a regular file``."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


class NotRegularFile(OSError):
    """``filename`` is a FIFO, socket, device, folder or (where links are not followed) a link: ``kind``."""

    def __init__(self, path: str | Path, kind: str):
        super().__init__(errno.EINVAL, f"not a regular file: {kind}", str(path))
        self.kind = kind


class FileTooLarge(OSError):
    """``filename`` holds ``size`` bytes, more than the ``limit`` its reader accepts."""

    def __init__(self, path: str | Path, size: int, limit: int):
        super().__init__(errno.EFBIG, f"{size} bytes, more than the {limit} accepted", str(path))
        self.size = size
        self.limit = limit


def _check(path: str | Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, file_kind(mode))


def open_regular(path: str | Path, *, links: bool = True) -> BinaryIO:
    """``path`` opened for reading (binary, blocking) once it is known to be a regular file; else
    :class:`NotRegularFile`. ``links``: follow a link at ``path`` (False for cache files)."""
    _check(path, os.stat(path, follow_symlinks=links).st_mode)  # a device is not even opened
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:  # swapped since the look: say what it is now, if it is still there
        try:
            _check(path, os.stat(path, follow_symlinks=links).st_mode)
        except OSError:
            pass
        raise
    try:
        _check(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, limit: int, *, links: bool = True) -> bytes:
    """The whole of the regular file ``path``, when it holds at most ``limit`` bytes (checked on the open
    descriptor before anything is read); else :class:`FileTooLarge` (or :class:`NotRegularFile`)."""
    with open_regular(path, links=links) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileTooLarge(path, size, limit)
        data = f.read(limit + 1)
    if len(data) > limit:  # grown since the look
        raise FileTooLarge(path, len(data), limit)
    return data


def make_room(path: Path) -> None:
    """Before a rebuilt cache file is renamed to ``path``: an empty folder there is removed (a rename cannot
    replace it). A folder with files in it may hold someone's work: one line naming it, and it stays."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        return  # a file, FIFO, socket or link: the rename replaces the entry itself
    try:
        os.rmdir(path)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise UserError(f"data cache {path} is a folder with files in it, where megazero keeps a file; move it "
                        "out of data.cache_dir (megazero deletes nothing it did not write)") from None


def replace_into(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` onto the cache entry ``path``, whatever (non-folder) was there."""
    make_room(path)
    os.replace(tmp, path)


def own_folder(path: Path) -> None:
    """Make ``path`` (a subfolder of the cache, its parents made as needed) a real folder, so nothing written
    in it lands outside the cache: a link, FIFO or file of that name is removed first (the cache is
    megazero's; removing a link never touches what it points to)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISDIR(mode):
        os.unlink(path)
    path.mkdir(parents=True, exist_ok=True)
