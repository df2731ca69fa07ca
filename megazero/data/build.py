"""Build (on the builder ranks) or find the cached data, wait on the barrier, load it: ``build_data``.

Only the builder rank(s) write; every rank then waits on ``barrier`` and
reads the same files, memory-mapped: the datasets, and the index files that
order the samples (``blend``), so a rank's memory and start-up do not grow
with the corpus. Files appear by atomic rename: a crash never leaves a
half-written file under a final name. What the cache holds, and under which
names, is ``cache_plan``'s; every cache file is opened only as a regular file, links not followed
(``regular_files``), so a FIFO, socket, link or empty folder in a cache file's place is rebuilt, never
waited on or followed.

Every input is untrusted, the cache included: a bad file is a ``UserError``
naming it, raised while the data is opened, before a model is built. Token
ids are read (once per file, see ``token_range``) and checked against
``model.vocab_size``; a cached tokenizer or dataset that is damaged is built
again rather than used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from megazero.data.blend import IndexFiles
from megazero.data.cache_plan import CachePlan, Source, files_fingerprint, plan_cache
from megazero.data.corpus import DEFAULT_MAX_BYTES, write_corpus
from megazero.data.gpt_data import GPTData, SourceStamp
from megazero.data.indexed import IndexedDataset, bin_path, index_path
from megazero.data.regular_files import make_room
from megazero.data.samples import GPTSamples, parse_split
from megazero.data.token_range import cached_token_range
from megazero.data.tokenizer import Tokenizer, train_tokenizer
from megazero.errors import UserError


def build_data(
    cfg_data: Any,
    vocab_size: int,
    seq_len: int,
    seed: int,
    is_builder: bool,
    barrier: Callable[[], None],
    *,
    builtin_max_bytes: int = DEFAULT_MAX_BYTES,
    train_samples: int = 0,
) -> GPTData:
    """Build (on ``is_builder`` ranks) or find the cached data, wait on ``barrier``, load it.

    ``cfg_data`` needs ``paths``, ``tokenizer``, ``split`` and ``cache_dir``;
    an optional ``text_key`` names the text field of ``.jsonl``/``.parquet`` records.
    ``builtin_max_bytes`` caps the size of the built-in corpus. ``train_samples`` (the run's
    steps x global batch) is how far the builder writes the sample order's index files ahead.
    Every rank validates the config before the barrier, so a bad value fails
    everywhere at once instead of leaving ranks waiting on a builder that died.
    """
    parse_split(cfg_data.split)
    plan = plan_cache(cfg_data, vocab_size, builtin_max_bytes)
    cache = Path(cfg_data.cache_dir)
    if is_builder:
        with _cache_errors(cache):
            _check_cache_dir(cache)
            _build(plan, vocab_size)
    barrier()
    with _cache_errors(cache):
        documents = getattr(cfg_data, "document_mask", False) or getattr(cfg_data, "reset_positions", False)
        return _load(plan, vocab_size, seq_len, seed, cfg_data.split, cache, is_builder, train_samples, documents)


@contextmanager
def _cache_errors(cache: Path) -> Iterator[None]:
    """Input files report their own errors; an OSError left over is the cache's."""
    try:
        yield
    except OSError as e:
        raise UserError(f"data.cache_dir {cache}: cannot write {e.filename or ''} ({e.strerror}); "
                        "give a folder megazero may write") from None


def _check_cache_dir(cache: Path) -> None:
    """A cache that is a file or cannot be written fails now, naming itself, not halfway through a build."""
    if cache.exists() and not cache.is_dir():
        raise UserError(f"data.cache_dir {cache} is a file, not a folder; give a folder megazero may write")
    cache.mkdir(parents=True, exist_ok=True)
    probe = cache / f".write-test-{os.getpid()}-{os.urandom(4).hex()}"
    probe.touch()
    probe.unlink()


def _build(plan: CachePlan, vocab_size: int) -> None:
    """Make what the cache lacks; a cached file that is damaged (a FIFO, a link, a folder in its place
    included: ``regular_files``) is made again, never trusted."""
    # Imported here: importing it with the package would make `python -m megazero.data.preprocess`
    # find the module already loaded (runpy warns about that).
    from megazero.data.preprocess import preprocess

    stale_tokenizer = plan.train_tokenizer and not _tokenizer_ok(plan.tokenizer, vocab_size)
    written: set[Path] = set()  # the corpus file is only an input to builds: written afresh for each

    def write_builtin(s: Source) -> None:
        if s.kind == "builtin" and s.files[0] not in written:
            make_room(s.files[0])
            write_corpus(s.files[0], plan.builtin_max_bytes)
            written.add(s.files[0])

    for s in plan.sources:
        if s.kind == "builtin" and (stale_tokenizer or not _dataset_ok(s.prefix)):
            write_builtin(s)
    if stale_tokenizer:
        text_files = [f for s in plan.sources for f in s.files]
        make_room(plan.tokenizer)
        train_tokenizer(text_files, vocab_size, plan.tokenizer.with_suffix(""), text_key=plan.text_key)
    tokenizer = Tokenizer.load(plan.tokenizer, links=not plan.train_tokenizer)
    for s in plan.sources:
        if s.kind != "prefix" and not _dataset_ok(s.prefix, tokenizer.vocab_size):
            write_builtin(s)
            make_room(bin_path(s.prefix))
            make_room(index_path(s.prefix))
            preprocess(list(s.files), tokenizer, s.prefix, plan.text_key, what="data.paths",
                       workers=_preprocess_workers(s.files), progress=True)


# Input below which one process tokenises: spawning workers (each imports the tokenizer) costs seconds.
_PARALLEL_BYTES = 64 << 20


def _preprocess_workers(files: tuple[Path, ...]) -> int:
    """The builder's tokenising processes: this node's cores (up to 16) for a corpus worth spreading."""
    if sum(f.stat().st_size for f in files) < _PARALLEL_BYTES:
        return 1
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _tokenizer_ok(path: Path, vocab_size: int) -> bool:
    """A trained tokenizer in the cache that opens (a regular file, not a link) and has this vocabulary."""
    try:
        return Tokenizer.load(path, links=False).vocab_size == vocab_size
    except UserError:
        return False


def _dataset_ok(prefix: Path, vocab_size: int | None = None) -> bool:
    """A cached dataset that opens (regular files, not links; sizes, header, offsets) and was built for this
    vocabulary."""
    try:
        ds = IndexedDataset(prefix, links=False)
    except UserError:
        return False
    return vocab_size is None or ds.vocab_size == vocab_size


def _load(plan: CachePlan, vocab_size: int, seq_len: int, seed: int, split: str, cache: Path,
          is_builder: bool, train_samples: int, documents: bool = False) -> GPTData:
    built = [plan.tokenizer] if plan.train_tokenizer else []
    built += [index_path(s.prefix) for s in plan.sources if s.kind != "prefix"]
    for path in built:
        if not path.exists():
            raise UserError(
                f"data cache {path} is missing after the building rank finished; "
                f"data.cache_dir {cache} must be a directory every rank can read"
            )
    tokenizer = Tokenizer.load(plan.tokenizer, links=not plan.train_tokenizer)
    datasets = []
    for s in plan.sources:
        ds = IndexedDataset(s.prefix, links=s.kind == "prefix")
        if ds.vocab_size != tokenizer.vocab_size:
            what = f"data.paths: dataset {s.prefix}" if s.kind == "prefix" else f"data cache {s.prefix}"
            raise UserError(
                f"{what} was built for a {ds.vocab_size}-piece vocabulary but data.tokenizer "
                f"{plan.tokenizer} has {tokenizer.vocab_size} pieces; give the tokenizer it was built with"
            )
        # the ids themselves, read once per file (cached): the header's max_token is only a claim
        ids = cached_token_range(ds.tokens, bin_path(s.prefix), cache, write=is_builder) if ds.n_tokens else None
        ds.check_vocab(vocab_size, ids)
        datasets.append(ds)
    if documents:
        check_document_boundaries(plan, tokenizer.eos_id, datasets)
    weights = [s.weight for s in plan.sources]
    samples = GPTSamples([(ds.tokens, ds.doc_offsets) for ds in datasets], seq_len, seed, split,
                         names=[s.name for s in plan.sources], labels=[s.label for s in plan.sources],
                         weights=None if weights[0] is None else weights, files=IndexFiles(cache, is_builder))
    if is_builder:
        samples.order.prebuild(train_samples)
    return GPTData(plan.tokenizer, samples.n_train, samples.n_val, seq_len, samples,
                   tokenizer_fingerprint=tokenizer.sha256[:16], stamps=_stamps(plan), eos_id=tokenizer.eos_id)


_BOUNDARY_CHUNK = 1 << 20  # documents whose last token is read at once: bounds memory at any source size


def check_document_boundaries(plan: CachePlan, eos: int, datasets: list[IndexedDataset]) -> None:
    """Document masking finds documents by their end-of-text token: every source's documents must end with it
    (megazero's preprocessing appends it; a dataset built elsewhere may not have). Every document is read, so a
    bad one anywhere in a source is refused, not masked together with its neighbour."""
    key = "data.document_mask"
    if eos < 0:
        raise UserError(f"{key}: data.tokenizer {plan.tokenizer} has no end-of-text token, so a packed sample has "
                        "no document boundaries; give a tokenizer that has one or set data.document_mask=false")
    for s, ds in zip(plan.sources, datasets):
        bad = first_unended_document(ds.doc_offsets, ds.tokens, eos)
        if bad is not None:
            which = "it has no non-empty one" if bad < 0 else f"document {bad} of {len(ds)} (from 0) does not"
            raise UserError(f"{key}: data.paths source {s.label} has no document boundaries (its documents must "
                            f"end with the end-of-text token {eos}, and {which}); preprocess it with megazero or "
                            "set data.document_mask=false")


def first_unended_document(offsets: np.ndarray, tokens: np.ndarray, eos: int) -> int | None:
    """The index of the first non-empty document whose last token is not ``eos``, -1 when no document has a
    token, else None: one vectorised pass over the whole index, ``_BOUNDARY_CHUNK`` documents at a time, so
    the check is fast and its memory bounded however large the source (empty documents carry no boundary)."""
    n_docs = len(offsets) - 1
    seen = False
    for lo in range(0, n_docs, _BOUNDARY_CHUNK):
        hi = min(lo + _BOUNDARY_CHUNK, n_docs)
        starts = np.asarray(offsets[lo:hi], dtype=np.int64)
        stops = np.asarray(offsets[lo + 1:hi + 1], dtype=np.int64)
        filled = np.flatnonzero(stops > starts)
        if len(filled) == 0:
            continue
        seen = True
        wrong = np.flatnonzero(np.asarray(tokens[stops[filled] - 1]) != eos)
        if len(wrong):
            return lo + int(filled[wrong[0]])
    return None if seen else -1


def _stamps(plan: CachePlan) -> tuple[SourceStamp, ...]:
    """Each data.paths entry as built, for a checkpoint to record: the fingerprint its cache name was made of
    (text files), or the dataset files' (a preprocessed dataset, by their stat alone)."""
    stamps = []
    for s in plan.sources:
        if s.kind == "text":
            stamps.append(SourceStamp(os.path.realpath(s.label), s.fingerprint, len(s.files)))
        elif s.kind == "prefix":
            fingerprint = files_fingerprint([bin_path(s.prefix), index_path(s.prefix)])
            stamps.append(SourceStamp(os.path.realpath(s.label), fingerprint, None))
    return tuple(stamps)
