"""Raw text inputs: which files a path names, and the documents inside them.

Five kinds of file, told apart by how the name ends:

* ``.txt``: the whole file is one document;
* ``.jsonl``: one document per line, a JSON object whose ``text_key`` field is the text;
* ``.jsonl.gz`` / ``.jsonl.zst``: a ``.jsonl`` file compressed with gzip / Zstandard, decompressed as a
  stream (never whole in memory); each line is read exactly as a ``.jsonl`` line, numbered the same;
* ``.parquet``: one document per row, the string column ``text_key``, read a batch of rows at a time.

A directory stands for every such file below it, sorted by path, so that the token stream (and so every
batch) is the same on every machine.

These files are untrusted: every way one can be wrong is a ``UserError`` that names the file (and line or
row), never a traceback, a hang or an unbounded read. A compressed file that ends early or holds garbage is
one too (naming the last line read), since reading on would silently lose its tail. Folder links are
followed (data is often linked in); a link that leads back into a folder already walked is refused, since it
would loop or read the same files twice. Only regular files are read: a FIFO or a device named ``x.txt``
would block or never end. A ``.jsonl`` record whose text holds a lone UTF-16 surrogate (``"\\ud800"`` is
valid JSON but not Unicode text) is an error, as all bad input is by default: skipping it would silently
change the data.

Getting lines out of a compressed file, and strings out of a parquet one, is ``readers``' work (pyarrow and
zstandard are imported there, only when a file needs them); this module says what those lines must hold.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from megazero.data.readers import listed, open_jsonl, parquet_documents, reason, show
from megazero.data.regular_files import FileTooLarge, file_kind, read_regular
from megazero.errors import UserError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
_LONGEST_FIRST = sorted(TEXT_SUFFIXES, key=len, reverse=True)  # .jsonl.gz before .jsonl
_KINDS_HELP = (".txt files (one document each), .jsonl, .jsonl.gz or .jsonl.zst files (one JSON object per line), "
               ".parquet files (one document per row) or folders of them")
# The largest document read (a .txt file, a .jsonl line, decompressed or not, a parquet value): held whole in
# memory, so a larger one (a sparse or binary file misnamed .txt, a .jsonl with no newline at all) is refused
# before it is read, not an OOM kill.
MAX_DOCUMENT_BYTES = 1 << 30
_SURROGATE = re.compile("[\ud800-\udfff]")
_BOM = b"\xef\xbb\xbf"
_PARQUET_BATCH_ROWS = 1024  # rows of a parquet file read at a time


def input_kind(path: str | Path) -> str | None:
    """The kind of input file ``path`` is (one of ``TEXT_SUFFIXES``), by its full name ending; None if none.

    ``Path.suffix`` alone would see ``.gz`` in ``x.jsonl.gz``.
    """
    name = Path(path).name
    return next((k for k in _LONGEST_FIRST if name.endswith(k) and len(name) > len(k)), None)


def expand_inputs(paths: Iterable[str | Path], what: str = "input") -> list[Path]:
    """Return the text files named by ``paths`` (directories walked, sorted).

    ``what`` names the setting the paths came from (``data.paths``,
    ``--input``) so that an error tells the person which value to fix.
    """
    groups: list[tuple[str, Path, list[Path]]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UserError(f"{what}: {path} does not exist")
        if path.is_dir():
            found = _walk(path, what)
            if not found:
                raise UserError(f"{what}: directory {path} holds no .txt or .jsonl files "
                                "(nor .jsonl.gz, .jsonl.zst or .parquet files)")
        elif input_kind(path):
            found = [path]
        else:
            raise UserError(f"{what}: {path} has suffix {path.suffix or '(none)'!r}; valid inputs are {_KINDS_HELP}")
        groups.append((f"{what} {str(raw)!r}", path, found))
    files = [f for _, _, found in groups for f in found]
    for path in files:
        _check_regular(path, what)
    refuse_repeats(groups)
    return files


def refuse_repeats(groups: Iterable[tuple[str, Path, list[Path]]]) -> None:
    """No file is read twice: not through two spellings of one folder (``a``, ``a/``, ``./a``, a link to it),
    not through a folder and a folder or file inside it, not through a file link beside its target.

    ``groups`` are (label for the error, the path as given, the files it stands for); files compare by
    resolved path, as folders reached again through a link do in ``_walk``."""
    roots: dict[str, str] = {}
    seen: dict[str, tuple[str, Path]] = {}
    for label, root, found in groups:
        real_root = os.path.realpath(root)
        if real_root in roots:
            raise UserError(f"{label} is {roots[real_root]} again (both are {real_root}), so its files would be "
                            "read twice; list it once")
        roots[real_root] = label
        for path in found:
            real = os.path.realpath(path)
            if real not in seen:
                seen[real] = (label, path)
                continue
            first_label, first = seen[real]
            if first_label == label:
                raise UserError(f"{label}: {path} is {first} again (through a link), so it would be read twice; "
                                "remove one of the two")
            raise UserError(f"{label} reaches {path}, which {first_label} reads too (as {first}), so it would be "
                            "read twice; list each file under one entry")


def name_paths(paths: Iterable[str | Path], shown: int = 3) -> str:
    """``a, b, c and 997 more``: an error line names the inputs without growing with them."""
    names = [str(p) for p in paths]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_regular(path: Path, what: str) -> None:
    """Refuse what cannot be read as a file (dangling links, link loops, FIFOs, sockets, devices) before any
    is read; each is opened later through ``regular_files``, which checks the open descriptor again."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise UserError(f"{what}: cannot read {path} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{what}: {path} is not a regular file ({file_kind(mode)}); valid inputs are {_KINDS_HELP}")


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
            if not name.startswith(".") and input_kind(name):
                path = here / name
                found.append((path.relative_to(directory).as_posix(), path))
    return [path for _, path in sorted(found)]


def iter_documents(files: Iterable[Path], text_key: str = "text") -> Iterator[str]:
    """Yield every non-empty document of ``files`` in order.

    ``text_key`` names the field of each JSON line, or the column of a parquet file, that holds the text.
    """
    for path in files:
        kind = input_kind(path)
        if kind == ".parquet":  # the limits read at call time, so a test can lower them
            yield from parquet_documents(path, text_key, MAX_DOCUMENT_BYTES, _PARQUET_BATCH_ROWS)
        elif kind in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
            yield from _jsonl_documents(path, text_key, kind)
        else:
            text = _read_text(path)
            if text:
                yield text


def _read_text(path: Path) -> str:
    limit = MAX_DOCUMENT_BYTES  # read at call time, so a test can lower it
    try:
        return read_regular(path, limit).decode("utf-8")
    except FileTooLarge as e:
        raise UserError(f"{path}: {e.size} bytes, more than the {limit} megazero reads as one document (a .txt "
                        "file is one document); split it into several files or one .jsonl record per document"
                        ) from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _jsonl_documents(path: Path, text_key: str, kind: str = ".jsonl") -> Iterator[str]:
    limit = MAX_DOCUMENT_BYTES
    handle, corrupt, codec = open_jsonl(path, kind)
    with handle:
        lineno = 0
        while True:
            try:
                raw = handle.readline(limit + 1)
            except corrupt as e:
                after = f"after line {lineno}" if lineno else "before its first line"
                if codec:
                    raise UserError(f"{path}: corrupt or truncated {codec} data {after} ({reason(e)}); "
                                    f"is it a complete {kind} file? fetch or compress it again") from None
                raise UserError(f"{path}: cannot read {after} ({e.strerror or reason(e)})") from None
            if not raw:
                break
            lineno += 1
            where = f"{path}:{lineno}"
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise UserError(f"{where}: line is longer than {limit} bytes, the most megazero reads as one "
                                ".jsonl record; is this a .jsonl file? split long documents into several records")
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            text = _record_text(raw, where, text_key)
            if text:
                yield text


def _record_text(raw: bytes, where: str, text_key: str) -> str:
    """The ``text_key`` string of one .jsonl line ("" for a blank line)."""
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
        raise UserError(f"{where}: expected a JSON object with a {text_key!r} field, got {kind}")
    if text_key not in record:
        keys = sorted(map(show, record))
        raise UserError(f"{where}: no {text_key!r} field (fields: {listed(keys)}); "
                        "data.text_key names the field that holds the text")
    text = record[text_key]
    if not isinstance(text, str):
        raise UserError(f"{where}: field {text_key!r} is {type(text).__name__}, expected a string")
    bad = None if text.isascii() else _SURROGATE.search(text)  # isascii is O(1) in CPython
    if bad:
        raise UserError(
            f"{where}: field {text_key!r} holds a lone surrogate \\u{ord(bad.group()):04x} at character "
            f"{bad.start()} (valid JSON, but not Unicode text); fix that escape or remove the record"
        )
    return text
