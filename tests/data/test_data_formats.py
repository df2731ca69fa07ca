"""Tests for the raw-text input kinds of megazero.data.documents: .jsonl.gz, .jsonl.zst and .parquet.

The reference is plain ``.jsonl``: the same text in any other kind must give exactly the same documents and,
through ``preprocess``, the same tokens (checked against sentencepiece called directly). Inputs are small
files written here with gzip, zstandard and pyarrow themselves.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import zstandard

import megazero.data.documents as documents
from megazero.data.documents import expand_inputs, iter_documents
from megazero.data.indexed import IndexedDataset
from megazero.data.preprocess import preprocess
from megazero.data.tokenizer import train_tokenizer
from megazero.errors import UserError
from tests.hostile import one_line_error

ROOT = Path(__file__).resolve().parents[2]
# Documents with what a reader could get wrong: empty ones (skipped), unicode, newlines, escapes, a BOM-like
# character inside a document (only a leading BOM of the file is dropped).
DOCS = [f"Document {i}: caf\u00e9 \u4e2d\u6587 ka lo mi {'ne ' * (i % 7)}\n" + "second line\n" * (i % 3)
        for i in range(40)]
DOCS[5] = ""
DOCS[17] = "tab\tquote\" backslash\\ \ufeff emoji \U0001f600"


def _jsonl_bytes(docs: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs)).encode()


def _zst(data: bytes, frames: int = 1) -> bytes:
    """``data`` as ``frames`` Zstandard frames back to back (as pzstd and chunked writers produce)."""
    cut = [len(data) * k // frames for k in range(frames + 1)]
    return b"".join(zstandard.ZstdCompressor().compress(data[a:b]) for a, b in zip(cut, cut[1:]))


def _parquet(path: Path, columns: dict, row_group_size: int = 7) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def _write_all_kinds(folder: Path, docs: list[str], key: str = "text") -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    data = _jsonl_bytes(docs, key)
    paths = {kind: folder / f"docs{kind}" for kind in (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")}
    paths[".jsonl"].write_bytes(data)
    paths[".jsonl.gz"].write_bytes(gzip.compress(data))
    paths[".jsonl.zst"].write_bytes(_zst(data, frames=3))
    _parquet(paths[".parquet"], {"id": list(range(len(docs))), key: docs})
    return paths


def _error(path: Path, key: str = "text") -> pytest.ExceptionInfo:
    with pytest.raises(UserError) as e:
        list(iter_documents([path], key))
    return e


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sentencepiece model (as tests/data/test_data.py trains one), from these documents' words."""
    root = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(0)
    words = ["ka", "lo", "mi", "ne", "caf\u00e9", "Document", "second", "line", "quote", "tab"]
    text = "\n".join(" ".join(rng.choice(words, size=8)) for _ in range(300)) + "\n"
    (root / "train.txt").write_text(text, encoding="utf-8")
    return train_tokenizer([root / "train.txt"], 300, root / "t")


# ---------------------------------------------------------------- the same documents, the same tokens


def test_every_kind_gives_the_jsonl_documents_and_tokens(tmp_path: Path, tok_model: Path, monkeypatch) -> None:
    monkeypatch.setattr(documents, "_PARQUET_BATCH_ROWS", 5)  # batches that do not line up with row groups
    paths = _write_all_kinds(tmp_path / "in", DOCS)
    expected = [d for d in DOCS if d]
    assert list(iter_documents([paths[".jsonl"]])) == expected
    assert pq.ParquetFile(paths[".parquet"]).metadata.num_row_groups == 6  # 40 rows, 7 a group
    sp = spm.SentencePieceProcessor(model_file=str(tok_model))
    stream = np.concatenate([list(sp.encode(d)) + [sp.eos_id()] for d in expected])
    for kind, path in paths.items():
        assert list(iter_documents([path])) == expected, kind
        ds = IndexedDataset(preprocess([path], tok_model, tmp_path / kind.replace(".", "_")))
        assert len(ds) == len(expected), kind
        np.testing.assert_array_equal(ds.tokens, stream, err_msg=kind)


def test_compressed_jsonl_keeps_jsonl_rules(tmp_path: Path) -> None:
    """A leading BOM dropped, blank lines skipped; a bad line gives the .jsonl error, with the same number."""
    body = b'\xef\xbb\xbf{"text": "first"}\n\n{"text": "second"}\n'
    (tmp_path / "ok.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "ok.jsonl.zst").write_bytes(_zst(body))
    for name in ("ok.jsonl.gz", "ok.jsonl.zst"):
        assert list(iter_documents([tmp_path / name])) == ["first", "second"], name
    for bad in ('{"text": "ok \\ud800 here"}', '{"text": 42}', '{"body": "x"}', '"just a string"'):
        body = b'{"text": "fine"}\n\n' + bad.encode() + b"\n"
        plain = tmp_path / "bad.jsonl"
        plain.write_bytes(body)
        want = str(_error(plain).value).replace(str(plain), "FILE")
        for kind, pack in ((".jsonl.gz", gzip.compress), (".jsonl.zst", _zst)):
            path = tmp_path / f"bad{kind}"
            path.write_bytes(pack(body))
            got = one_line_error(_error(path), f"{path}:3")
            assert got.replace(str(path), "FILE") == want, (kind, got, want)


def test_malformed_json_inside_zst_names_file_and_record(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl.zst"
    path.write_bytes(_zst(b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n{"text": "d"}\n', frames=2))
    one_line_error(_error(path), f"{path}:3", "not valid JSON")


@pytest.mark.parametrize("kind", [".jsonl.gz", ".jsonl.zst"])
def test_decompressed_lines_keep_the_document_size_limit(tmp_path: Path, monkeypatch, kind: str) -> None:
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 4096)
    body = _jsonl_bytes(["short", "x" * 10_000])  # compresses to far less than 4096 bytes
    path = tmp_path / f"docs{kind}"
    path.write_bytes(gzip.compress(body) if kind == ".jsonl.gz" else _zst(body))
    assert path.stat().st_size < 4096
    one_line_error(_error(path), f"{path}:2", "4096")


def test_parquet_value_over_the_document_size_limit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 4096)
    path = _parquet(tmp_path / "big.parquet", {"text": ["short"] * 9 + ["x" * 5000]}, row_group_size=4)
    one_line_error(_error(path), str(path), "row 10", "4096")


def test_other_text_key_for_parquet_and_jsonl_gz(tmp_path: Path) -> None:
    paths = _write_all_kinds(tmp_path, DOCS[:9], key="body")
    expected = [d for d in DOCS[:9] if d]
    for kind in (".parquet", ".jsonl.gz"):
        assert list(iter_documents([paths[kind]], "body")) == expected, kind
        one_line_error(_error(paths[kind], "text"), str(paths[kind]), "'text'", "'body'")


# ---------------------------------------------------------------- folders


def test_folder_of_mixed_kinds_recursively(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.txt").write_text("plain text file\n")
    (root / "b.jsonl").write_bytes(_jsonl_bytes(["b1", "b2"]))
    (root / "sub" / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(["c1"])))
    _parquet(root / "sub" / "deeper" / "d.parquet", {"text": ["d1", "d2", "d3"]}, row_group_size=2)
    (root / "sub" / "e.jsonl.zst").write_bytes(_zst(_jsonl_bytes(["e1"])))
    for ignored in ("x.gz", "y.json.gz", "z.zst", "w.csv", ".hidden.parquet", ".hidden/h.jsonl.zst"):
        (root / ignored).write_bytes(b"not an input")
    files = expand_inputs([root])
    assert [f.relative_to(root).as_posix() for f in files] == [
        "a.txt", "b.jsonl", "sub/c.jsonl.gz", "sub/deeper/d.parquet", "sub/e.jsonl.zst"]
    assert list(iter_documents(files)) == ["plain text file\n", "b1", "b2", "c1", "d1", "d2", "d3", "e1"]


@pytest.mark.parametrize("name", ["x.gz", "x.json.gz", "x.zst", "x.jsonl.bz2", "x.parq"])
def test_unsupported_suffix_lists_every_kind(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(UserError) as e:
        expand_inputs([path], "data.paths")
    one_line_error(e, "data.paths", str(path), ".txt", ".jsonl,", ".jsonl.gz", ".jsonl.zst", ".parquet")


# ---------------------------------------------------------------- broken files


def test_parquet_without_the_text_column(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "docs.parquet", {"id": [1, 2], "content": ["a", "b"], "url": ["u", "v"]})
    one_line_error(_error(path), str(path), "'text'", "'content'", "'id'", "'url'", "text_key")


def test_parquet_null_names_its_row(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(documents, "_PARQUET_BATCH_ROWS", 4)
    texts: list[str | None] = [f"row {i}" for i in range(1, 21)]
    texts[12] = None  # row 13: in the third row group of 5, the fourth batch of 4
    path = _parquet(tmp_path / "docs.parquet", {"text": texts}, row_group_size=5)
    one_line_error(_error(path), str(path), "row 13", "null")


def test_parquet_column_that_is_not_strings(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "docs.parquet", {"text": [1, 2, 3]})
    one_line_error(_error(path), str(path), "'text'", "int64")


def test_parquet_invalid_utf8_names_its_row(tmp_path: Path) -> None:
    raw = pa.array([b"good", b"fine", b"bad \xff byte"], type=pa.binary()).view(pa.string())  # not validated
    path = _parquet(tmp_path / "docs.parquet", {"text": raw})
    one_line_error(_error(path), str(path), "row 3", "UTF-8")


@pytest.mark.parametrize("content", ["garbage", "truncated", "empty"])
def test_corrupt_parquet_is_one_line(tmp_path: Path, content: str) -> None:
    good = _parquet(tmp_path / "good.parquet", {"text": [f"document {i}" for i in range(50)]}).read_bytes()
    data = {"garbage": b"PAR1 this is not parquet at all", "truncated": good[: len(good) // 2], "empty": b""}
    path = tmp_path / "docs.parquet"
    path.write_bytes(data[content])
    one_line_error(_error(path), str(path), "parquet")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "trailing_junk", "last_frame_cut"])
def test_corrupt_zst_is_a_user_error(tmp_path: Path, damage: str) -> None:
    """zstandard's stream_reader ends cleanly on a file cut inside a frame; here that is an error."""
    good = _zst(_jsonl_bytes([f"document number {i} " * 20 for i in range(200)]), frames=2)
    data = {"garbage": b"this is not zstd at all\n", "truncated": good[: len(good) // 2],
            "trailing_junk": good + b"junk", "last_frame_cut": good[:-3]}
    path = tmp_path / "docs.jsonl.zst"
    path.write_bytes(data[damage])
    msg = one_line_error(_error(path), str(path), "zstd")
    if damage == "trailing_junk":  # every line is read before the junk after them is reported
        assert "after line 200" in msg


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad_crc"])
def test_corrupt_gz_is_a_user_error(tmp_path: Path, damage: str) -> None:
    body = _jsonl_bytes([f"document number {i} " * 20 for i in range(200)])
    good = gzip.compress(body)
    data = {"truncated": good[: len(good) // 2], "garbage": b"\x1f\x8b but not really gzip",
            "bad_crc": good[:-8] + bytes(4) + good[-4:]}
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(data[damage])
    msg = one_line_error(_error(path), str(path), "gzip")
    if damage == "truncated":
        assert "after line " in msg  # the record number reached
    if damage == "bad_crc":  # every line was read before the check at the end failed
        assert "after line 200" in msg


def test_import_stays_light() -> None:
    """pyarrow and zstandard load only when a file needs them."""
    code = "import sys, megazero.data; print(sorted({'pyarrow', 'zstandard'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
