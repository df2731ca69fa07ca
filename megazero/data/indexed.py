"""Indexed token dataset: ``PREFIX.bin`` (token ids) + ``PREFIX.idx`` (header, document offsets).

The split into a flat token file and a small index follows Megatron-LM's
indexed dataset: readers memory-map the ``.bin`` so a corpus far larger than
RAM costs only the pages a batch touches.

``.idx`` layout (little endian)::

    magic      8 bytes  b"MZIDX\\x00\\x00\\x00"
    version    uint32
    dtype      uint32   1 = uint16, 2 = int32 (the ``.bin`` element type)
    vocab_size uint64   ids in the ``.bin`` are < vocab_size
    n_docs     uint64
    n_tokens   uint64   elements in the ``.bin``
    max_token  uint64   largest id in the ``.bin`` (0 when empty), as its writer saw it: a claim,
                       not trusted (readers scan the ids once, see token_range)
    offsets    uint64 * (n_docs + 1)   document i is tokens[offsets[i]:offsets[i+1]]
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from megazero.data.regular_files import NotRegularFile, open_regular
from megazero.data.token_range import TokenRange, scan_token_range
from megazero.errors import UserError

MAGIC = b"MZIDX\x00\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQ")
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
UINT16_VOCAB_LIMIT = 65536


def dtype_code_for(vocab_size: int) -> int:
    """uint16 holds ids of vocabularies up to 65536 and halves the file; larger ones need int32."""
    return 1 if vocab_size <= UINT16_VOCAB_LIMIT else 2


def _open(path: Path, links: bool) -> BinaryIO:
    """One file of a dataset, only if it is a regular file: one line saying what it is otherwise."""
    try:
        return open_regular(path, links=links)
    except FileNotFoundError:
        raise UserError(f"dataset {path} does not exist") from None
    except NotRegularFile as e:
        raise UserError(f"dataset {path} is not a regular file ({e.kind}); give a PREFIX whose .bin and .idx "
                        "are files") from None


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDatasetBuilder:
    """Streams documents to ``PREFIX.bin`` and writes ``PREFIX.idx`` on ``finalize``.

    Both files are written under temporary names and renamed into place (the
    ``.bin`` first, the ``.idx`` last), so a reader never sees a half-written
    dataset: an existing ``.idx`` means the build finished.
    """

    def __init__(self, prefix: str | Path, vocab_size: int):
        if vocab_size < 1 or vocab_size > np.iinfo(np.int32).max:
            limit = np.iinfo(np.int32).max
            raise UserError(f"dataset {prefix}: vocab_size {vocab_size} is out of range (1 to {limit})")
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self._code = dtype_code_for(vocab_size)
        self._dtype = _DTYPES[self._code]
        self._offsets = [0]
        self._max_token = 0
        suffix = f".tmp-{os.getpid()}-{os.urandom(4).hex()}"
        self._tmp_bin = Path(f"{bin_path(self.prefix)}{suffix}")
        self._tmp_idx = Path(f"{index_path(self.prefix)}{suffix}")
        try:
            self.prefix.parent.mkdir(parents=True, exist_ok=True)
            self._bin = self._tmp_bin.open("wb")
        except OSError as e:
            raise UserError(f"cannot write dataset {self.prefix} ({e.strerror})") from None

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        array = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        if array.ndim != 1:
            raise UserError(
                f"dataset {self.prefix}: a document must be a 1-D sequence of token ids, got shape {array.shape}"
            )
        if array.size:
            if not np.issubdtype(array.dtype, np.integer):
                raise UserError(f"dataset {self.prefix}: token ids must be integers, got {array.dtype}")
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise UserError(
                    f"dataset {self.prefix}: document {len(self._offsets) - 1} has token id {bad}, "
                    f"outside the vocabulary [0, {self.vocab_size})"
                )
            self._max_token = max(self._max_token, high)
            self._bin.write(array.astype(self._dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(array.size))

    def finalize(self) -> Path:
        """Write the index, move both files into place, return the prefix."""
        self._bin.close()
        offsets = np.asarray(self._offsets, dtype="<u8")
        header = _HEADER.pack(
            MAGIC, VERSION, self._code, self.vocab_size, len(offsets) - 1, int(offsets[-1]), self._max_token
        )
        with self._tmp_idx.open("wb") as f:
            f.write(header)
            f.write(offsets.tobytes())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, index_path(self.prefix))
        return self.prefix

    def abort(self) -> None:
        """Drop the partial files (on an error mid-build)."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()


class IndexedDataset:
    """Read-only view of a built dataset; the tokens are a memory map, never loaded whole.

    Both files are opened once, as regular files (``regular_files``), and read through those descriptors
    only: a FIFO named ``PREFIX.idx`` is refused, not waited on. ``links``: follow a link at either name
    (a user's dataset may be linked in; one in the data cache is damage).
    """

    def __init__(self, prefix: str | Path, *, links: bool = True):
        self.prefix = Path(prefix)
        idx, binf = index_path(self.prefix), bin_path(self.prefix)
        try:
            with _open(idx, links) as idx_file, _open(binf, links) as bin_file:
                self._read(idx, idx_file, binf, bin_file)
        except OSError as e:
            raise UserError(f"dataset {e.filename or self.prefix}: cannot read ({e.strerror})") from None

    def _read(self, idx: Path, idx_file: BinaryIO, binf: Path, bin_file: BinaryIO) -> None:
        idx_size = os.fstat(idx_file.fileno()).st_size
        if idx_size < _HEADER.size:
            raise UserError(f"dataset index {idx} is truncated: {idx_size} bytes, the header alone is {_HEADER.size}")
        header = idx_file.read(_HEADER.size)
        magic, version, code, vocab_size, n_docs, n_tokens, max_token = _HEADER.unpack(header)
        if magic != MAGIC:
            raise UserError(
                f"dataset index {idx} is not a megazero index (bad magic {magic!r}); "
                "rebuild it with python -m megazero.data.preprocess"
            )
        if version != VERSION:
            raise UserError(
                f"dataset index {idx} has format version {version}; this megazero reads version {VERSION}, rebuild it"
            )
        if code not in _DTYPES:
            raise UserError(f"dataset index {idx} has unknown dtype code {code} (valid: {sorted(_DTYPES)})")
        expected_idx = _HEADER.size + 8 * (n_docs + 1)
        if idx_size != expected_idx:
            raise UserError(
                f"dataset index {idx} is {'truncated' if idx_size < expected_idx else 'too long'}: "
                f"{idx_size} bytes, expected {expected_idx} for {n_docs} documents"
            )
        dtype = _DTYPES[code]
        bin_size = os.fstat(bin_file.fileno()).st_size
        if bin_size != n_tokens * dtype.itemsize:
            partial = f", not a whole number of {dtype.itemsize}-byte tokens" if bin_size % dtype.itemsize else ""
            raise UserError(
                f"dataset {binf} is {'truncated' if bin_size < n_tokens * dtype.itemsize else 'too long'}: "
                f"{bin_size} bytes{partial}; its index {idx} says {n_tokens} {dtype.name} tokens "
                f"({n_tokens * dtype.itemsize} bytes)"
            )
        offsets = np.fromfile(idx_file, dtype="<u8", count=n_docs + 1)
        if (len(offsets) != n_docs + 1 or offsets[0] != 0 or offsets[-1] != n_tokens
                or (n_docs and bool(np.any(offsets[1:] < offsets[:-1])))):
            raise UserError(
                f"dataset index {idx} is corrupt: its document offsets do not run from 0 to {n_tokens} in order"
            )
        if n_tokens and max_token >= vocab_size:
            raise UserError(f"dataset index {idx} is corrupt: max token id {max_token} >= its vocab_size {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.max_token_id = int(max_token)  # the writer's claim: checks read the ids (check_vocab)
        self.doc_offsets = offsets
        if n_tokens:  # mapped from the descriptor checked above (the map keeps its own)
            self.tokens = np.memmap(bin_file, dtype=dtype, mode="r", shape=(int(n_tokens),))
        else:  # numpy cannot map an empty file
            self.tokens = np.zeros(0, dtype=dtype)

    def __len__(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    def doc(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        i %= len(self)
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]

    def document_of(self, position: int) -> int:
        """Index of the document holding token ``position``."""
        return int(np.searchsorted(self.doc_offsets, position, side="right")) - 1

    def check_vocab(self, model_vocab_size: int, ids: TokenRange | None = None) -> None:
        """Refuse ids that would index past the model's embedding table (or below it), or past this
        dataset's own vocabulary. ``ids`` is the range read from the ``.bin`` (see token_range: cached per
        file); without it the tokens are scanned now. The header's max_token is never trusted for this."""
        if not self.n_tokens:
            return
        ids = scan_token_range(self.tokens) if ids is None else ids
        binf = bin_path(self.prefix)
        limit = min(model_vocab_size, self.vocab_size)
        if ids.low < 0:
            raise UserError(
                f"dataset {binf} has token id {ids.low} (document {self.document_of(ids.low_at)}); valid ids are "
                f"0 to {limit - 1}: the file is corrupt, rebuild it with python -m megazero.data.preprocess"
            )
        if ids.high >= model_vocab_size:
            raise UserError(
                f"dataset {binf} has token id {ids.high} (document {self.document_of(ids.high_at)}), but "
                f"model.vocab_size {model_vocab_size} allows ids 0 to {model_vocab_size - 1}; set model.vocab_size "
                f"> {ids.high} or rebuild the data with the tokenizer the model uses"
            )
        if ids.high >= self.vocab_size:
            raise UserError(
                f"dataset {binf} has token id {ids.high} (document {self.document_of(ids.high_at)}), but its index "
                f"{index_path(self.prefix)} says the vocabulary has {self.vocab_size} pieces: the two files do not "
                "match; rebuild them with python -m megazero.data.preprocess"
            )
