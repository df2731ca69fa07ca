"""Raw text inputs: which files a path names, and the documents inside them.

A ``.txt`` file is one document; a ``.jsonl`` file holds one document per line
(a JSON object whose ``json_key`` field is the text); a directory stands for
every ``.txt``/``.jsonl`` file below it, sorted by path, so that the token
stream (and so every batch) is the same on every machine.

These files are untrusted: every way one can be wrong is a ``UserError`` that
names the file (and line), never a traceback, a hang or an unbounded read.
Folder links are followed (data is often linked in); a link that leads back
into a folder already walked is refused, since it would loop or read the same
files twice. Only regular files are read: a FIFO or a device named ``x.txt``
would block or never end. A ``.jsonl`` record whose text holds a lone UTF-16
surrogate (``"\\ud800"`` is valid JSON but not Unicode text) is an error, as all
bad input is by default: skipping it would silently change the data.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from megazero.errors import UserError

TEXT_SUFFIXES = (".txt", ".jsonl")
# The largest document read (a .txt file, a .jsonl line): held whole in memory, so a larger one (a sparse
# or binary file misnamed .txt, a .jsonl with no newline at all) is refused before it is read, not an OOM kill.
MAX_DOCUMENT_BYTES = 1 << 30
_SURROGATE = re.compile("[\ud800-\udfff]")
_BOM = b"\xef\xbb\xbf"


def expand_inputs(paths: Iterable[str | Path], what: str = "input") -> list[Path]:
    """Return the text files named by ``paths`` (directories walked, sorted).

    ``what`` names the setting the paths came from (``data.paths``,
    ``--input``) so that an error tells the person which value to fix.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UserError(f"{what}: {path} does not exist")
        if path.is_dir():
            found = _walk(path, what)
            if not found:
                raise UserError(f"{what}: directory {path} holds no .txt or .jsonl files")
            files.extend(found)
        elif path.suffix in TEXT_SUFFIXES:
            files.append(path)
        else:
            raise UserError(
                f"{what}: {path} has suffix {path.suffix or '(none)'!r}; "
                "valid inputs are .txt files (one document), .jsonl files (one document per line) "
                "or directories of them"
            )
    for path in files:
        _check_regular(path, what)
    return files


def name_paths(paths: Iterable[str | Path], shown: int = 3) -> str:
    """``a, b, c and 997 more``: an error line names the inputs without growing with them."""
    names = [str(p) for p in paths]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_regular(path: Path, what: str) -> None:
    """Refuse what cannot be read as a file: dangling links, link loops, FIFOs, sockets, devices."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise UserError(f"{what}: cannot read {path} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
                 stat.S_ISBLK: "a block device", stat.S_ISDIR: "a folder"}
        kind = next((name for test, name in kinds.items() if test(mode)), "not a plain file")
        raise UserError(f"{what}: {path} is not a regular file ({kind}); give .txt/.jsonl files or folders of them")


def _walk(directory: Path, what: str) -> list[Path]:
    """Text files below ``directory`` (hidden ones skipped, folder links followed), sorted by relative path."""

    def unreadable(e: OSError) -> None:
        raise UserError(f"{what}: cannot read folder {e.filename} ({e.strerror})")

    seen: dict[tuple[int, int], Path] = {}
    found: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(directory, followlinks=True, onerror=unreadable):
        here = Path(root)
        try:
            st = here.stat()
        except OSError as e:
            raise UserError(f"{what}: cannot read folder {here} ({e.strerror})") from None
        first = seen.setdefault((st.st_dev, st.st_ino), here)
        if first != here:
            if here.is_relative_to(first):
                raise UserError(f"{what}: {here} is a symlink loop (it leads back to {first}); "
                                "remove the link or name a folder inside the loop")
            raise UserError(f"{what}: {here} is the folder {first} again (through a link), so its files would be "
                            "read twice; remove one of the two")
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # the same walk, so the same error, anywhere
        for name in names:
            if not name.startswith(".") and Path(name).suffix in TEXT_SUFFIXES:
                path = here / name
                found.append((path.relative_to(directory).as_posix(), path))
    return [path for _, path in sorted(found)]


def iter_documents(files: Iterable[Path], json_key: str = "text") -> Iterator[str]:
    """Yield every non-empty document of ``files`` in order."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, json_key)
        else:
            text = _read_text(path)
            if text:
                yield text


def _read_text(path: Path) -> str:
    limit = MAX_DOCUMENT_BYTES  # read at call time, so a test can lower it
    try:
        size = path.stat().st_size
        if size > limit:
            raise UserError(f"{path}: {size} bytes, more than the {limit} megazero reads as one document (a .txt "
                            "file is one document); split it into several files or one .jsonl record per document")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _show(value: object, limit: int = 40) -> str:
    """A value from the file, short and printable, for an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonl_documents(path: Path, json_key: str) -> Iterator[str]:
    limit = MAX_DOCUMENT_BYTES
    try:
        handle = path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    with handle:
        lineno = 0
        while raw := handle.readline(limit + 1):
            lineno += 1
            where = f"{path}:{lineno}"
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise UserError(f"{where}: line is longer than {limit} bytes, the most megazero reads as one "
                                ".jsonl record; is this a .jsonl file? split long documents into several records")
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            text = _record_text(raw, where, json_key)
            if text:
                yield text


def _record_text(raw: bytes, where: str, json_key: str) -> str:
    """The ``json_key`` string of one .jsonl line ("" for a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text (bad byte at column {e.start + 1})") from None
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON for megazero (nested too deeply to read)") from None
    except ValueError as e:  # a number past Python's digit limit
        raise UserError(f"{where}: not valid JSON for megazero ({str(e).split(':')[0]})") from None
    if not isinstance(record, dict):
        kind = type(record).__name__
        raise UserError(f"{where}: expected a JSON object with a {json_key!r} field, got {kind}")
    if json_key not in record:
        keys = sorted(map(_show, record))
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "") if keys else "none"
        raise UserError(f"{where}: no {json_key!r} field (fields: {shown})")
    text = record[json_key]
    if not isinstance(text, str):
        raise UserError(f"{where}: field {json_key!r} is {type(text).__name__}, expected a string")
    bad = None if text.isascii() else _SURROGATE.search(text)  # isascii is O(1) in CPython
    if bad:
        raise UserError(
            f"{where}: field {json_key!r} holds a lone surrogate \\u{ord(bad.group()):04x} at character "
            f"{bad.start()} (valid JSON, but not Unicode text); fix that escape or remove the record"
        )
    return text
