"""Data for GPT pretraining: what the trainer asks for, built once and cached.

``build_data`` turns the ``data`` config section into a :class:`GPTData`:

* ``data.paths`` lists raw text (files or directories, see ``documents``) or
  preprocessed prefixes (``PREFIX.bin`` + ``PREFIX.idx``); empty means the
  built-in corpus (the Python standard library, see ``corpus``). An entry
  may be a mapping ``{path, weight, name}``: the sources are then blended by
  weight (``blend``), else by their sizes. Each source keeps its own
  validation split, evaluated and reported under its name.
* ``data.tokenizer`` is a Hugging Face ``tokenizer.json`` (the ids a model
  imported from the Hub was trained on), a sentencepiece ``.model``, or
  ``'train'`` (a BPE of ``model.vocab_size`` pieces trained on the raw text).
  ``Tokenizer.load`` tells the two files apart.
* Tokenizers, tokenised datasets and the built-in corpus go to
  ``data.cache_dir`` under names that hash their inputs (paths, sizes,
  modification times), the tokenizer and the vocabulary size, so a changed
  input is rebuilt and an unchanged one is reused. Files appear by atomic
  rename: a crash never leaves a half-written file under a final name.

Only the builder rank(s) write; every rank then waits on ``barrier`` and
reads the same files, memory-mapped: the datasets, and the index files that
order the samples (``blend``), so a rank's memory and start-up do not grow
with the corpus.

Every input is untrusted, the cache included: a bad file is a ``UserError``
naming it, raised while the data is opened, before a model is built. Token
ids are read (once per file, see ``token_range``) and checked against
``model.vocab_size``; a cached tokenizer or dataset that is damaged is built
again rather than used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megazero.data.blend import IndexFiles
from megazero.data.corpus import DEFAULT_MAX_BYTES, corpus_key, write_corpus
from megazero.data.documents import expand_inputs
from megazero.data.indexed import IndexedDataset, bin_path, index_path
from megazero.data.samples import GPTSamples, parse_split
from megazero.data.token_range import cached_token_range
from megazero.data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, train_tokenizer
from megazero.config.data_paths import entry_path, entry_weight, source_names
from megazero.errors import UserError

if TYPE_CHECKING:  # torch is imported where tensors are made, so preprocessing runs without it
    import torch

__all__ = ["GPTData", "build_data", "Tokenizer"]

# Bump when a change to tokenizer training or preprocessing alters the output,
# so that caches built by an older megazero are not reused.
_CACHE_FORMAT = 1


@dataclass
class GPTData:
    """The samples a run reads; every method is a pure function of its arguments."""

    tokenizer_path: Path
    train_samples: int
    val_samples: int
    seq_len: int
    samples: GPTSamples = field(repr=False, compare=False)

    @property
    def source_names(self) -> list[str]:
        """Each source's name (``val_loss/<name>``), in data.paths order."""
        return self.samples.names

    def train_microbatches(
        self, consumed_samples: int, dp_rank: int, dp: int, micro_batch: int, global_batch: int
    ) -> list[torch.Tensor]:
        """This DP rank's microbatches of the step that starts after ``consumed_samples`` samples.

        Each is a LongTensor ``(micro_batch, seq_len + 1)``: inputs ``[:, :-1]``, targets ``[:, 1:]``.
        """
        import torch

        ids = self.samples.train_batch_ids(consumed_samples, dp_rank, dp, micro_batch, global_batch)
        return [torch.from_numpy(self.samples.rows(chunk)) for chunk in ids]

    def val_microbatches(
        self, batch_index: int, dp_rank: int, dp: int, micro_batch: int, global_batch: int,
        source: int | None = None,
    ) -> list[torch.Tensor]:
        """This DP rank's microbatches of validation batch ``batch_index`` (unshuffled, wrapping), of every
        source's validation samples or only ``source``'s."""
        import torch

        ids = self.samples.val_batch_ids(batch_index, dp_rank, dp, micro_batch, global_batch, source)
        return [torch.from_numpy(self.samples.rows(chunk)) for chunk in ids]


@dataclass(frozen=True)
class _Source:
    """One entry of data.paths (or the built-in corpus) and where its tokens live."""

    label: str
    kind: str  # "text", "builtin" or "prefix"
    files: tuple[Path, ...]
    fingerprint: str
    prefix: Path
    name: str = "builtin"
    weight: float | None = None


@dataclass(frozen=True)
class _Plan:
    sources: tuple[_Source, ...]
    tokenizer: Path
    train_tokenizer: bool
    text_key: str
    builtin_max_bytes: int


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
    plan = _plan(cfg_data, vocab_size, builtin_max_bytes)
    cache = Path(cfg_data.cache_dir)
    if is_builder:
        with _cache_errors(cache):
            _check_cache_dir(cache)
            _build(plan, vocab_size)
    barrier()
    with _cache_errors(cache):
        return _load(plan, vocab_size, seq_len, seed, cfg_data.split, cache, is_builder, train_samples)


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


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([_CACHE_FORMAT, *parts], default=str).encode()).hexdigest()[:16]


def _files_fingerprint(files: list[Path]) -> str:
    stats = []
    for f in files:
        try:
            st = f.stat()
        except OSError as e:  # a dangling link, a file removed while listing
            raise UserError(f"data.paths: cannot read {f} ({e.strerror})") from None
        # the inode and its ctime too: a same-size rewrite that puts the old mtime back (cp -p, rsync -t)
        # still moves the ctime, which no writer can set. Not st_dev: NFS clients number it each their own way
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return _digest("files", stats)


def _as_prefix(path: Path) -> Path | None:
    """The dataset prefix ``path`` names, if it names one (``P``, ``P.bin`` or ``P.idx``)."""
    if index_path(path).exists() or bin_path(path).exists():
        return path
    if path.suffix in (".bin", ".idx") and path.exists():
        return path.with_suffix("")
    return None


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(label).stem)[:40] or "data"


def _plan(cfg_data: Any, vocab_size: int, builtin_max_bytes: int) -> _Plan:
    cache = Path(cfg_data.cache_dir)
    text_key = getattr(cfg_data, "text_key", "text")
    sources: list[_Source] = []
    if not cfg_data.paths:
        key = corpus_key(builtin_max_bytes)
        corpus = cache / f"corpus-{key}.jsonl"
        sources.append(_Source("the built-in corpus", "builtin", (corpus,), f"builtin-{key}", Path()))
    for entry, name in zip(cfg_data.paths, source_names(list(cfg_data.paths))):
        raw, weight = entry_path(entry), entry_weight(entry)
        prefix = _as_prefix(Path(raw))
        if prefix is not None:
            sources.append(_Source(str(raw), "prefix", (), "", prefix, name, weight))
        else:
            files = expand_inputs([raw], "data.paths")
            sources.append(_Source(str(raw), "text", tuple(files), _files_fingerprint(files), Path(), name, weight))

    if cfg_data.tokenizer == "train":
        prefixes = [s.label for s in sources if s.kind == "prefix"]
        if prefixes:
            raise UserError(
                f"data.tokenizer: 'train' cannot be used with the preprocessed dataset {prefixes[0]} in data.paths; "
                "set data.tokenizer to the tokenizer file (.model or tokenizer.json) that dataset was built with"
            )
        if vocab_size < MIN_VOCAB_SIZE:
            raise UserError(
                f"model.vocab_size {vocab_size} is too small for data.tokenizer 'train'; use at least {MIN_VOCAB_SIZE}"
            )
        tok_fingerprint = _digest("tokenizer", vocab_size, text_key, [s.fingerprint for s in sources])
        tokenizer = cache / f"tokenizer-{vocab_size}-{tok_fingerprint}.model"
    else:
        tokenizer = Path(cfg_data.tokenizer)
        if not tokenizer.is_file():
            raise UserError(
                f"data.tokenizer: {tokenizer} does not exist; give a Hugging Face tokenizer.json, "
                "a sentencepiece .model file or 'train'"
            )
        tokenises = any(s.kind != "prefix" for s in sources)
        _check_tokenizer(Tokenizer.load(tokenizer, "data.tokenizer"), vocab_size, tokenises)
        # the file's bytes, whichever kind: they alone decide the ids (the kind is read from them too)
        tok_fingerprint = hashlib.sha256(tokenizer.read_bytes()).hexdigest()[:16]

    planned = []
    for s in sources:
        if s.kind != "prefix":
            key = _digest("dataset", s.fingerprint, tok_fingerprint, vocab_size, text_key)
            prefix = cache / f"data-{_slug(s.label) if s.kind == 'text' else 'builtin'}-{key}"
            s = _Source(s.label, s.kind, s.files, s.fingerprint, prefix, s.name, s.weight)
        planned.append(s)
    return _Plan(tuple(planned), tokenizer, cfg_data.tokenizer == "train", text_key, builtin_max_bytes)


def _check_tokenizer(tok: Tokenizer, vocab_size: int, tokenises: bool) -> None:
    """A given tokenizer must fit the model and, when it will tokenise text, separate documents.

    Checked on every rank before any build, so a bad file fails everywhere at once (see ``build_data``).
    """
    if tok.vocab_size > vocab_size:
        raise UserError(
            f"data.tokenizer {tok.path} has {tok.vocab_size} pieces, more than model.vocab_size {vocab_size}; "
            f"set model.vocab_size >= {tok.vocab_size} (a larger vocabulary is fine: the extra rows go unused)"
        )
    if tokenises and tok.eos_id < 0:
        raise UserError(f"data.tokenizer {tok.path} has no end-of-text token ({tok.eos_help}), so documents "
                        "could not be separated; give a tokenizer that has one")


def _build(plan: _Plan, vocab_size: int) -> None:
    """Make what the cache lacks; a cached file that is damaged is made again, never trusted."""
    # Imported here: importing it with the package would make `python -m megazero.data.preprocess`
    # find the module already loaded (runpy warns about that).
    from megazero.data.preprocess import preprocess

    stale_tokenizer = plan.train_tokenizer and not _tokenizer_ok(plan.tokenizer, vocab_size)
    for s in plan.sources:  # the corpus file is only an input to builds: written afresh for each
        if s.kind == "builtin" and (stale_tokenizer or not _dataset_ok(s.prefix)):
            write_corpus(s.files[0], plan.builtin_max_bytes)
    if stale_tokenizer:
        text_files = [f for s in plan.sources for f in s.files]
        train_tokenizer(text_files, vocab_size, plan.tokenizer.with_suffix(""), text_key=plan.text_key)
    tokenizer = Tokenizer.load(plan.tokenizer)
    for s in plan.sources:
        if s.kind != "prefix" and not _dataset_ok(s.prefix, tokenizer.vocab_size):
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
    if not path.exists():
        return False
    try:
        return Tokenizer.load(path).vocab_size == vocab_size
    except UserError:
        return False


def _dataset_ok(prefix: Path, vocab_size: int | None = None) -> bool:
    """A cached dataset that opens (sizes, header, offsets) and was built for this vocabulary."""
    if not index_path(prefix).exists():
        return False
    try:
        ds = IndexedDataset(prefix)
    except UserError:
        return False
    return vocab_size is None or ds.vocab_size == vocab_size


def _load(plan: _Plan, vocab_size: int, seq_len: int, seed: int, split: str, cache: Path,
          is_builder: bool, train_samples: int) -> GPTData:
    built = [plan.tokenizer] if plan.train_tokenizer else []
    built += [index_path(s.prefix) for s in plan.sources if s.kind != "prefix"]
    for path in built:
        if not path.exists():
            raise UserError(
                f"data cache {path} is missing after the building rank finished; "
                f"data.cache_dir {cache} must be a directory every rank can read"
            )
    tokenizer = Tokenizer.load(plan.tokenizer)
    datasets = []
    for s in plan.sources:
        ds = IndexedDataset(s.prefix)
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
    weights = [s.weight for s in plan.sources]
    samples = GPTSamples([(ds.tokens, ds.doc_offsets) for ds in datasets], seq_len, seed, split,
                         names=[s.name for s in plan.sources], labels=[s.label for s in plan.sources],
                         weights=None if weights[0] is None else weights, files=IndexFiles(cache, is_builder))
    if is_builder:
        samples.order.prebuild(train_samples)
    return GPTData(plan.tokenizer, samples.n_train, samples.n_val, seq_len, samples)
