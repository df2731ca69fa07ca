"""Readers for the input files that are not plain text: compressed ``.jsonl`` streams and parquet tables.

``documents`` decides which files a path names and turns their lines into documents; this module only gets
bytes or strings out of the formats that need a library, each as a stream held in bounded memory, from a
file opened only as a regular file (``regular_files``):

* ``open_jsonl``: a binary line reader over a ``.jsonl``, ``.jsonl.gz`` or ``.jsonl.zst`` file, with the
  errors that mean its data is corrupt, so the caller reads every kind's lines the same way and can name the
  last good line when the stream breaks. gzip is read by the standard library's ``gzip``, which already
  raises on a truncated file.
* ``_ZstdReader``: Zstandard, fed by hand to a ``decompressobj`` a few KiB at a time, not read through
  ``ZstdDecompressor.stream_reader``: that one ends cleanly on a file cut inside a frame, so a half-copied
  download would silently lose its tail. Here a truncated frame is an error (EOFError, as for gzip), and
  each call's output stays bounded even for a crafted file.
* ``parquet_documents``: one document per row of a string column, a batch of rows at a time (a row group is
  never read whole), each batch checked for nulls, oversized values and bad UTF-8 with the row named.

pyarrow and zstandard are imported only when a file needs them (``import megazero.data`` loads neither);
a missing one is a ``UserError`` saying what to install. ``show``, ``reason`` and ``listed`` shorten values
and library messages for error lines, here and in ``documents``.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from megazero.data.regular_files import open_regular
from megazero.errors import UserError

# Compressed bytes given to zstd at a time: bounds the output of one call (zstd expands at most ~32768
# times, so 4 KiB -> 128 MiB even for a crafted file) at no measurable cost in speed on real text.
_ZSTD_FEED_BYTES = 1 << 12


def show(value: object, limit: int = 40) -> str:
    """A value from the file, short and printable, for an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reason(e: BaseException, limit: int = 100) -> str:
    """A library's error message, on one short line."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listed(names: list[str], shown: int = 8) -> str:
    """``a, b, c and 5 more``, or ``none``."""
    if not names:
        return "none"
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _missing(module: str, path: Path) -> UserError:
    return UserError(f"{path}: reading it needs the Python package {module!r}, which is not installed; "
                     f"install it (pip install {module}) or give the data as .jsonl")


def _open(path: Path) -> IO[bytes]:
    try:
        return open_regular(path)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def open_jsonl(path: Path, kind: str) -> tuple[IO[bytes], tuple[type[BaseException], ...], str]:
    """A binary line reader over ``path``'s decompressed bytes, the errors that mean its data is corrupt,
    and the name of its format for those errors."""
    if kind == ".jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise _missing("zstandard", path) from None
    raw = _open(path)
    handle: IO[bytes] = _GzipFile(fileobj=raw, mode="rb") if kind == ".jsonl.gz" else raw
    if kind == ".jsonl.gz":
        # BadGzipFile (an OSError): not gzip, bad CRC; EOFError: truncated; zlib.error: garbage inside
        return handle, (OSError, EOFError, zlib.error), "gzip"
    if kind == ".jsonl.zst":
        reader = io.BufferedReader(_ZstdReader(handle, zstandard), 1 << 16)
        return reader, (OSError, EOFError, zstandard.ZstdError), "zstd"
    return handle, (OSError,), ""


class _GzipFile(gzip.GzipFile):
    """gzip over a file opened by ``regular_files``, closing that file with itself (a ``GzipFile`` given an
    open file leaves it open)."""

    def close(self) -> None:
        raw = self.fileobj
        try:
            super().close()
        finally:
            if raw is not None:
                raw.close()


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


def parquet_documents(path: Path, text_key: str, limit: int, batch_rows: int) -> Iterator[str]:
    """The strings of column ``text_key``, row by row, a batch of rows at a time (row groups never whole).

    ``limit`` is the most bytes one value may hold; ``batch_rows`` the rows read at a time.
    """
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise _missing("pyarrow", path) from None
    handle = _open(path)
    with handle:
        try:
            parquet = pq.ParquetFile(handle)
            schema = parquet.schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable parquet file ({reason(e)})") from None
        if text_key not in schema.names:
            raise UserError(f"{path}: no {text_key!r} column (columns: {listed([show(n) for n in schema.names])}); "
                            "data.text_key names the column that holds the text")
        kind = schema.field(text_key).type
        if pa.types.is_dictionary(kind):  # a pandas categorical column comes back dictionary-encoded
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise UserError(f"{path}: column {text_key!r} holds {kind} values (row 1 on), expected strings "
                            "(the text of each document); data.text_key names the column that holds the text")
        batches = parquet.iter_batches(batch_size=batch_rows, columns=[text_key])
        row = 0  # rows before this batch
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{path}: corrupt parquet data after row {row} ({reason(e)})") from None
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
