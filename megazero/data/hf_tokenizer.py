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
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers

from megazero.errors import UserError

# End-of-text token names in the order they are looked up: Llama 3, GPT-2/Qwen/NeoX, Llama 2/Mistral/T5,
# Gemma, ChatML, DeepSeek. The first one the vocabulary holds separates documents.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")
_SNIFF_BYTES = 4096  # leading whitespace read before deciding a file is not JSON
_REASON_CHARS = 160  # a library message quoted in an error line is cut to this


def looks_like_tokenizer_json(path: Path) -> bool:
    """True for a ``.json`` name or a file whose first non-blank byte opens a JSON object.

    Decided from the bytes too, not only the name, so a ``tokenizer.json``
    renamed or downloaded under another name is still read as one. A
    sentencepiece model is a protobuf whose first byte is a field tag
    (0x0a), never ``{``, so the two kinds cannot be confused.
    """
    if path.suffix.lower() == ".json":
        return True
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    return head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n").startswith(b"{")


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first if len(first) <= _REASON_CHARS else first[:_REASON_CHARS] + "..."


def open_tokenizer_json(path: Path, what: str = "tokenizer") -> tokenizers.Tokenizer:
    """Parse ``path`` with the three settings above; anything wrong with it (encoding, JSON, structure) is one
    line naming it (``what``: the setting the path came from)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not a valid Hugging Face tokenizer.json (not UTF-8 text: byte "
                        f"{e.start}); give a tokenizer.json or a sentencepiece .model") from None
    try:
        tok = tokenizers.Tokenizer.from_str(text.removeprefix("\ufeff"))
    except Exception as e:  # the Rust side raises a bare Exception with serde's message
        raise UserError(f"{what} {path} is not a valid Hugging Face tokenizer.json ({_reason(e)}); "
                        "give a tokenizer.json or a sentencepiece .model") from None
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


def encode_ids(tok: tokenizers.Tokenizer, texts: Sequence[str], name: str) -> list[list[int]]:
    """The ids of each text, no special tokens added, over the library's own thread pool.

    A file can load and still fail here (a WordLevel model whose unknown token is missing from its
    vocabulary): that is the file's fault, so it is a one-line error naming it (``name``: setting and path).
    """
    try:
        encodings = tok.encode_batch(list(texts), add_special_tokens=False)
    except Exception as e:
        raise UserError(f"{name} cannot encode the text ({_reason(e)}); fix or replace the tokenizer.json") from None
    return [list(enc.ids) for enc in encodings]
