"""The smallest and largest token id of a ``.bin``, scanned once per file and cached.

A dataset's ids index the embedding table: one id past ``model.vocab_size``
is an IndexError on CPU and a device-side assert on CUDA, steps into the run.
The ``.idx`` header's ``max_token`` is only what the writer claimed; a ``.bin``
rewritten, mismatched with its ``.idx`` or damaged says otherwise. So the
ids themselves are read when a dataset is opened, one sequential pass, and
the result is kept under ``data.cache_dir/token-ranges/`` so that the pass is
paid once per file, not once per run.

A cache entry is trusted only while the file is the one that was scanned.
Size and mtime are not enough: ``cp -p``, ``rsync -t``, tar and ``os.utime``
rewrite a file and put the old mtime back. The fingerprint adds what a writer
cannot set — the real path's inode number and the inode's change time
(``ctime``, moved by every write, rename and ``utime``) — and a digest of up to
32 blocks spread over the file. A rewrite is missed only if it keeps the size, lands in
the same ctime tick as the scan and changes no sampled block. Entries are JSON
with a checksum (never pickle); one that is unreadable, fails its checksum or
describes another file is scanned again and rewritten, never believed; so is one that is not a regular
file (a FIFO, a link: ``regular_files``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megazero.data.regular_files import open_regular, own_folder, read_regular, replace_into

_FORMAT = 1
_CHUNK = 1 << 24  # tokens per scanned slice: bounded memory whatever the file size
_BLOCK = 4096
_SAMPLES = 32
_MAX_ENTRY_BYTES = 1 << 16
CACHE_SUBDIR = "token-ranges"


@dataclass(frozen=True)
class TokenRange:
    """Smallest and largest id of a token array, and the first position of each (0s when it is empty)."""

    low: int
    low_at: int
    high: int
    high_at: int


def scan_token_range(tokens: np.ndarray) -> TokenRange:
    """One pass over ``tokens`` (a memory map is read slice by slice)."""
    if len(tokens) == 0:
        return TokenRange(0, 0, 0, 0)
    low = high = int(tokens[0])
    low_at = high_at = 0
    for start in range(0, len(tokens), _CHUNK):
        chunk = np.asarray(tokens[start : start + _CHUNK])
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < low:
            low, low_at = lo, start + int(np.argmin(chunk))
        if hi > high:
            high, high_at = hi, start + int(np.argmax(chunk))
    return TokenRange(low, low_at, high, high_at)


def fingerprint(path: Path) -> dict:
    """What identifies this version of the file's bytes (see the module doc)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        if st.st_size <= _BLOCK * _SAMPLES:
            digest.update(f.read())
        else:
            for offset in np.linspace(0, st.st_size - _BLOCK, _SAMPLES).astype(np.int64):
                f.seek(int(offset))
                digest.update(f.read(_BLOCK))
    # not st_dev: clients of one NFS share number it each their own way, and the cache may be shared
    return {"path": os.path.realpath(path), "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sample": digest.hexdigest()}


def entry_path(cache_dir: Path, binf: Path) -> Path:
    name = hashlib.sha256(os.path.realpath(binf).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return Path(cache_dir) / CACHE_SUBDIR / f"{name}.json"


def cached_token_range(tokens: np.ndarray, binf: Path, cache_dir: Path, write: bool) -> TokenRange:
    """The id range of ``tokens`` (the contents of ``binf``): from the cache when it still describes the
    file, else scanned, and recorded when ``write`` (the building rank). OSError when the cache cannot be
    written, for the caller to name data.cache_dir."""
    fp = fingerprint(binf)
    meta = {"format": _FORMAT, "fingerprint": fp, "dtype": np.dtype(tokens.dtype).str, "n_tokens": len(tokens)}
    entry = entry_path(cache_dir, binf)
    found = _read_entry(entry, meta)
    if found is not None:
        return found
    ids = scan_token_range(tokens)
    if write:
        _write_entry(entry, meta, ids)
    return ids


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_entry(entry: Path, meta: dict) -> TokenRange | None:
    """The recorded range when the entry is intact and describes this very file; None otherwise."""
    try:
        body = json.loads(read_regular(entry, _MAX_ENTRY_BYTES, links=False))
    except (OSError, ValueError, RecursionError):  # a FIFO or a link there included: scanned again
        return None
    if not isinstance(body, dict) or body.pop("check", None) != _checksum(body):
        return None
    if {k: body.get(k) for k in meta} != meta:
        return None
    fields = [body.get(k) for k in ("low", "low_at", "high", "high_at")]
    if not all(type(v) is int for v in fields):
        return None
    ids = TokenRange(*fields)
    n = meta["n_tokens"]
    if n and not (ids.low <= ids.high and 0 <= ids.low_at < n and 0 <= ids.high_at < n):
        return None
    return ids


def _write_entry(entry: Path, meta: dict, ids: TokenRange) -> None:
    body = {**meta, **asdict(ids)}
    body["check"] = _checksum(body)
    own_folder(entry.parent)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        tmp.write_text(json.dumps(body, sort_keys=True))
        replace_into(tmp, entry)  # readers see the old entry or the new one, never half of one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
