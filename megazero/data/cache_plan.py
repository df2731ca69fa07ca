"""What the data cache must hold for a ``data`` config, named by hashes of its inputs: the plan that
``megazero.data.build`` builds and loads.

Tokenizers, tokenised datasets and the built-in corpus go to ``data.cache_dir`` under names that hash
their inputs (paths, sizes, modification times, inodes), the tokenizer and the vocabulary size, so a
changed input is rebuilt and an unchanged one is reused. A given tokenizer is opened and checked here,
on every rank, before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megazero.config.data_paths import entry_path, entry_weight, source_names
from megazero.data.corpus import corpus_key
from megazero.data.documents import expand_inputs, refuse_repeats
from megazero.data.indexed import bin_path, index_path
from megazero.data.regular_files import open_regular
from megazero.data.tokenizer import MIN_VOCAB_SIZE, Tokenizer
from megazero.errors import UserError

# Bump when a change to tokenizer training or preprocessing alters the output,
# so that caches built by an older megazero are not reused.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class Source:
    """One entry of data.paths (or the built-in corpus) and where its tokens live."""

    label: str
    kind: str  # "text", "builtin" or "prefix"
    files: tuple[Path, ...]
    fingerprint: str
    prefix: Path
    name: str = "builtin"
    weight: float | None = None


@dataclass(frozen=True)
class CachePlan:
    """Every source with its cache prefix, the tokenizer file (to train, or given), and how text is read."""

    sources: tuple[Source, ...]
    tokenizer: Path
    train_tokenizer: bool
    text_key: str
    builtin_max_bytes: int


def digest(*parts: Any) -> str:
    """A short hash of ``parts`` and the cache format: the part of a cache file's name that says what made it."""
    return hashlib.sha256(json.dumps([CACHE_FORMAT, *parts], default=str).encode()).hexdigest()[:16]


def content_fingerprint(path: Path) -> str:
    """The first 16 hex digits of the SHA-256 of a regular file's bytes, read a MiB at a time: what names a given
    tokenizer in the cache, and what a checkpoint records of the tokenizer its ids are of."""
    h = hashlib.sha256()
    with open_regular(path) as f:  # a FIFO in its place: an OSError, never a wait
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def files_fingerprint(files: list[Path]) -> str:
    """What identifies these files as they are now (names, sizes, times, inodes), without reading them."""
    stats = []
    for f in files:
        try:
            st = f.stat()
        except OSError as e:  # a dangling link, a file removed while listing
            raise UserError(f"data.paths: cannot read {f} ({e.strerror})") from None
        # the inode and its ctime too: a same-size rewrite that puts the old mtime back (cp -p, rsync -t)
        # still moves the ctime, which no writer can set. Not st_dev: NFS clients number it each their own way
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return digest("files", stats)


def _as_prefix(path: Path) -> Path | None:
    """The dataset prefix ``path`` names, if it names one (``P``, ``P.bin`` or ``P.idx``)."""
    if index_path(path).exists() or bin_path(path).exists():
        return path
    if path.suffix in (".bin", ".idx") and path.exists():
        return path.with_suffix("")
    return None


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(label).stem)[:40] or "data"


def plan_cache(cfg_data: Any, vocab_size: int, builtin_max_bytes: int) -> CachePlan:
    """The sources of ``cfg_data`` (``paths``, ``tokenizer``, ``cache_dir``, ``text_key``) and the cache names
    they go under; a bad path, tokenizer or vocabulary size fails here, on every rank, before any build."""
    cache = Path(cfg_data.cache_dir)
    text_key = getattr(cfg_data, "text_key", "text")
    sources: list[Source] = []
    if not cfg_data.paths:
        key = corpus_key(builtin_max_bytes)
        corpus = cache / f"corpus-{key}.jsonl"
        sources.append(Source("the built-in corpus", "builtin", (corpus,), f"builtin-{key}", Path()))
    entries: list[tuple[str, Path, list[Path]]] = []  # what each entry reads: none may read a file again
    for i, (entry, name) in enumerate(zip(cfg_data.paths, source_names(list(cfg_data.paths)))):
        raw, weight = entry_path(entry), entry_weight(entry)
        prefix = _as_prefix(Path(raw))
        if prefix is not None:
            sources.append(Source(str(raw), "prefix", (), "", prefix, name, weight))
            entries.append((f"data.paths[{i}] {raw!r}", prefix, []))
        else:
            files = expand_inputs([raw], "data.paths")
            entries.append((f"data.paths[{i}] {raw!r}", Path(raw), files))
            sources.append(Source(str(raw), "text", tuple(files), files_fingerprint(files), Path(), name, weight))
    refuse_repeats(entries)

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
        tok_fingerprint = digest("tokenizer", vocab_size, text_key, [s.fingerprint for s in sources])
        tokenizer = cache / f"tokenizer-{vocab_size}-{tok_fingerprint}.model"
    else:
        tokenizer = Path(cfg_data.tokenizer)
        if not os.path.lexists(tokenizer):
            raise UserError(
                f"data.tokenizer: {tokenizer} does not exist; give a Hugging Face tokenizer.json, "
                "a sentencepiece .model file or 'train'"
            )
        tokenises = any(s.kind != "prefix" for s in sources)
        given = Tokenizer.load(tokenizer, "data.tokenizer")  # a FIFO or a huge file: one line, never read
        check_tokenizer(given, vocab_size, tokenises)
        # the file's bytes, whichever kind: they alone decide the ids (the kind is read from them too)
        tok_fingerprint = given.sha256[:16]  # = content_fingerprint(tokenizer), from the bytes already read

    planned = []
    for s in sources:
        if s.kind != "prefix":
            key = digest("dataset", s.fingerprint, tok_fingerprint, vocab_size, text_key)
            prefix = cache / f"data-{_slug(s.label) if s.kind == 'text' else 'builtin'}-{key}"
            s = Source(s.label, s.kind, s.files, s.fingerprint, prefix, s.name, s.weight)
        planned.append(s)
    return CachePlan(tuple(planned), tokenizer, cfg_data.tokenizer == "train", text_key, builtin_max_bytes)


def check_tokenizer(tok: Tokenizer, vocab_size: int, tokenises: bool) -> None:
    """A given tokenizer must fit the model and, when it will tokenise text, separate documents.

    Checked on every rank before any build, so a bad file fails everywhere at once (see ``build.build_data``).
    """
    if tok.vocab_size > vocab_size:
        raise UserError(
            f"data.tokenizer {tok.path} has {tok.vocab_size} pieces, more than model.vocab_size {vocab_size}; "
            f"set model.vocab_size >= {tok.vocab_size} (a larger vocabulary is fine: the extra rows go unused)"
        )
    if tokenises and tok.eos_id < 0:
        raise UserError(f"data.tokenizer {tok.path} has no end-of-text token ({tok.eos_help}), so documents "
                        "could not be separated; give a tokenizer that has one")
