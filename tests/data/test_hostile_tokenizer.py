"""Tokenizer files the libraries cannot take, through pretrain.py and preprocess: one line naming the file, exit 2.

The ``tokenizers`` library panics on some malformed tokenizer.json files (``pyo3_runtime.PanicException``, a
``BaseException``, after Rust has printed the panic on file descriptor 2), at load or at encode; a tokenizer
file gigabytes large would be read whole. Each file here is written from the format by hand (or is a
sparse file), so no download is needed; stderr is read at the file-descriptor level (capfd) where the
library itself writes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.test_hostile_data import _argv, _fails
from tests.hostile import assert_one_line, call, pretrain_main


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    """A folder of one document that the split pattern below backtracks on (any tokenizer reads it)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("a" * 40)
    return folder


_WORDS = {"a": 0, "b": 1, "<unk>": 2, "</s>": 3}


def _tokenizer_json(path: Path, **parts) -> Path:
    """A WordLevel tokenizer.json written from the format, with ``parts`` (normalizer, pre_tokenizer) set."""
    body = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": _WORDS, "unk_token": "<unk>"}, **parts}
    path.write_text(json.dumps(body))
    return path


# A normalizer whose charsmap does not parse: the library panics while loading (PanicException, a
# BaseException). A split pattern that backtracks past Oniguruma's retry limit on a run of "a": the library
# loads it and panics while encoding.
_BAD_CHARSMAP = {"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"}}
_BACKTRACKS = {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+a+)+[^a]"}, "behavior": "Isolated",
                                 "invert": False}}


def test_tokenizer_json_that_panics_while_loading(docs: Path, tmp_path: Path, capfd) -> None:
    """Before: pyo3_runtime.PanicException escaped `except Exception`: a Rust backtrace and a traceback.
    Read at the file-descriptor level (capfd): the panic message Rust prints itself must not show either."""
    tok = _tokenizer_json(tmp_path / "tokenizer.json", **_BAD_CHARSMAP)
    code, _, err = call(pretrain_main, _argv(tmp_path, [docs], tok), capfd)
    assert_one_line(code, err, f"data.tokenizer {tok}", "panicked", "precompiled_charsmap")


@pytest.mark.parametrize("workers", [1, 2])
def test_tokenizer_json_that_panics_while_encoding(docs: Path, tmp_path: Path, capfd, workers: int) -> None:
    """The panic inside encode, in this process (pretrain's builder) or in preprocess's worker processes.
    Before: a traceback (and, from the workers, a pool that could not send the exception back)."""
    tok = _tokenizer_json(tmp_path / "tokenizer.json", **_BACKTRACKS)
    if workers == 1:
        code, _, err = call(pretrain_main, _argv(tmp_path, [docs], tok), capfd)
    else:
        from megazero.data.preprocess import main as preprocess_main

        code, _, err = call(preprocess_main, ["--input", str(docs), "--tokenizer", str(tok), "--output",
                                              str(tmp_path / "out"), "--workers", str(workers)], capfd)
    assert_one_line(code, err, str(tok), "panicked", "retry-limit")
    assert not list(tmp_path.glob("out*")) and not list((tmp_path / "cache").glob("data-*")), "partial dataset"


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_multi_gigabyte_tokenizer_is_refused_before_it_is_read(docs: Path, tmp_path: Path, capsys,
                                                              name: str) -> None:
    """A sparse 5 GiB file (costs nothing on disk): refused by its size, read not at all. Before: read whole
    (MemoryError, or gigabytes of memory before a parse error)."""
    huge = tmp_path / name
    with huge.open("wb") as f:
        f.truncate(5 << 30)
    line = _fails(capsys, tmp_path, [docs], huge, f"data.tokenizer {huge}", f"{5 << 30} bytes")
    from megazero.data.tokenizer import MAX_TOKENIZER_BYTES

    assert str(MAX_TOKENIZER_BYTES) in line, line
