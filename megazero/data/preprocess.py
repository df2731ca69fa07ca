"""Tokenise raw text into an indexed dataset.

    python -m megazero.data.preprocess --input FILE_OR_DIR [...] \\
        --tokenizer MODEL.model|tokenizer.json --output PREFIX [--text-key text] [--workers N]

Each document is followed by the tokenizer's EOS id, so that samples cut
from the concatenated stream show the model where one document ends and an
unrelated one begins (as in GPT-2 training, Radford et al., 2019).

``--workers N`` encodes with N processes: this process reads the documents and
groups them into batches of about ``_BATCH_CHARS`` characters, the workers
encode the batches, and the results are written in input order, so the
``.bin``/``.idx`` bytes are the same for every N. At most
``_IN_FLIGHT_PER_WORKER`` batches per worker are read ahead, so memory stays
bounded on any corpus. Workers are spawned, never forked: the caller (pretrain)
may hold torch and its threads, which a fork would copy in an unusable state.
The workers belong to the process that started them: they ignore SIGINT and
SIGTERM (sent to a whole process group by Ctrl-C or a cluster's scheduler, they
would die halfway through handing back a batch); that process stops them (on an
error or a stop signal, once the batches they are encoding are done), and they
end by themselves when it is gone, however it went.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from megazero.data.documents import expand_inputs, iter_documents, name_paths
from megazero.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazero.data.tokenizer import Tokenizer
from megazero.errors import UserError

# Text per batch: large enough that encoding dwarfs handing a batch to a worker, small enough that a
# corpus of a few batches per worker still spreads over the workers. Read at call time (tests lower it).
_BATCH_CHARS = 1_000_000
# Batches queued per worker: one being encoded, one waiting, so a worker never idles while this process reads.
_IN_FLIGHT_PER_WORKER = 2
# How often a worker looks whether the process that started it is still there.
_PARENT_POLL_S = 0.5

# (ids, document lengths, input bytes read through this batch); ids hold each document followed by the EOS
_Encoded = tuple[np.ndarray, np.ndarray, int]


def preprocess(
    inputs: Sequence[str | Path],
    tokenizer: Tokenizer | str | Path,
    output_prefix: str | Path,
    text_key: str = "text",
    *,
    what: str = "input",
    workers: int = 1,
    progress: bool = False,
) -> Path:
    """Write ``output_prefix.bin/.idx`` from the documents of ``inputs``; return the prefix.

    ``what`` names the setting the inputs came from, for error messages. ``workers`` processes encode
    (1: this process, over sentencepiece's threads); the output is the same for any number.
    ``progress`` draws a bar on stderr (input bytes, ETA, documents/s and tokens/s).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"workers={workers!r} is invalid; give a positive integer (the tokenising processes)")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    if tok.eos_id < 0:
        raise UserError(f"tokenizer {tok.path} has no end-of-text token ({tok.eos_help}); "
                        "documents could not be separated")
    files = expand_inputs(inputs, what)
    batches = _batches(files, text_key)
    encoded = _encode_here(tok, batches) if workers == 1 else _encode_in_workers(tok, batches, workers)
    with IndexedDatasetBuilder(output_prefix, tok.vocab_size) as builder, closing(encoded), \
            _Progress(files, progress) as bar:
        n_tokens = 0
        for ids, lengths, position in encoded:
            start = 0
            for end in np.cumsum(lengths).tolist():
                builder.add_document(ids[start:end])
                start = end
            n_tokens += int(ids.size)
            bar.advance(position, len(lengths), int(ids.size))
        if n_tokens == 0:
            raise UserError(f"{what}: no text in {name_paths(files)} (every document is empty)")
        return builder.finalize()


def _batches(files: list[Path], text_key: str) -> Iterator[tuple[list[str], int]]:
    """Documents grouped so each encode call gets many, with the input bytes read through each group.

    The byte count is exact at every file's end and estimated inside a file (characters of text
    read so far, at most the file's size), so a progress bar over input bytes moves within a big file.
    """
    batch: list[str] = []
    size = done = position = 0
    for path in files:
        file_size = path.stat().st_size
        chars = 0
        for doc in iter_documents([path], text_key):
            batch.append(doc)
            size += len(doc)
            chars += len(doc)
            position = done + min(chars, file_size)
            if size >= _BATCH_CHARS:
                yield batch, position
                batch, size = [], 0
        done += file_size
        position = done
    if batch or position:
        yield batch, position


def _encode(tok: Tokenizer, docs: list[str], threads: int) -> tuple[np.ndarray, np.ndarray]:
    """All documents' ids, each followed by the EOS, as one array plus the lengths: two buffers cross a
    process boundary far faster than a list per document."""
    if not docs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    encoded = tok.encode_batch(docs, num_threads=threads)
    eos = tok.eos_id
    for ids in encoded:
        ids.append(eos)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def _encode_here(tok: Tokenizer, batches: Iterator[tuple[list[str], int]]) -> Iterator[_Encoded]:
    """One process: sentencepiece spreads each batch over all cores by itself."""
    for docs, position in batches:
        yield (*_encode(tok, docs, threads=0), position)


def _encode_in_workers(tok: Tokenizer, batches: Iterator[tuple[list[str], int]], workers: int) -> Iterator[_Encoded]:
    """Encode over ``workers`` spawned processes; yield in input order, with few batches in flight.

    A bounded queue of futures rather than ``Pool.imap``: imap's feeder thread reads the whole input
    ahead (all of a 1 TB corpus into memory). A worker killed from outside (out of memory) breaks the
    pool with an error instead of the hang ``multiprocessing.Pool`` would give.
    """
    context = multiprocessing.get_context("spawn")
    limit = workers * _IN_FLIGHT_PER_WORKER
    pending: deque[tuple[int, Future]] = deque()
    source = (str(tok.path), tok.links)  # each worker opens the file as this process did
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=source) as pool:
        try:
            for docs, position in batches:
                pending.append((position, pool.submit(_encode_in_worker, *source, docs)))
                if len(pending) >= limit:
                    position, future = pending.popleft()
                    yield (*future.result(), position)
            while pending:
                position, future = pending.popleft()
                yield (*future.result(), position)
        except BrokenProcessPool:
            raise UserError(f"one of {workers} tokenising processes stopped unexpectedly (killed? out of memory?); "
                            "run again with fewer workers") from None
        finally:
            for _, future in pending:
                future.cancel()


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(path: str, links: bool) -> Tokenizer:
    """The tokenizer of a worker process, loaded once per process (never called in the main one)."""
    return Tokenizer.load(path, links=links)


def _start_worker(path: str, links: bool) -> None:
    """Pool initializer: one thread per worker (the workers are the parallelism), tokenizer loaded once; the
    stop signals left to the parent, and a watch on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent.pid,), name="parent-watch", daemon=True).start()
    os.environ["RAYON_NUM_THREADS"] = "1"  # Hugging Face tokenizers' pool, created at its first encode
    try:
        _worker_tokenizer(path, links)
    except UserError:
        pass  # raised again by the first batch, so the caller reports it: a failing initializer breaks the pool


def _exit_with_parent(parent: int) -> None:
    """End this worker once the process that started it is gone (killed, even by SIGKILL): the task queue
    never tells, and a worker would wait on it for ever."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _encode_in_worker(path: str, links: bool, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One batch in a worker. A library panic is already a UserError here (``hf_tokenizer``): the panic
    itself could not be sent back (pyo3's exception type does not pickle)."""
    return _encode(_worker_tokenizer(path, links), docs, threads=1)


class _Progress:
    """A tqdm bar over input bytes (so it has an ETA) with documents and tokens per second; or nothing."""

    def __init__(self, files: list[Path], enabled: bool):
        self._bar: Any = None
        self._docs = self._tokens = 0
        if not enabled:
            return
        from tqdm import tqdm  # here, not at the top: worker processes never draw

        total = sum(path.stat().st_size for path in files)
        # into a log file (not a terminal) every 30 s rather than every 0.1 s, and only once 30 s have passed:
        # a short build writes nothing there, so an error stays the one line on stderr
        tty = sys.stderr.isatty()
        self._bar = tqdm(total=total, desc="tokenising", unit="B", unit_scale=True, unit_divisor=1024,
                         file=sys.stderr, dynamic_ncols=True, mininterval=0.1 if tty else 30.0,
                         delay=0 if tty else 30.0)

    def advance(self, position: int, docs: int, tokens: int) -> None:
        if self._bar is None:
            return
        self._docs += docs
        self._tokens += tokens
        elapsed = max(self._bar.format_dict["elapsed"], 1e-9)
        size = self._bar.format_sizeof
        self._bar.set_postfix_str(f"{size(self._docs)} docs, {size(self._docs / elapsed)} docs/s, "
                                  f"{size(self._tokens)} tokens, {size(self._tokens / elapsed)} tok/s", refresh=False)
        self._bar.update(position - self._bar.n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._bar is not None:
            self._bar.leave = exc_type is None  # on an error a terminal shows the one error line, not a dead bar
            self._bar.close()


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{flag} {text!r} is invalid; give a positive integer (the tokenising processes, "
                        f"at most the {os.cpu_count() or 1} cores here to be useful)")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.data.preprocess",
        description="Tokenise .txt (one document per file), .jsonl/.jsonl.gz/.jsonl.zst (one document per line) "
                    "and .parquet (one per row) into PREFIX.bin/.idx.",
    )
    parser.add_argument("--input", nargs="+", required=True, help=".txt, .jsonl(.gz/.zst), .parquet files or directories of them")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model or Hugging Face tokenizer.json file")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--text-key", "--json-key", dest="text_key", default="text",
                        help="field of each .jsonl record (column of a .parquet file) that holds the text")
    parser.add_argument("--workers", default="1", help="tokenising processes (default 1); the output is the same "
                        "for any number")
    args = parser.parse_args(argv)
    try:
        workers = _positive_int(args.workers, "--workers")
        if Path(args.output).is_dir() or args.output.endswith(("/", os.sep)):
            raise UserError(f"--output {args.output!r} is a folder; give a prefix inside it, such as "
                            f"{str(Path(args.output) / 'corpus')!r} (writes corpus.bin and corpus.idx there)")
        tokenizer = Tokenizer.load(args.tokenizer, "--tokenizer")
        # a bar on a terminal; scripts reading stderr get only the error line (or nothing)
        prefix = preprocess(args.input, tokenizer, args.output, args.text_key, what="--input", workers=workers,
                            progress=sys.stderr.isatty())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ds = IndexedDataset(prefix)
    print(f"wrote {prefix}.bin and {prefix}.idx: {len(ds)} documents, {ds.n_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
