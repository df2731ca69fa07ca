"""Tokenise raw text into an indexed dataset.

    python -m megazero.data.preprocess --input FILE_OR_DIR [...] \\
        --tokenizer MODEL.model|tokenizer.json --output PREFIX [--json-key text]

Each document is followed by the tokenizer's EOS id, so that samples cut
from the concatenated stream show the model where one document ends and an
unrelated one begins (as in GPT-2 training, Radford et al., 2019).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from megazero.data.documents import expand_inputs, iter_documents, name_paths
from megazero.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazero.data.tokenizer import Tokenizer
from megazero.errors import UserError

_BATCH_CHARS = 4_000_000


def preprocess(
    inputs: Sequence[str | Path],
    tokenizer: Tokenizer | str | Path,
    output_prefix: str | Path,
    json_key: str = "text",
    *,
    what: str = "input",
) -> Path:
    """Write ``output_prefix.bin/.idx`` from the documents of ``inputs``; return the prefix.

    ``what`` names the setting the inputs came from, for error messages.
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.load(tokenizer)
    if tok.eos_id < 0:
        raise UserError(f"tokenizer {tok.path} has no end-of-text token ({tok.eos_help}); "
                        "documents could not be separated")
    files = expand_inputs(inputs, what)
    with IndexedDatasetBuilder(output_prefix, tok.vocab_size) as builder:
        n_tokens = 0
        for batch in _batches(iter_documents(files, json_key)):
            for ids in tok.encode_batch(batch):
                ids.append(tok.eos_id)
                builder.add_document(np.asarray(ids, dtype=np.int64))
                n_tokens += len(ids)
        if n_tokens == 0:
            raise UserError(f"{what}: no text in {name_paths(files)} (every document is empty)")
        return builder.finalize()


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """Group documents so sentencepiece can encode many at once over threads."""
    batch: list[str] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megazero.data.preprocess",
        description="Tokenise .txt (one document per file) and .jsonl (one document per line) into PREFIX.bin/.idx.",
    )
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl files or directories of them")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model or Hugging Face tokenizer.json file")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="field of each .jsonl record that holds the text")
    args = parser.parse_args(argv)
    try:
        if Path(args.output).is_dir() or args.output.endswith(("/", os.sep)):
            raise UserError(f"--output {args.output!r} is a folder; give a prefix inside it, such as "
                            f"{str(Path(args.output) / 'corpus')!r} (writes corpus.bin and corpus.idx there)")
        tokenizer = Tokenizer.load(args.tokenizer, "--tokenizer")
        prefix = preprocess(args.input, tokenizer, args.output, args.json_key, what="--input")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ds = IndexedDataset(prefix)
    print(f"wrote {prefix}.bin and {prefix}.idx: {len(ds)} documents, {ds.n_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
