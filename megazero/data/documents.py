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
change the data. pyarrow and zstandard are imported only when a file needs them.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

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
_PARQUET_BATCH_ROWS = 1024
# Compressed bytes given to zstd at a time: bounds the output of one call (zstd expands at most ~32768
# times, so 4 KiB -> 128 MiB even for a crafted file) at no measurable cost in speed on real text.
_ZSTD_FEED_BYTES = 1 << 12


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
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UserError(f"{what}: {path} does not exist")
        if path.is_dir():
            found = _walk(path, what)
            if not found:
                raise UserError(f"{what}: directory {path} holds no .txt or .jsonl files "
                                "(nor .jsonl.gz, .jsonl.zst or .parquet files)")
            files.extend(found)
        elif input_kind(path):
            files.append(path)
        else:
            raise UserError(f"{what}: {path} has suffix {path.suffix or '(none)'!r}; valid inputs are {_KINDS_HELP}")
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
        raise UserError(f"{what}: {path} is not a regular file ({kind}); valid inputs are {_KINDS_HELP}")


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
        if kind == ".parquet":
            yield from _parquet_documents(path, text_key)
        elif kind in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
            yield from _jsonl_documents(path, text_key, kind)
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


def _reason(e: BaseException, limit: int = 100) -> str:
    """A library's error message, on one short line."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _missing(module: str, path: Path) -> UserError:
    return UserError(f"{path}: reading it needs the Python package {module!r}, which is not installed; "
                     f"install it (pip install {module}) or give the data as .jsonl")


def _open_jsonl(path: Path, kind: str) -> tuple[IO[bytes], tuple[type[BaseException], ...], str]:
    """A binary line reader over ``path``'s decompressed bytes, the errors that mean its data is corrupt,
    and the name of its format for those errors."""
    if kind == ".jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise _missing("zstandard", path) from None
    try:
        handle = gzip.open(path, "rb") if kind == ".jsonl.gz" else path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if kind == ".jsonl.gz":
        # BadGzipFile (an OSError): not gzip, bad CRC; EOFError: truncated; zlib.error: garbage inside
        return handle, (OSError, EOFError, zlib.error), "gzip"
    if kind == ".jsonl.zst":
        reader = io.BufferedReader(_ZstdReader(handle, zstandard), 1 << 16)
        return reader, (OSError, EOFError, zstandard.ZstdError), "zstd"
    return handle, (OSError,), ""


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a Zstandard file (every frame in turn), bounded in memory.

    Not ``ZstdDecompressor.stream_reader``: it ends cleanly on a file cut inside a frame, returning the
    partial data as if it were all (a half-copied download would silently lose its tail). Here a file
    that ends inside a frame raises EOFError, as gzip does.
    """

    def __init__(self, source: IO[bytes], zstandard) -> None:  # the zstandard module, imported by the caller
        super().__init__()
        self._source = source
        self._dctx = zstandard.ZstdDecompressor()
        self._corrupt = zstandard.ZstdError
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # some bytes of the current frame were given and its end not seen
        self._out = memoryview(b"")
        self._error: Exception | None = None  # raised once the data decoded before it has been read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            if self._error:
                raise self._error
            data = self._source.read(_ZSTD_FEED_BYTES)
            if not data:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame (truncated?)")
                return 0
            self._out = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        try:
            while data:
                self._in_frame = True
                out.append(self._frame.decompress(data))
                if not self._frame.eof:
                    break
                data = self._frame.unused_data  # the next frame starts here
                self._frame = self._dctx.decompressobj()
                self._in_frame = False
        except self._corrupt as e:
            if not out:
                raise
            self._error = e  # the lines before it are read first, so the error names the last good line
        return b"".join(out)

    def close(self) -> None:
        try:
            self._source.close()
        finally:
            super().close()


def _jsonl_documents(path: Path, text_key: str, kind: str = ".jsonl") -> Iterator[str]:
    limit = MAX_DOCUMENT_BYTES
    handle, corrupt, codec = _open_jsonl(path, kind)
    with handle:
        lineno = 0
        while True:
            try:
                raw = handle.readline(limit + 1)
            except corrupt as e:
                after = f"after line {lineno}" if lineno else "before its first line"
                if codec:
                    raise UserError(f"{path}: corrupt or truncated {codec} data {after} ({_reason(e)}); "
                                    f"is it a complete {kind} file? fetch or compress it again") from None
                raise UserError(f"{path}: cannot read {after} ({e.strerror or _reason(e)})") from None
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
        keys = sorted(map(_show, record))
        raise UserError(f"{where}: no {text_key!r} field (fields: {_listed(keys)}); "
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


def _listed(names: list[str], shown: int = 8) -> str:
    """``a, b, c and 5 more``, or ``none``."""
    if not names:
        return "none"
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    """The strings of column ``text_key``, row by row, a batch of rows at a time (row groups never whole)."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise _missing("pyarrow", path) from None
    limit = MAX_DOCUMENT_BYTES
    try:
        handle = path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    with handle:
        try:
            parquet = pq.ParquetFile(handle)
            schema = parquet.schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable parquet file ({_reason(e)})") from None
        if text_key not in schema.names:
            raise UserError(f"{path}: no {text_key!r} column (columns: {_listed([_show(n) for n in schema.names])}); "
                            "data.text_key names the column that holds the text")
        kind = schema.field(text_key).type
        if pa.types.is_dictionary(kind):  # a pandas categorical column comes back dictionary-encoded
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise UserError(f"{path}: column {text_key!r} holds {kind} values (row 1 on), expected strings "
                            "(the text of each document); data.text_key names the column that holds the text")
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_key])
        row = 0  # rows before this batch
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{path}: corrupt parquet data after row {row} ({_reason(e)})") from None
            if batch is None:
                break
            column = batch.column(0)
            if pa.types.is_dictionary(column.type):
                column = column.dictionary_decode()
            if column.null_count:
                first = pc.index(column.is_null(), True).as_py()
                raise UserError(f"{path}: row {row + first + 1}: column {text_key!r} is null, expected a string")
            sizes = pc.binary_length(column)
            if len(column) and pc.max(sizes).as_py() > limit:
                big = pc.index(pc.greater(sizes, limit), True).as_py()
                raise UserError(f"{path}: row {row + big + 1}: text is {sizes[big].as_py()} bytes, more than the "
                                f"{limit} megazero reads as one document; split it into several rows")
            yield from _parquet_strings(column, path, row, text_key)
            row += len(column)


def _parquet_strings(column, path: Path, row: int, text_key: str) -> Iterator[str]:
    """The non-empty strings of one batch (``column``: a pyarrow string array; ``row``: rows before it)."""
    try:
        texts = column.to_pylist()
    except UnicodeDecodeError:  # the writer did not validate UTF-8; find the row for the error line
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: row {row + i + 1}: column {text_key!r} is not UTF-8 text "
                                f"(bad byte at offset {e.start})") from None
        raise UserError(f"{path}: rows {row + 1}-{row + len(column)}: column {text_key!r} is not UTF-8 text") from None
    yield from (text for text in texts if text)
