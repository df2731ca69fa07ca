"""The built-in corpus: text every Python installation ships.

With no ``data.paths`` megazero trains on the interpreter's own standard
library sources and its ``pydoc`` topic documentation. It needs no download,
is the same on every machine with the same Python, and is code plus English
prose: enough for a small model's loss to fall visibly in minutes on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from megazero.data.regular_files import open_regular

DEFAULT_MAX_BYTES = 8_000_000
_FORMAT = 1
# Directories of the standard library that are not library source worth
# learning from: tests and their data, vendored wheels, third-party packages,
# generated tables (encodings), GUI demos, build configuration.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "encodings",
        "ensurepip",
        "lib-dynload",
        "__pycache__",
        "pydoc_data",  # its topics.py holds the topics already included as text
    }
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_key(max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Names the corpus this interpreter produces, for cache file names."""
    text = json.dumps([_FORMAT, sys.version, str(stdlib_dir()), max_bytes])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def iter_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """Yield the documents in a fixed order, stopping before ``max_bytes`` of UTF-8.

    pydoc topics come first (sorted by topic), then ``.py`` files sorted by
    their path inside the standard library.
    """
    budget = max_bytes
    for text in _documents():
        size = len(text.encode("utf-8"))
        if size > budget:
            return
        budget -= size
        yield text


def _documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        if topics[name].strip():
            yield topics[name]
    root = stdlib_dir()
    for path in _source_files(root):
        try:
            with open_regular(path) as f:  # a FIFO dropped in the interpreter's folders is skipped, not waited on
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            yield text


def _source_files(root: Path) -> list[Path]:
    found: list[tuple[str, Path]] = []
    for dirpath, dirs, names in os.walk(root):
        here = Path(dirpath)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("config-", "."))]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = here / name
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def write_corpus(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Write the corpus as jsonl (one ``{"text": ...}`` per document), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for text in iter_corpus(max_bytes):
                f.write(json.dumps({"text": text}, ensure_ascii=False))
                f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
