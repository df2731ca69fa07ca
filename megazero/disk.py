"""Writes the disk refuses (full, over quota, read-only, failing), said in one line that names the path.

Every writer of a run (checkpoints, metrics.jsonl, TensorBoard's event files, the pipeline trace) turns
such a failure into a :class:`UserError` through :func:`write_refusal`, and leaves no partial file of its
own behind (:func:`replace_text` for files replaced whole). A full disk does not always say so: torch's
zip writer (``torch.save``, and DCP's tensor files through it) reports the short write as ``RuntimeError:
... unexpected pos 704 vs 598``. That counts as a full disk where an ``OSError`` behind it carries ENOSPC
or EDQUOT, or, where that was lost (another rank's error reaches rank 0 pickled, without it), where statvfs
finds less room left than the write needed.
"""
from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

# errno -> what the disk said beside "no space left"
NO_SPACE = {errno.ENOSPC: "", errno.EDQUOT: "disk quota exceeded"}
# how torch's zip writer (caffe2 inline_container) words a write that did not land whole
SHORT_WRITE = ("unexpected pos", "failed writing file", "iostream error")
FULL_BELOW = 1 << 20  # a short write with less than this free (or less than the write needed) is a full disk


def size_text(n: Optional[int]) -> str:
    """Bytes for a person: ``512 bytes``, ``4.1 KB``, ``2.3 MB``, ``15.0 GB`` (decimal units)."""
    if n is None:
        return "an unknown amount"
    if n < 1000:
        return f"{n} byte{'' if n == 1 else 's'}"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if n < scale * 999.95:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e12:.1f} TB"


def free_bytes(path: str | Path) -> Optional[int]:
    """Room left for this user on the filesystem holding ``path`` (its nearest existing folder); None if
    statvfs cannot tell."""
    p = Path(path)
    for candidate in (p, *p.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and the errors it was raised from or during (torch.save's OSError hides behind a RuntimeError)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen and len(seen) < 32:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def os_error(e: BaseException) -> Optional[OSError]:
    """The first OSError in ``e``'s chain that carries an errno."""
    return next((x for x in _chain(e) if isinstance(x, OSError) and x.errno is not None), None)


def is_no_space(e: BaseException, where: str | Path, needs: Optional[int] = None) -> bool:
    """Whether ``e``, from writing under ``where`` (``needs`` bytes in all, if known: for a checkpoint, every
    rank's share), is a full disk or a spent quota. Call it before the partial write is removed: statvfs must
    see the disk as the write left it."""
    found = os_error(e)
    if found is not None and found.errno in NO_SPACE:
        return True
    if any(s in str(x) for x in _chain(e) for s in SHORT_WRITE):
        free = free_bytes(where)
        return free is not None and free < max(needs or 0, FULL_BELOW)
    return False


def no_space_text(where: str | Path, needs: Optional[int], e: Optional[BaseException] = None) -> str:
    """``no space left on <where> (needs about N, M free)``; a quota says so."""
    found = os_error(e) if e is not None else None
    quota = NO_SPACE.get(found.errno, "") if found is not None else ""
    parts = [quota] if quota else []
    if needs is not None:
        parts.append(f"needs about {size_text(needs)}")
    free = free_bytes(where)
    if free is not None:
        parts.append(f"{size_text(free)} free")
    return f"no space left on {where}" + (f" ({', '.join(parts)})" if parts else "")


def write_refusal(e: BaseException, path: str | Path, where: str | Path, needs: Optional[int] = None,
                  full: Optional[bool] = None) -> Optional[str]:
    """Why writing ``path`` (under the folder ``where``) failed, for a one-line message, or None when ``e`` is
    not a refusal by the disk (a bug stays a bug). ``full``: :func:`is_no_space`'s answer, taken before a
    partial write was removed (None: ask now)."""
    if full if full is not None else is_no_space(e, where, needs):
        return no_space_text(where, needs, e)
    found = os_error(e)
    if found is None:
        return None
    return f"cannot write {found.filename or path} ({found.strerror or errno.errorcode.get(found.errno, found)})"


def replace_text(path: Path, text: str) -> None:
    """``path`` holds ``text``, replaced in one step (a kill loses neither); a staged copy the disk refused
    is removed, so a failed write leaves nothing behind."""
    staged = path.with_name(path.name + ".tmp")
    try:
        staged.write_text(text)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staged.unlink()
        raise
