"""Training megazero's own tokenizer: a sentencepiece BPE of exactly ``model.vocab_size`` pieces.

Kudo & Richardson, "SentencePiece: A simple and language independent subword
tokenizer and detokenizer for Neural Text Processing", EMNLP 2018; the merges
are byte-pair encoding (Sennrich et al., "Neural Machine Translation of Rare
Words with Subword Units", ACL 2016).

The tokenizer is trained to round-trip any text exactly: identity
normalisation, whitespace kept as written (code indentation matters), and
byte fallback so a character never seen in training still encodes (as its
UTF-8 bytes) instead of becoming ``<unk>``. The trained ``.model`` is opened
like any other, with ``Tokenizer.load`` (``megazero.data.tokenizer``).
"""

from __future__ import annotations

import io
import os
import random
import re
from collections.abc import Iterator
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
