"""data.tokenizer given as a Hugging Face tokenizer.json: the ids the ``tokenizers`` library itself gives, the
same checks and one-line errors as a sentencepiece model, and cache keys that follow the file's bytes.

Every tokenizer here is built in the test with ``tokenizers`` (a byte-level BPE trained in milliseconds, or a
WordLevel written out by hand): no downloads. Expected ids come from ``tokenizers`` called directly, never
from megazero's wrapper.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megazero.data import build_data
from megazero.data.indexed import IndexedDataset
from megazero.data.tokenizer import Tokenizer
from megazero.errors import UserError
from tests.hostile import assert_one_line, run_process
from tests.runs import ROOT, small_overrides
from tests.data.test_data import SEQ, _cat, _cfg, _counts, _streams, _text, _windows
from tests.hostile import one_line_error

EOT = "<|endoftext|>"


def _train_bpe(lines: list[str], vocab: int) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE with ``<|endoftext|>`` as its one special token (id 0)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two text documents and a .jsonl of five: data.paths for build_data."""
    root = tmp_path_factory.mktemp("hf_texts")
    (root / "a.txt").write_text(_text(1, 120), encoding="utf-8")
    (root / "b.txt").write_text("Ünïcode stays bytes: 漢字 😀\n" + _text(2, 80), encoding="utf-8")
    with (root / "c.jsonl").open("w", encoding="utf-8") as f:
        for i in range(5):
            f.write(json.dumps({"text": _text(10 + i, 4)}) + "\n")
    return root


@pytest.fixture(scope="module")
def hf_json(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-token BPE trained on the corpus, saved as tokenizer.json."""
    lines = (corpus / "a.txt").read_text(encoding="utf-8").splitlines()
    path = tmp_path_factory.mktemp("hf_tok") / "tokenizer.json"
    _train_bpe(lines, 400).save(str(path))
    return path


def _reference(path: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(path))


def _documents(corpus: Path) -> list[str]:
    """Documents in build_data's order: a.txt, b.txt, then c.jsonl's records."""
    docs = [(corpus / n).read_text(encoding="utf-8") for n in ("a.txt", "b.txt")]
    with (corpus / "c.jsonl").open(encoding="utf-8") as f:
        return docs + [json.loads(line)["text"] for line in f]


def _word_level(path: Path, vocab: dict[str, int], added: tuple[str, ...] = ()) -> Path:
    """A hand-written WordLevel tokenizer.json (whitespace-split words), with ``added`` as special tokens."""
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(added))
    tok.save(str(path))
    return path


# ---------------------------------------------------------------- the tokenizer itself


def test_round_trip_eos_and_dispatch(hf_json: Path, tmp_path: Path) -> None:
    ref = _reference(hf_json)
    tok = Tokenizer.load(hf_json)
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True) == 400
    assert tok.eos_id == ref.token_to_id(EOT) == 0
    texts = ["Kalo mi ne.", "  two  spaces\tand a tab\n\nnew lines", "unseen: 😀 é 漢字 \x01"]
    for s in texts:
        ids = tok.encode(s)
        assert ids == ref.encode(s, add_special_tokens=False).ids
        assert all(0 <= i < 400 for i in ids) and tok.decode(ids) == s
    assert tok.encode_batch(texts) == [tok.encode(s) for s in texts]
    assert tok.decode(tok.encode("the end") + [tok.eos_id]) == "the end"  # the EOS decodes to nothing
    # A document quoting the special token is text, not a document boundary.
    quoted = f"a {EOT} b"
    assert tok.eos_id not in tok.encode(quoted) and tok.decode(tok.encode(quoted)) == quoted
    # Truncation saved in the file (max_length 4) does not cut documents.
    truncating = _reference(hf_json)
    truncating.enable_truncation(4)
    truncating.save(str(tmp_path / "truncating.json"))
    assert Tokenizer.load(tmp_path / "truncating.json").encode(texts[1]) == tok.encode(texts[1])
    # The kind is read from the content too: a tokenizer.json under another name still loads as one.
    renamed = tmp_path / "tok.model"
    renamed.write_bytes(hf_json.read_bytes())
    assert Tokenizer.load(renamed).encode(texts[0]) == tok.encode(texts[0])
    # EOS names are looked up in order; ids need not be dense (vocab_size covers the largest id).
    wl = _word_level(tmp_path / "wl.json", {"<unk>": 0, "a": 1, "</s>": 2, "b": 9}, added=(EOT,))
    wl_tok = Tokenizer.load(wl)
    assert wl_tok.eos_id == _reference(wl).token_to_id(EOT)  # before </s>, which this vocabulary also holds
    assert wl_tok.vocab_size == 10 > _reference(wl).get_vocab_size(with_added_tokens=True)  # "b" is id 9
    assert wl_tok.encode("a b zzz") == [1, 9, 0]
    nameless = Tokenizer.load(_word_level(tmp_path / "nameless.json", {"<unk>": 0, "a": 1}))
    assert nameless.eos_id == -1


# ---------------------------------------------------------------- build_data


def test_build_data_tokenises_with_the_json_and_caches_by_its_bytes(corpus: Path, hf_json: Path,
                                                                   tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    vocab = 512  # larger than the tokenizer's 400: the extra rows go unused
    data = build_data(_cfg([corpus], hf_json, cache), vocab, SEQ, 0, True, lambda: None)
    ref = _reference(hf_json)
    docs = [np.array(ref.encode(d, add_special_tokens=False).ids + [ref.token_to_id(EOT)])
            for d in _documents(corpus)]
    (idx,) = cache.glob("data-*.idx")
    ds = IndexedDataset(idx.with_suffix(""))
    assert ds.vocab_size == 400
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    train, val_stream = _streams((docs,), "90,10")
    n_train, n_val = _counts((train, val_stream))
    assert (data.train_samples, data.val_samples) == (n_train, n_val) and n_val > 0
    val = _cat(data.val_microbatches(0, 0, 1, 1, n_val))
    np.testing.assert_array_equal(val, _windows(val_stream))
    # The same bytes reuse the cache; other bytes (the same tokenizer saved re-indented) build anew.
    built = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    build_data(_cfg([corpus], hf_json, cache), vocab, SEQ, 0, True, lambda: None)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == built
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(hf_json.read_text(encoding="utf-8")), indent=1), encoding="utf-8")
    build_data(_cfg([corpus], other, cache), vocab, SEQ, 0, True, lambda: None)
    assert len(list(cache.glob("data-*.idx"))) == 2


def test_vocabulary_larger_than_the_model(corpus: Path, hf_json: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        build_data(_cfg([corpus], hf_json, tmp_path / "cache"), 399, SEQ, 0, True, lambda: None)
    one_line_error(e, "data.tokenizer", str(hf_json), "400", "model.vocab_size 399")


def test_bad_tokenizer_files_are_one_line(corpus: Path, hf_json: Path, tmp_path: Path) -> None:
    good = hf_json.read_text(encoding="utf-8")
    files = {
        "truncated.json": good[: len(good) // 2].encode(),
        "structure.json": b'{"version": "1.0", "model": 5}',
        "list.json": b"[1, 2, 3]",
        "latin1.json": '{"model": "é"}'.encode("latin-1"),
        "braces.model": b"{ not json at all",
        "junk.model": b"\x00\x01junk" * 20,
    }
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UserError) as e:
            build_data(_cfg([corpus], path, tmp_path / "cache"), 512, SEQ, 0, True, lambda: None)
        one_line_error(e, "data.tokenizer", str(path), "tokenizer.json")
    # Files that load but cannot serve: no end-of-text token, and an unknown word with no <unk> to map it to.
    no_eos = _word_level(tmp_path / "no_eos.json", {"<unk>": 0, "a": 1})
    with pytest.raises(UserError) as e:
        build_data(_cfg([corpus], no_eos, tmp_path / "cache"), 512, SEQ, 0, True, lambda: None)
    one_line_error(e, "data.tokenizer", str(no_eos), "end-of-text", EOT)
    no_unk = _word_level(tmp_path / "no_unk.json", {"a": 0}, added=(EOT,))
    with pytest.raises(UserError) as e:
        build_data(_cfg([corpus], no_unk, tmp_path / "cache"), 512, SEQ, 0, True, lambda: None)
    one_line_error(e, str(no_unk), "cannot encode")


def test_cli_bad_tokenizer_json_exits_2_with_one_line(corpus: Path, tmp_path: Path) -> None:
    """pretrain.py itself, in its own process: the file passes the config's existence check, fails on opening."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    overrides = small_overrides(corpus, tmp_path / "cache", tmp_path / "log", steps=1, **{"data.tokenizer": bad})
    argv = [sys.executable, str(ROOT / "pretrain.py"), "--config", str(ROOT / "configs" / "tiny.yaml")]
    for o in overrides:
        argv += ["--set", o]
    proc = run_process(argv, timeout=60)
    assert_one_line(proc.returncode, proc.stderr, "data.tokenizer", str(bad), "tokenizer.json")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("data-*"))


def test_only_a_library_panic_is_turned_into_an_error(capfd) -> None:
    """The panic guard lets every other exception through (KeyboardInterrupt, SystemExit), and what was
    written to stderr meanwhile still reaches it. (Real panics, at load and at encode: test_hostile_data.)"""
    import os

    from megazero.data.hf_tokenizer import _panics_as

    for stop in (KeyboardInterrupt, SystemExit):
        with pytest.raises(stop):
            with _panics_as(lambda reason: reason):
                os.write(2, b"kept\n")
                raise stop()
        assert capfd.readouterr().err == "kept\n"
