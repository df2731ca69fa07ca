"""Tokenizers: the interface the data pipeline uses, sentencepiece BPE (training and encode/decode).

A Hugging Face ``tokenizer.json`` is the other implementation, in ``hf_tokenizer``;
``Tokenizer.load`` picks between them.

Kudo & Richardson, "SentencePiece: A simple and language independent subword
tokenizer and detokenizer for Neural Text Processing", EMNLP 2018; the merges
are byte-pair encoding (Sennrich et al., "Neural Machine Translation of Rare
Words with Subword Units", ACL 2016).

The tokenizer is trained to round-trip any text exactly: identity
normalisation, whitespace kept as written (code indentation matters), and
byte fallback so a character never seen in training still encodes (as its
UTF-8 bytes) instead of becoming ``<unk>``.
"""

from __future__ import annotations

import io
import os
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from megazero.data.documents import expand_inputs, iter_documents, name_paths
from megazero.errors import UserError

# Fixed rather than os.cpu_count(): the thread count is written into the model
# file, and the cache keys of preprocessed data hash that file.
_TRAIN_THREADS = 4
# Special pieces (unk, bos, eos) plus the 256 byte-fallback pieces.
MIN_VOCAB_SIZE = 3 + 256 + 1
# Sentencepiece drops longer sentences during training; cut lines to fit.
_MAX_LINE_CHARS = 4096


class Tokenizer(ABC):
    """What the data pipeline asks of a tokenizer, whichever library implements it.

    ``Tokenizer.load(path)`` is the one place that picks the implementation: a
    Hugging Face ``tokenizer.json`` (so a model imported from the Hub keeps the
    ids it was trained on) or a sentencepiece ``.model`` (trained by megazero
    or brought along). Callers never branch on the kind.
    """

    path: Path

    @classmethod
    def load(cls, path: str | Path, what: str = "tokenizer") -> Tokenizer:
        """Open ``path`` as a tokenizer.json when it is one (by name or by content), else as sentencepiece.

        ``what`` names the setting the path came from (``data.tokenizer``, ``--tokenizer``), for messages.
        Neither kind executes anything from the file: both are parsed as plain data.
        """
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{what} {path} does not exist; give a sentencepiece .model or a Hugging Face "
                            "tokenizer.json file")
        from megazero.data.hf_tokenizer import HFTokenizer, looks_like_tokenizer_json

        if looks_like_tokenizer_json(path):
            return HFTokenizer.open(path, what)
        return SentencePieceTokenizer.open(path, what)

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows the embedding needs: every id ``encode`` (or the EOS) can produce is below it."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """Id that ends a document in the token stream; -1 when the tokenizer has none."""

    @property
    @abstractmethod
    def eos_help(self) -> str:
        """What this kind of tokenizer would need for ``eos_id`` to exist, for the message when it does not."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` alone: no BOS/EOS added, so documents are joined only by the EOS we append."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        """``[encode(t) for t in texts]``, faster: the library spreads the texts over threads."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (the EOS) decode to nothing, as in a document's own text."""


class SentencePieceTokenizer(Tokenizer):
    """A loaded sentencepiece model (megazero's trained tokenizers are these)."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path):
        self._sp = processor
        self.path = path

    @classmethod
    def open(cls, path: Path, what: str = "tokenizer") -> SentencePieceTokenizer:
        processor = spm.SentencePieceProcessor()
        try:
            processor.Load(model_file=str(path))
        except Exception as e:  # sentencepiece raises OSError or RuntimeError with a multi-line text
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{what} {path} is neither a valid sentencepiece model ({reason}) nor a Hugging Face "
                            "tokenizer.json") from None
        return cls(processor, path)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def eos_help(self) -> str:
        return "the model defines no eos piece"

    def encode(self, text: str) -> list[int]:
        return list(self._sp.Encode(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        threads = num_threads or (os.cpu_count() or 1)
        return [list(ids) for ids in self._sp.Encode(list(texts), num_threads=threads)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.Decode([int(i) for i in ids])


def train_tokenizer(
    text_files: list[Path],
    vocab_size: int,
    model_prefix: Path,
    *,
    text_key: str = "text",
    max_sentences: int = 1_000_000,
    seed: int = 0,
) -> Path:
    """Train a BPE model of exactly ``vocab_size`` pieces; return ``model_prefix.model``.

    Training sees at most ``max_sentences`` lines, drawn from all documents by
    reservoir sampling (Vitter, "Random Sampling with a Reservoir", 1985) with
    a fixed seed, so that large corpora train in bounded time and memory and
    the same inputs always give the same model.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"vocab_size {vocab_size} is too small to train a byte-fallback tokenizer; use at least {MIN_VOCAB_SIZE}"
        )
    files = expand_inputs(text_files)
    lines = _sample_lines(iter_documents(files, text_key), max_sentences, seed)
    if not lines:
        raise UserError(f"no text to train a tokenizer on in {name_paths(files)} (every document is empty or blank)")
    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    # trained into memory, not to files under a temporary name (which the model would record): the same
    # inputs give the same bytes
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(lines),
            model_writer=buffer,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9999,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=0,
            max_sentence_length=4 * _MAX_LINE_CHARS + 16,
            num_threads=_TRAIN_THREADS,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise UserError(_training_error(str(e), vocab_size, files, len(lines))) from None
    model = Path(f"{model_prefix}.model")
    tmp = Path(f"{model}.tmp-{os.getpid()}-{os.urandom(4).hex()}")  # renamed into place: readers never see half
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, model)
    return model


def _training_error(message: str, vocab_size: int, files: list[Path], n_lines: int) -> str:
    """Turn sentencepiece's internal check failures into advice about vocab_size."""
    where = f"{len(files)} file(s), {n_lines} lines"
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if too_high:
        return (
            f"vocab_size {vocab_size} is too large for the tokenizer training text ({where}); "
            f"it allows at most {too_high.group(2)}"
        )
    too_small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_small:
        return (
            f"vocab_size {vocab_size} is too small for the tokenizer training text ({where}): "
            f"its characters and the byte pieces need at least {too_small.group(2)}"
        )
    reason = re.sub(r"^.*?\] ", "", message.strip().splitlines()[-1]) if message.strip() else "sentencepiece failed"
    return f"cannot train a {vocab_size}-piece tokenizer ({where}): {reason}"


def _sample_lines(documents: Iterator[str], k: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for doc in documents:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            for start in range(0, len(line), _MAX_LINE_CHARS):
                piece = line[start : start + _MAX_LINE_CHARS]
                if len(reservoir) < k:
                    reservoir.append(piece)
                else:
                    j = rng.randrange(seen + 1)
                    if j < k:
                        reservoir[j] = piece
                seen += 1
    return reservoir
