"""Tokenizers: the interface the data pipeline uses, its two implementations, and ``Tokenizer.load``.

A sentencepiece ``.model`` (megazero trains these, see ``tokenizer_training``, or one is brought along)
and a Hugging Face ``tokenizer.json`` (how one is read for pretraining: ``hf_tokenizer``) are thin
adapters here, beside the interface, so that ``Tokenizer.load`` can pick between them while neither
implementation's module imports this one.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm
import tokenizers

from megazero.data.hf_tokenizer import EOS_NAMES, decode_ids, encode_ids, looks_like_tokenizer_json, \
    parse_tokenizer_json, vocabulary
from megazero.data.regular_files import FileTooLarge, NotRegularFile, read_regular
from megazero.data.tokenizer_training import MIN_VOCAB_SIZE, train_tokenizer
from megazero.errors import UserError

__all__ = ["Tokenizer", "SentencePieceTokenizer", "HFTokenizer", "train_tokenizer", "MIN_VOCAB_SIZE",
           "MAX_TOKENIZER_BYTES"]

# The largest tokenizer file read (it is read whole, and parsed into several times its size): real
# tokenizer.json files are 1-40 MB, sentencepiece models under 10 MB, so a larger one is not a tokenizer.
MAX_TOKENIZER_BYTES = 256 << 20


def read_tokenizer_file(path: str | Path, what: str = "tokenizer", *, links: bool = True) -> bytes:
    """The bytes of the tokenizer file ``path``, when it is a regular file of at most MAX_TOKENIZER_BYTES
    (checked before anything is read); else one line naming it (``what``: the setting it came from).
    ``links``: follow a link at ``path`` (False for a tokenizer in the data cache)."""
    try:
        return read_regular(path, MAX_TOKENIZER_BYTES, links=links)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist; give a sentencepiece .model or a Hugging Face "
                        "tokenizer.json file") from None
    except NotRegularFile as e:
        raise UserError(f"{what} {path} is not a regular file ({e.kind}); give a sentencepiece .model or a "
                        "Hugging Face tokenizer.json file") from None
    except FileTooLarge as e:
        raise UserError(f"{what} {path} is {e.size} bytes ({e.size / 2**30:.1f} GiB), more than the "
                        f"{e.limit} ({e.limit >> 20} MiB) megazero reads as a tokenizer (real tokenizer.json "
                        "and .model files are under 100 MB); give the tokenizer file itself") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read ({e.strerror})") from None


class Tokenizer(ABC):
    """What the data pipeline asks of a tokenizer, whichever library implements it.

    ``Tokenizer.load(path)`` is the one place that picks the implementation: a
    Hugging Face ``tokenizer.json`` (so a model imported from the Hub keeps the
    ids it was trained on) or a sentencepiece ``.model`` (trained by megazero
    or brought along). Callers never branch on the kind.
    """

    path: Path
    sha256: str  # of the file's bytes, as read: they alone decide the ids
    links: bool  # whether a link at ``path`` was followed (so a worker process opens it the same way)

    @classmethod
    def load(cls, path: str | Path, what: str = "tokenizer", *, links: bool = True) -> Tokenizer:
        """Open ``path`` as a tokenizer.json when it is one (by name or by content), else as sentencepiece.

        ``what`` names the setting the path came from (``data.tokenizer``, ``--tokenizer``), for messages;
        ``links=False`` for a tokenizer in the data cache. The file is read once, whole
        (``read_tokenizer_file``), and parsed from those bytes. Neither kind executes anything from the
        file: both are parsed as plain data.
        """
        path = Path(path)
        data = read_tokenizer_file(path, what, links=links)
        if looks_like_tokenizer_json(path, data):
            tok: Tokenizer = HFTokenizer.parse(data, path, what)
        else:
            tok = SentencePieceTokenizer.parse(data, path, what)
        tok.sha256 = hashlib.sha256(data).hexdigest()
        tok.links = links
        return tok

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
    def parse(cls, data: bytes, path: Path, what: str = "tokenizer") -> SentencePieceTokenizer:
        """The model in ``data`` (the bytes of ``path``); one line naming it when they are not one."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(data)
        except Exception as e:  # sentencepiece raises RuntimeError with a multi-line text
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


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` read from a ``tokenizer.json`` as ``hf_tokenizer`` describes (no special
    tokens added, special-token text encoded as text, no truncation or padding)."""

    def __init__(self, tok: tokenizers.Tokenizer, path: Path, what: str = "tokenizer"):
        self._tok = tok
        self.path = path
        self._what = what
        vocab = vocabulary(tok, f"{what} {path}")
        # ids need not be dense (a vocabulary may skip ids, added tokens may sit far above the rest): the
        # embedding needs a row for the largest id, which can exceed the count of tokens
        self._vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        self._eos_id = next((vocab[name] for name in EOS_NAMES if name in vocab), -1)

    @classmethod
    def parse(cls, data: bytes, path: Path, what: str = "tokenizer") -> HFTokenizer:
        """Parse ``data`` (the bytes of ``path``); anything wrong with it (encoding, JSON, structure, a panic
        of the library) is one line naming it."""
        return cls(parse_tokenizer_json(data, path, what), path, what)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def eos_help(self) -> str:
        return "its vocabulary holds none of " + ", ".join(EOS_NAMES)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        """Encode over the library's own thread pool (``RAYON_NUM_THREADS``); ``num_threads`` is not used."""
        return encode_ids(self._tok, texts, f"{self._what} {self.path}")

    def decode(self, ids: Iterable[int]) -> str:
        return decode_ids(self._tok, list(ids), f"{self._what} {self.path}")
