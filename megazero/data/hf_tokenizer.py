"""Reading a Hugging Face ``tokenizer.json`` for pretraining (the adapter behind megazero's ``Tokenizer``
interface is :class:`megazero.data.tokenizer.HFTokenizer`; this module does not import that one).

A model imported from the Hugging Face Hub was trained on the ids of
its own tokenizer; pretraining it further on text tokenised any other way
would feed it a different language. The ``tokenizers`` library reads the file
as plain JSON (no code runs from it) and encodes exactly as the Hub model's
own tokenizer does, with three settings chosen for pretraining documents:

* no special tokens added (no BOS/EOS per encode call): documents are joined
  by the one EOS that preprocessing appends, as for sentencepiece;
* special-token text inside a document (a file that quotes
  ``<|endoftext|>``) is encoded as the text it is, not as the special id, so
  a document cannot end or switch roles halfway through;
* truncation and padding saved in the file are switched off: a
  ``tokenizer.json`` saved with ``max_length=512`` would otherwise cut every
  document silently.

Changing any of these changes the ids written to cached datasets: bump
``CACHE_FORMAT`` in ``megazero.data.cache_plan`` with it.

The library can panic on a malformed file (a ``Precompiled`` normalizer whose charsmap does not parse, at
load; a split pattern past Oniguruma's backtracking limit, at encode). A panic reaches Python as
``pyo3_runtime.PanicException``, a ``BaseException`` that ``except Exception`` misses, after Rust has
printed it (and a backtrace) on file descriptor 2. Every call into the library here is made inside
``_panics_as``: a panic is one line naming the file, and what Rust printed is dropped.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import tokenizers

from megazero.data.regular_files import open_regular
from megazero.errors import UserError

# End-of-text token names in the order they are looked up: Llama 3, GPT-2/Qwen/NeoX, Llama 2/Mistral/T5,
# Gemma, ChatML, DeepSeek. The first one the vocabulary holds separates documents.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")
_SNIFF_BYTES = 4096  # leading whitespace read before deciding a file is not JSON
_REASON_CHARS = 160  # a library message quoted in an error line is cut to this


def looks_like_tokenizer_json(path: Path, head: bytes | None = None) -> bool:
    """True for a ``.json`` name or a file whose first non-blank byte opens a JSON object.

    Decided from the bytes too, not only the name, so a ``tokenizer.json``
    renamed or downloaded under another name is still read as one. A
    sentencepiece model is a protobuf whose first byte is a field tag
    (0x0a), never ``{``, so the two kinds cannot be confused. ``head``: the
    file's first bytes when the caller has read them (else read here).
    """
    if path.suffix.lower() == ".json":
        return True
    if head is None:
        with open_regular(path) as f:
            head = f.read(_SNIFF_BYTES)
    return head[:_SNIFF_BYTES].removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n").startswith(b"{")


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= _REASON_CHARS else first[:_REASON_CHARS] + "..."


def is_panic(e: BaseException) -> bool:
    """Whether ``e`` is a Rust panic raised through pyo3 (its module, ``pyo3_runtime``, cannot be imported
    to name the type, so it is known by name)."""
    return type(e).__name__ == "PanicException" and type(e).__module__ == "pyo3_runtime"


class _Held:
    keep = True  # write what was held back out to stderr afterwards


@contextmanager
def _held_stderr() -> Iterator[_Held]:
    """What is written to file descriptor 2 inside, held in a temporary file and written out afterwards,
    unless ``keep`` was cleared. Without a stderr or a temporary folder nothing is held."""
    try:
        saved = os.dup(2)
    except OSError:
        yield _Held()
        return
    try:
        spool = tempfile.TemporaryFile()
    except OSError:
        os.close(saved)
        yield _Held()
        return
    held = _Held()
    with spool:
        if sys.stderr is not None:
            sys.stderr.flush()
        os.dup2(spool.fileno(), 2)
        try:
            yield held
        finally:
            if sys.stderr is not None:
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if held.keep:
                spool.seek(0)
                data = spool.read()
                while data:
                    data = data[os.write(2, data):]


@contextmanager
def _panics_as(message: Callable[[str], str]) -> Iterator[None]:
    """A panic of the tokenizers library inside becomes ``UserError(message(reason))``, and what Rust printed
    is dropped; every other exception (KeyboardInterrupt and SystemExit included) passes untouched."""
    with _held_stderr() as held:
        try:
            yield
        except BaseException as e:
            if not is_panic(e):
                raise
            held.keep = False
            raise UserError(message(_reason(e))) from None


def parse_tokenizer_json(data: bytes, path: Path, what: str = "tokenizer") -> tokenizers.Tokenizer:
    """Parse ``data`` (the bytes of ``path``) with the three settings above; anything wrong with it
    (encoding, JSON, structure, a panic) is one line naming it (``what``: the setting the path came from)."""
    def invalid(reason: str) -> str:
        return (f"{what} {path} is not a valid Hugging Face tokenizer.json ({reason}); "
                "give a tokenizer.json or a sentencepiece .model")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(invalid(f"not UTF-8 text: byte {e.start}")) from None
    with _panics_as(lambda reason: invalid(f"the tokenizers library panicked: {reason}")):
        try:
            tok = tokenizers.Tokenizer.from_str(text.removeprefix("\ufeff"))
        except Exception as e:  # the Rust side raises a bare Exception with serde's message
            raise UserError(invalid(_reason(e))) from None
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = True
    return tok


def vocabulary(tok: tokenizers.Tokenizer, name: str) -> dict[str, int]:
    """Every token and its id, added tokens included (``name``: setting and path, for a panic)."""
    with _panics_as(lambda reason: f"{name} cannot list its vocabulary (the tokenizers library panicked: "
                                   f"{reason}); fix or replace the tokenizer.json"):
        return tok.get_vocab(with_added_tokens=True)


def encode_ids(tok: tokenizers.Tokenizer, texts: Sequence[str], name: str) -> list[list[int]]:
    """The ids of each text, no special tokens added, over the library's own thread pool.

    A file can load and still fail here (a WordLevel model whose unknown token is missing from its
    vocabulary; a pattern that backtracks past Oniguruma's limit, a panic): that is the file's fault, so it
    is a one-line error naming it (``name``: setting and path).
    """
    def failed(reason: str) -> str:
        return f"{name} cannot encode the text ({reason}); fix or replace the tokenizer.json"

    with _panics_as(lambda reason: failed(f"the tokenizers library panicked: {reason}")):
        try:
            encodings = tok.encode_batch(list(texts), add_special_tokens=False)
        except Exception as e:
            raise UserError(failed(_reason(e))) from None
    return [list(enc.ids) for enc in encodings]


def decode_ids(tok: tokenizers.Tokenizer, ids: Sequence[int], name: str) -> str:
    """The text of ``ids``, special tokens skipped; a panic of the library is one line naming the file."""
    with _panics_as(lambda reason: f"{name} cannot decode ids (the tokenizers library panicked: {reason}); "
                                   "fix or replace the tokenizer.json"):
        return tok.decode([int(i) for i in ids], skip_special_tokens=True)
