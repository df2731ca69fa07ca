"""Hostile data inputs through pretrain.py: each is one line naming the file, exit 2, no traceback.

Every case fails while the data is opened, before a model is built, so the whole file costs a few seconds.
Datasets are written byte by byte from the documented ``.idx`` layout, not with megazero's builder, so a
reader that trusts the wrong field cannot pass by agreeing with its own writer.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.hostile import assert_one_line, call, pretrain_main
from tests.runs import ROOT, small_overrides, write_corpus

VOCAB = 512
SEQ = 32  # small_overrides' model.seq_len: a sample is 33 tokens


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A corpus and a 512-piece tokenizer trained on it, shared by every case."""
    from megazero.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("hostile_data")
    corpus = write_corpus(root / "corpus")
    tok = train_tokenizer(sorted(corpus.iterdir()), VOCAB, root / "tok")
    return {"corpus": corpus, "tok": tok}


def _argv(tmp_path: Path, paths: list, tokenizer: Path | str, **extra) -> list[str]:
    values = {"data.tokenizer": str(tokenizer), **extra}
    overrides = small_overrides(Path("unused"), tmp_path / "cache", tmp_path / "log", steps=2, **values)
    overrides = [o for o in overrides if not o.startswith("data.paths=")]
    overrides.append("data.paths=[" + ", ".join(str(p) for p in paths) + "]")
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml")]
    for o in overrides:
        argv += ["--set", o]
    return argv


def _fails(capsys, tmp_path: Path, paths: list, tokenizer: Path | str, *fragments: str, **extra) -> str:
    code, _, err = call(pretrain_main, _argv(tmp_path, paths, tokenizer, **extra), capsys)
    return assert_one_line(code, err, *fragments)


def _raw_dataset(prefix: Path, tokens, doc_lens: list[int], *, vocab: int = VOCAB, max_token: int | None = None,
                 code: int = 1, magic: bytes = b"MZIDX\x00\x00\x00", version: int = 1) -> Path:
    """PREFIX.bin/.idx written from the documented layout; ``max_token`` may lie about the .bin."""
    tokens = np.asarray(tokens, dtype="<u2" if code == 1 else "<i4")
    assert sum(doc_lens) == len(tokens)
    offsets = np.cumsum([0] + doc_lens).astype("<u8")
    claimed = int(tokens.max()) if max_token is None else max_token
    header = struct.pack("<8sIIQQQQ", magic, version, code, vocab, len(doc_lens), len(tokens), claimed)
    Path(f"{prefix}.idx").write_bytes(header + offsets.tobytes())
    Path(f"{prefix}.bin").write_bytes(tokens.tobytes())
    return prefix


def _tokens(n_docs: int = 40, doc_len: int = 50, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, VOCAB, size=n_docs * doc_len), [doc_len] * n_docs


# ---------------------------------------------------------------- token ids against the vocabulary


def test_ids_past_the_vocabulary_in_a_valid_pair(base, tmp_path: Path, capsys) -> None:
    """Before: the header's max_token (500) was believed; id 700 reached the embedding (IndexError)."""
    tokens, lens = _tokens()
    tokens[::37] = 700
    prefix = _raw_dataset(tmp_path / "ds", tokens, lens, max_token=500)
    _fails(capsys, tmp_path, [prefix], base["tok"], f"{prefix}.bin", "700", "model.vocab_size 512")


def test_negative_ids_in_an_int32_dataset(base, tmp_path: Path, capsys) -> None:
    tokens, lens = _tokens()
    tokens = tokens.astype(np.int64)
    tokens[5] = -3
    prefix = _raw_dataset(tmp_path / "ds", tokens, lens, code=2, max_token=400)
    _fails(capsys, tmp_path, [prefix], base["tok"], f"{prefix}.bin", "-3")


def test_vocab_check_is_cached_and_redone_when_the_file_changes(base, tmp_path: Path, capsys, monkeypatch) -> None:
    """The scan runs once per file; a same-size rewrite with the old mtime is scanned again."""
    import megazero.data.token_range as token_range

    scans = []
    real_scan = token_range.scan_token_range
    monkeypatch.setattr(token_range, "scan_token_range", lambda *a, **k: scans.append(1) or real_scan(*a, **k))
    prefix = _raw_dataset(tmp_path / "ds", np.arange(3, 23), [20])  # valid ids, shorter than one sample
    too_small = (str(prefix), "too small", "model.seq_len 32")
    _fails(capsys, tmp_path, [prefix], base["tok"], *too_small)
    assert len(scans) == 1
    _fails(capsys, tmp_path, [prefix], base["tok"], *too_small)
    assert len(scans) == 1  # reused
    binf = Path(f"{prefix}.bin")
    before = binf.stat()
    binf.write_bytes(np.array([3] * 19 + [700], dtype="<u2").tobytes())  # same size, then the old times back
    os.utime(binf, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert binf.stat().st_size == before.st_size and binf.stat().st_mtime_ns == before.st_mtime_ns
    _fails(capsys, tmp_path, [prefix], base["tok"], str(binf), "700")
    assert len(scans) == 2
    # a corrupt cache entry is scanned again, not trusted and not a crash
    entries = list((tmp_path / "cache").rglob("*.json"))
    assert len(entries) == 1
    for garbage in (b"\x00\xff not json", b'{"max": 3}', b"[]"):
        entries[0].write_bytes(garbage)
        _fails(capsys, tmp_path, [prefix], base["tok"], str(binf), "700")
    assert len(scans) == 5


# ---------------------------------------------------------------- .jsonl and .txt documents

_BAD_RECORDS = {
    "lone_surrogate": ('{"text": "ok \\ud800 here"}', "surrogate"),
    "not_json": ('{"text": oops}', "not valid JSON"),
    "not_object": ('["text", "a list"]', "list"),
    "no_text": ('{"body": "x"}', "'text'"),
    "text_not_string": ('{"text": 42}', "int"),
    "deep_nesting": ("[" * 100_000 + "]" * 100_000, "nested"),
    "huge_integer": ('{"text": "x", "n": 1' + "0" * 5000 + "}", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(_BAD_RECORDS))
def test_bad_jsonl_record(base, tmp_path: Path, capsys, case: str) -> None:
    line, words = _BAD_RECORDS[case]
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a fine first document"}\n' + line + "\n", encoding="utf-8")
    _fails(capsys, tmp_path, [path], base["tok"], f"{path}:2", words)


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_huge_document_is_refused_before_it_is_read_whole(base, tmp_path: Path, capsys, monkeypatch,
                                                          suffix: str) -> None:
    import megazero.data.documents as documents

    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 4096)
    path = tmp_path / f"docs{suffix}"
    if suffix == ".jsonl":
        path.write_text('{"text": "short"}\n' + json.dumps({"text": "x" * 10_000}) + "\n")
    else:
        path.write_text("x" * 10_000)
    _fails(capsys, tmp_path, [path], base["tok"], f"{path}:2" if suffix == ".jsonl" else str(path), "4096")


def test_binary_txt(base, tmp_path: Path, capsys) -> None:
    path = tmp_path / "blob.txt"
    path.write_bytes(b"fine start " + bytes(range(256)) * 4)
    _fails(capsys, tmp_path, [path], base["tok"], str(path), "UTF-8")


def test_empty_txt_files(base, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    (folder / "b.jsonl").write_text('{"text": ""}\n\n')
    _fails(capsys, tmp_path, [folder], base["tok"], str(folder), "no text")


@pytest.mark.parametrize("content", ["nothing", "other_suffixes"])
def test_folder_without_usable_files(base, tmp_path: Path, capsys, content: str) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    if content == "other_suffixes":
        (folder / "x.csv").write_text("a,b\n")
        (folder / ".hidden.txt").write_text("hidden files are skipped\n")
    _fails(capsys, tmp_path, [folder], base["tok"], str(folder), ".txt or .jsonl")


def test_fifo_named_txt_is_refused_not_read(base, tmp_path: Path, capsys) -> None:
    """Before: reading the FIFO blocked forever. A writer feeds it if anything opens it, so a reader that
    comes back fails this test instead of hanging the suite."""
    import threading
    import time

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    fifo = folder / "pipe.txt"
    os.mkfifo(fifo)
    done = threading.Event()

    def feed() -> None:
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # fails (ENXIO) until a reader has it open
            except OSError:
                time.sleep(0.01)
                continue
            os.write(fd, b"fed through the pipe\n")
            os.close(fd)
            return

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        _fails(capsys, tmp_path, [folder], base["tok"], str(fifo), "not a regular file")
    finally:
        done.set()
        writer.join()


# ---------------------------------------------------------------- links


def test_symlink_loop_in_a_folder(base, tmp_path: Path, capsys) -> None:
    """Before: folder links were silently skipped (this one is a loop, so it is an error)."""
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.txt").write_text((base["corpus"] / "000_assert.txt").read_text())
    (folder / "sub" / "back").symlink_to(folder)
    _fails(capsys, tmp_path, [folder], base["tok"], str(folder / "sub" / "back"), "loop")


def test_symlink_to_itself_and_dangling_link(base, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    (folder / "self.txt").symlink_to(folder / "self.txt")
    _fails(capsys, tmp_path, [folder], base["tok"], str(folder / "self.txt"))
    (folder / "self.txt").unlink()
    (folder / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    _fails(capsys, tmp_path, [folder], base["tok"], str(folder / "gone.txt"))


@pytest.mark.parametrize("first,second", [
    ("docs", "docs/"), ("docs", "./docs"), ("docs", "docs/../docs"), ("ABS", "docs"), ("docs", "link"),
])
def test_the_same_folder_listed_twice_is_refused_however_it_is_spelled(base, tmp_path: Path, monkeypatch, capsys,
                                                                       first, second) -> None:
    """Before: a folder reached twice through a link inside one entry was refused, but listed twice (``a`` and
    ``a/``, or a link to it) it was read twice. One rule, by resolved path, for every spelling."""
    (tmp_path / "docs").mkdir()
    for name in ("000_assert.txt", "001_assignment.txt"):
        shutil.copy(base["corpus"] / name, tmp_path / "docs" / name)
    (tmp_path / "link").symlink_to(tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    first = str(tmp_path / "docs") if first == "ABS" else first
    _fails(capsys, tmp_path, [first, second], base["tok"], "data.paths[1]", repr(second), "data.paths[0]",
           repr(first), "read twice")


def test_a_file_reached_by_two_entries_is_refused(base, tmp_path: Path, capsys) -> None:
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    shutil.copy(base["corpus"] / "000_assert.txt", docs / "sub" / "a.txt")
    shutil.copy(base["corpus"] / "001_assignment.txt", docs / "b.txt")
    _fails(capsys, tmp_path, [docs, docs / "sub"], base["tok"], "data.paths[1]", str(docs / "sub" / "a.txt"),
           "data.paths[0]", "read twice")
    _fails(capsys, tmp_path, [docs / "b.txt", docs], base["tok"], "data.paths[1]", str(docs / "b.txt"),
           "read twice")
    (docs / "c.txt").symlink_to(docs / "b.txt")  # a file link inside one folder: the folder-link rule, for files
    _fails(capsys, tmp_path, [docs], base["tok"], str(docs / "c.txt"), str(docs / "b.txt"), "read twice")


# ---------------------------------------------------------------- indexed datasets

_CORRUPT = {
    "magic": (dict(magic=b"NOTMZIDX"), "idx", "magic"),
    "version": (dict(version=7), "idx", "version 7"),
    "dtype": (dict(code=9), "idx", "dtype code 9"),
}


@pytest.mark.parametrize("case", sorted(_CORRUPT))
def test_corrupt_index_header(base, tmp_path: Path, capsys, case: str) -> None:
    kwargs, which, words = _CORRUPT[case]
    tokens, lens = _tokens()
    if kwargs.get("code") == 9:  # written as uint16, labelled with an unknown code
        prefix = _raw_dataset(tmp_path / "ds", tokens, lens)
        idx = Path(f"{prefix}.idx")
        raw = bytearray(idx.read_bytes())
        raw[12:16] = struct.pack("<I", 9)
        idx.write_bytes(bytes(raw))
    else:
        prefix = _raw_dataset(tmp_path / "ds", tokens, lens, **kwargs)
    _fails(capsys, tmp_path, [prefix], base["tok"], f"{prefix}.{which}", words)


@pytest.mark.parametrize("cut", [100, 1])  # whole tokens missing; half a token (size not a multiple of 2)
def test_index_points_past_a_truncated_bin(base, tmp_path: Path, capsys, cut: int) -> None:
    tokens, lens = _tokens()
    prefix = _raw_dataset(tmp_path / "ds", tokens, lens)
    binf = Path(f"{prefix}.bin")
    binf.write_bytes(binf.read_bytes()[:-cut])
    _fails(capsys, tmp_path, [prefix], base["tok"], str(binf), "truncated")


def test_offsets_past_the_bin(base, tmp_path: Path, capsys) -> None:
    tokens, lens = _tokens()
    prefix = _raw_dataset(tmp_path / "ds", tokens, lens)
    idx = Path(f"{prefix}.idx")
    raw = idx.read_bytes()
    idx.write_bytes(raw[:-16] + np.uint64(10**9).tobytes() + raw[-8:])
    _fails(capsys, tmp_path, [prefix], base["tok"], str(idx), "offsets")


def test_only_empty_documents(base, tmp_path: Path, capsys) -> None:
    prefix = _raw_dataset(tmp_path / "ds", np.zeros(0, dtype=np.int64), [0] * 5, max_token=0)
    _fails(capsys, tmp_path, [prefix], base["tok"], str(prefix), "too small")


def test_dataset_smaller_than_one_sample(base, tmp_path: Path, capsys) -> None:
    prefix = _raw_dataset(tmp_path / "ds", np.arange(3, 3 + SEQ), [10, SEQ - 10])  # 32 tokens, a sample is 33
    _fails(capsys, tmp_path, [prefix], base["tok"], str(prefix), "too small", f"{SEQ + 1} tokens")


def test_one_document_cannot_give_a_validation_split(base, tmp_path: Path, capsys) -> None:
    path = tmp_path / "book.txt"
    path.write_text((base["corpus"] / "000_assert.txt").read_text() * 3)
    _fails(capsys, tmp_path, [path], base["tok"], str(path), "one document", "data.split")


def test_validation_split_too_small(base, tmp_path: Path, capsys) -> None:
    tokens, lens = _tokens(n_docs=4, doc_len=30)  # 120 tokens: 3 samples train, 30 validation tokens
    prefix = _raw_dataset(tmp_path / "ds", tokens, lens)
    _fails(capsys, tmp_path, [prefix], base["tok"], str(prefix), "too small", "data.split")


# ---------------------------------------------------------------- tokenizer and cache


def test_tokenizer_that_is_not_sentencepiece(base, tmp_path: Path, capsys) -> None:
    fake = tmp_path / "fake.model"
    fake.write_text("merges: a b\n")
    _fails(capsys, tmp_path, [base["corpus"]], fake, str(fake), "sentencepiece")


def test_tokenizer_larger_than_the_model_vocabulary(base, tmp_path: Path, capsys) -> None:
    _fails(capsys, tmp_path, [base["corpus"]], base["tok"], str(base["tok"]), "512", "model.vocab_size 384",
           **{"model.vocab_size": 384})


def test_cache_dir_is_a_file(base, tmp_path: Path, capsys) -> None:
    tokens, lens = _tokens()
    prefix = _raw_dataset(tmp_path / "ds", tokens, lens)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be\n")
    _fails(capsys, tmp_path, [prefix], base["tok"], "data.cache_dir", str(blocker))


def test_corrupt_cached_dataset_and_tokenizer_are_rebuilt(base, tmp_path: Path, capsys) -> None:
    """Cache files megazero wrote, damaged later: made again, never trusted, never a crash."""
    path = tmp_path / "short.jsonl"
    path.write_text('{"text": "aaaa"}\n{"text": "aaaaaa"}\n')  # 'a', the bytes and 3 specials: 260 pieces
    too_small = (str(path), "too small")
    _fails(capsys, tmp_path, [path], "train", *too_small, **{"model.vocab_size": 260})
    cache = tmp_path / "cache"
    (tok,) = cache.glob("tokenizer-*.model")
    (binf,) = cache.glob("data-*.bin")
    good_tok, good_bin = tok.read_bytes(), binf.read_bytes()
    tok.write_bytes(b"\x00" * 64)
    binf.write_bytes(good_bin[:-2])
    _fails(capsys, tmp_path, [path], "train", *too_small, **{"model.vocab_size": 260})
    assert tok.read_bytes() == good_tok and binf.read_bytes() == good_bin


# ---------------------------------------------------------------- files that are not regular files


def test_fifo_given_as_a_dataset_or_a_tokenizer_is_refused(base, tmp_path: Path, capsys) -> None:
    """A FIFO named by the user (a dataset prefix's .idx, preprocess's --tokenizer) is one line saying what it
    is; nothing opens it (a watchdog fails the test instead of hanging). Before: the tokenizer FIFO was
    reported as missing ("does not exist") and the .idx as "not a regular file" without saying why."""
    from megazero.data.preprocess import main as preprocess_main
    from tests.hostile import watchdog

    prefix = tmp_path / "ds"
    os.mkfifo(f"{prefix}.idx")
    Path(f"{prefix}.bin").write_bytes(b"\x00\x00")
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    with watchdog(30):
        _fails(capsys, tmp_path, [prefix], base["tok"], f"{prefix}.idx", "not a regular file", "a FIFO")
        code, _, err = call(preprocess_main, ["--input", str(base["corpus"]), "--tokenizer", str(fifo),
                                              "--output", str(tmp_path / "out")], capsys)
    assert_one_line(code, err, f"--tokenizer {fifo}", "not a regular file", "a FIFO")
