"""Tests for megazero.data: tokenizer, indexed dataset, preprocessing, samples, build_data.

Expected values are recomputed here from first principles (numpy slices of
the token stream, sentencepiece called directly, numpy permutations), never
read back from the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece as spm

from megazero.data import GPTData, build_data
from megazero.data import build as build_module
from megazero.data.corpus import iter_corpus, write_corpus
from megazero.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazero.data.preprocess import preprocess
from megazero.data.tokenizer import Tokenizer, train_tokenizer
from megazero.errors import UserError
from tests.hostile import one_line_error

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 400
SEQ = 16


def _text(seed: int, lines: int) -> str:
    """Pseudo-English from a few hundred made-up words (enough merges for a 400-piece BPE)."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "qua", "zen", "dor", "th", "ing", "ed"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(300)]
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choice(words, size=rng.integers(3, 12)))
        out.append(sentence.capitalize() + rng.choice([".", "!", "?", ","]))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    (root / "b.txt").write_text(_text(1, 300), encoding="utf-8")
    (root / "sub").mkdir()
    (root / "sub" / "a.txt").write_text(_text(2, 200), encoding="utf-8")
    with (root / "sub" / "c.jsonl").open("w", encoding="utf-8") as f:
        for i in range(30):
            f.write(json.dumps({"id": i, "body": _text(10 + i, 5)}) + "\n")
    (root / "sub" / "ignored.csv").write_text("x,y\n")
    (root / "a").mkdir()
    (root / "a" / "z.txt").write_text("A nested file sorts by its path, before b.txt.\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("hidden directories are skipped\n")
    return root


@pytest.fixture(scope="module")
def tok_model(texts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer([texts / "b.txt", texts / "sub" / "a.txt"], VOCAB, tmp_path_factory.mktemp("tok") / "t")


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_determinism(tok_model: Path, texts: Path, tmp_path: Path) -> None:
    tok = Tokenizer.load(tok_model)
    assert tok.vocab_size == VOCAB
    assert 0 <= tok.eos_id < VOCAB
    sp = spm.SentencePieceProcessor(model_file=str(tok_model))
    for s in ["Kalo mi ne.", "  two  spaces\tand a tab\n\nnew lines", "unseen: 😀 é 漢字 \x01", "def f(x):\n    return x\n"]:
        ids = tok.encode(s)
        assert ids == list(sp.encode(s))
        assert all(0 <= i < VOCAB for i in ids)
        assert tok.decode(ids) == s
    assert sp.unk_id() not in tok.encode("unseen: 😀 漢字")  # byte fallback, never <unk>
    again = train_tokenizer([texts / "b.txt", texts / "sub" / "a.txt"], VOCAB, tmp_path / "again")
    assert again == tmp_path / "again.model"
    assert again.read_bytes() == Path(tok_model).read_bytes()  # the same inputs, the same file
    assert not list(tmp_path.glob("*.tmp-*"))


def test_tokenizer_errors(tmp_path: Path, texts: Path) -> None:
    (tmp_path / "bad.model").write_bytes(b"\x00garbage" * 10)
    cases = [
        (lambda: Tokenizer.load(tmp_path / "nope.model"), str(tmp_path / "nope.model")),
        (lambda: Tokenizer.load(tmp_path / "bad.model"), str(tmp_path / "bad.model")),
        (lambda: train_tokenizer([texts / "b.txt"], 100, tmp_path / "small"), "vocab_size 100"),
        (lambda: train_tokenizer([texts / "b.txt"], 60000, tmp_path / "big"), "vocab_size 60000"),
    ]
    for call, needle in cases:
        with pytest.raises(UserError) as e:
            call()
        one_line_error(e, needle)


# ---------------------------------------------------------------- indexed dataset


def _write(prefix: Path, docs: list[np.ndarray], vocab: int) -> Path:
    with IndexedDatasetBuilder(prefix, vocab) as b:
        for d in docs:
            b.add_document(d)
        return b.finalize()


@pytest.mark.parametrize("vocab,itemsize", [(65536, 2), (100_000, 4)])
def test_indexed_round_trip(tmp_path: Path, vocab: int, itemsize: int) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=n) for n in [5, 0, 17, 1, 64]]
    docs[0][0] = vocab - 1
    prefix = _write(tmp_path / "ds", docs, vocab)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    assert ds.vocab_size == vocab
    assert isinstance(ds.tokens, np.memmap)
    assert ds.tokens.dtype.itemsize == itemsize
    assert (tmp_path / "ds.bin").stat().st_size == itemsize * sum(map(len, docs))
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    np.testing.assert_array_equal(ds.doc_offsets, np.cumsum([0] + [len(d) for d in docs]))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.doc(i), d)
    ds.check_vocab(vocab)
    with pytest.raises(UserError) as e:
        ds.check_vocab(vocab - 1)
    one_line_error(e, str(prefix), str(vocab - 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]


def test_builder_rejects_out_of_vocab_and_cleans_up(tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        _write(tmp_path / "ds", [np.array([1, 2]), np.array([3, 300])], 300)
    one_line_error(e, str(tmp_path / "ds"), "300")
    with pytest.raises(UserError):
        _write(tmp_path / "ds", [np.array([-1])], 300)
    assert list(tmp_path.iterdir()) == []


def test_check_vocab_reads_the_ids_not_the_header(tmp_path: Path) -> None:
    """The header's max_token is the writer's claim; a .bin changed behind it must still be caught."""
    prefix = _write(tmp_path / "ds", [np.array([5, 6, 7]), np.array([8, 9])], 400)
    binf = tmp_path / "ds.bin"
    binf.write_bytes(binf.read_bytes()[:-2] + np.array([399], dtype="<u2").tobytes())  # same size, same header
    ds = IndexedDataset(prefix)
    assert ds.max_token_id == 9
    ds.check_vocab(400)
    with pytest.raises(UserError) as e:
        ds.check_vocab(300)
    one_line_error(e, str(binf), "399", "document 1", "model.vocab_size 300")


# Each case edits the bytes of one file of a valid 3-document dataset (offsets 0, 10, 17, 22).
_CORRUPTIONS = {
    "magic": ("ds.idx", lambda b: b"XX" + b[2:], "magic"),
    "idx_short": ("ds.idx", lambda b: b[:-5], "truncated"),
    "header_short": ("ds.idx", lambda b: b[:20], "truncated"),
    "bin_short": ("ds.bin", lambda b: b[:-2], "truncated"),
    "bin_long": ("ds.bin", lambda b: b + b"\x00\x00", "too long"),
    "offsets": ("ds.idx", lambda b: b[:-24] + np.uint64(10**6).tobytes() + b[-16:], "offsets"),
    "bin_missing": ("ds.bin", None, "does not exist"),
}


@pytest.mark.parametrize("case", sorted(_CORRUPTIONS))
def test_corrupt_dataset_is_a_user_error(tmp_path: Path, case: str) -> None:
    name, edit, words = _CORRUPTIONS[case]
    prefix = _write(tmp_path / "ds", [np.arange(10), np.arange(7), np.arange(5)], 300)
    IndexedDataset(prefix)
    path = tmp_path / name
    if edit is None:
        path.unlink()
    else:
        path.write_bytes(edit(path.read_bytes()))
    with pytest.raises(UserError) as e:
        IndexedDataset(prefix)
    one_line_error(e, str(path), words)


# ---------------------------------------------------------------- preprocess


def _expected_docs(model: Path, documents: list[str]) -> list[np.ndarray]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [np.array(list(sp.encode(d)) + [sp.eos_id()]) for d in documents]


def _expected_stream(model: Path, documents: list[str]) -> np.ndarray:
    return np.concatenate(_expected_docs(model, documents))


def _documents_of(texts: Path, nested: bool = True) -> list[str]:
    """The documents of ``texts`` sorted by path: a/z.txt, b.txt, sub/a.txt, then sub/c.jsonl's lines."""
    docs = [(texts / "a" / "z.txt").read_text(encoding="utf-8")] if nested else []
    docs += [(texts / "b.txt").read_text(encoding="utf-8"), (texts / "sub" / "a.txt").read_text(encoding="utf-8")]
    with (texts / "sub" / "c.jsonl").open(encoding="utf-8") as f:
        docs += [json.loads(line)["body"] for line in f]
    return docs


def test_preprocess_cli_writes_documents_with_eos(tmp_path: Path, texts: Path, tok_model: Path) -> None:
    out = tmp_path / "out" / "corpus"
    proc = subprocess.run(
        [sys.executable, "-m", "megazero.data.preprocess", "--input", str(texts),
         "--tokenizer", str(tok_model), "--output", str(out), "--json-key", "body"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(out)
    docs = _documents_of(texts)
    assert len(ds) == len(docs)
    np.testing.assert_array_equal(ds.tokens, _expected_stream(tok_model, docs))
    eos = Tokenizer.load(tok_model).eos_id
    assert all(ds.doc(i)[-1] == eos and eos not in ds.doc(i)[:-1] for i in range(len(ds)))


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megazero.data.preprocess", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_preprocess_cli_errors(tmp_path: Path, tok_model: Path) -> None:
    missing = tmp_path / "missing.txt"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    for inputs, needle, out in [(missing, str(missing), "o"), (bad, f"{bad}:3", "o"), (bad, "is a folder", "")]:
        output = str(tmp_path / out) if out else f"{tmp_path}/"  # "": the folder itself, not a prefix in it
        proc = _run_cli("--input", str(inputs), "--tokenizer", str(tok_model), "--output", output)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing half-written, nothing beside


def test_preprocess_function_errors(tmp_path: Path, tok_model: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nokey.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "emptydir").mkdir()
    cases = [("x.csv", ".csv"), ("empty.txt", "no text"), ("nokey.jsonl", "nokey.jsonl:1"), ("emptydir", "emptydir")]
    for name, needle in cases:
        with pytest.raises(UserError) as e:
            preprocess([tmp_path / name], tok_model, tmp_path / "out")
        one_line_error(e, needle)


def test_documents_bom_and_folder_links(tmp_path: Path) -> None:
    from megazero.data.documents import expand_inputs, iter_documents

    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert list(iter_documents([tmp_path / "bom.jsonl"])) == ["first", "second"]
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "x.txt").write_text("linked in\n")
    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "b.txt").write_text("own file\n")
    (tmp_path / "top" / "a_link").symlink_to(tmp_path / "real")
    assert expand_inputs([tmp_path / "top"]) == [tmp_path / "top" / "a_link" / "x.txt", tmp_path / "top" / "b.txt"]
    (tmp_path / "top" / "z_again").symlink_to(tmp_path / "real")  # the same folder twice: its files twice
    with pytest.raises(UserError) as e:
        expand_inputs([tmp_path / "top"], "data.paths")
    one_line_error(e, "data.paths", str(tmp_path / "top" / "z_again"), "twice")
    # the same folder given twice (preprocess --input a a/), however spelled: refused by the same rule
    for again in (tmp_path / "real", f"{tmp_path / 'real'}/", tmp_path / "top" / "a_link"):
        with pytest.raises(UserError) as e:
            expand_inputs([tmp_path / "real", again], "--input")
        one_line_error(e, "--input", str(again), "twice")


# ---------------------------------------------------------------- samples and batches


def _cfg(paths: list, tokenizer: str | Path, cache: Path, split: str = "90,10") -> SimpleNamespace:
    return SimpleNamespace(paths=[str(p) for p in paths], tokenizer=str(tokenizer), split=split, cache_dir=str(cache))


@pytest.fixture(scope="module")
def synthetic(tok_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], np.ndarray]:
    """Two preprocessed datasets of random EOS-terminated documents, and their joint token stream.

    The first is named by its ``.idx`` file, the second by its prefix; samples run across both.
    """
    eos = Tokenizer.load(tok_model).eos_id
    rng = np.random.default_rng(123)
    docs = [np.append(rng.integers(3, VOCAB, size=rng.integers(1, 40)), eos) for _ in range(80)]
    root = tmp_path_factory.mktemp("syn")
    first, second = _write(root / "one", docs[:50], VOCAB), _write(root / "two", docs[50:], VOCAB)
    return [f"{first}.idx", str(second)], (docs[:50], docs[50:])


def _data(synthetic, tok_model: Path, tmp_path: Path, seed: int = 7, split: str = "90,10") -> GPTData:
    calls = []
    data = build_data(_cfg(synthetic[0], tok_model, tmp_path / "cache", split), VOCAB, SEQ, seed, True,
                      lambda: calls.append(1))
    assert calls == [1]
    return data


def _streams(sources: tuple[list[np.ndarray], ...], split: str, seq: int = SEQ) -> tuple[list, list]:
    """Each source's train and validation streams, by the rule (independently of the code): a source's first
    k documents train and the rest validate, k (1 <= k < documents, when there are two or more) putting the
    cut nearest to the train weight of its tokens, the later cut on a tie."""
    w = [float(x) for x in split.split(",")]
    w_train = w[0] / sum(w)
    train, val = [], []
    for docs in sources:
        cut = len(docs)
        if w_train < 1 and len(docs) >= 2:
            mark = round(sum(len(d) for d in docs) * w_train)
            ends = {k: sum(len(d) for d in docs[:k]) for k in range(1, len(docs))}
            cut = min(ends, key=lambda k: (abs(ends[k] - mark), -k))
        train.append(np.concatenate(docs[:cut]) if cut else np.zeros(0, dtype=np.int64))
        val.append(np.concatenate(docs[cut:]) if cut < len(docs) else np.zeros(0, dtype=np.int64))
    return train, val


def _sizes(streams: list, seq: int = SEQ) -> list[int]:
    return [max(len(s) - 1, 0) // seq for s in streams]


def _counts(streams: tuple[list, list], seq: int = SEQ) -> tuple[int, int]:
    """Train and validation samples: each source's windows (none across sources)."""
    return tuple(sum(_sizes(part, seq)) for part in streams)


def _sample(stream: np.ndarray, i: int, seq: int = SEQ) -> np.ndarray:
    return stream[i * seq : i * seq + seq + 1]


def _windows(streams: list, seq: int = SEQ) -> np.ndarray:
    """Every source's samples, source by source: the id order (validation's, unshuffled)."""
    return np.stack([_sample(s, i, seq) for s, n in zip(streams, _sizes(streams, seq)) for i in range(n)])


def _expected_train(sources, seed: int, consumed: int, gb: int) -> np.ndarray:
    """Global samples [consumed, consumed + gb) by the blend rule of megazero.data.blend, written out:
    a source gets c of a period's 2^16 positions (the largest-remainder rounding of its share of the
    samples); position r goes to the source furthest behind, c * (r + 1) / 2^16 - (its draws so far) largest,
    the earlier source on a tie; a source's j-th draw is position j % n of its epoch j // n's permutation
    (source 0: rng((seed, epoch)), source k: rng((seed, epoch, k)))."""
    train, _ = _streams(sources, "90,10")
    sizes = _sizes(train)
    period = 1 << 16
    exact = [n / sum(sizes) * period for n in sizes]
    counts = [int(x) for x in exact]
    for k in sorted(range(len(sizes)), key=lambda k: -(exact[k] - counts[k]))[: period - sum(counts)]:
        counts[k] += 1
    end = consumed + gb
    assert end <= period
    drawn, picks = [0] * len(sizes), []
    for r in range(end):
        behind = [c * (r + 1) - d * period for c, d in zip(counts, drawn)]  # exact: integers
        k = behind.index(max(behind))
        picks.append((k, drawn[k]))
        drawn[k] += 1
    rows = []
    for k, j in picks[consumed:end]:
        epoch, pos = divmod(j, sizes[k])
        rng = np.random.default_rng((seed, epoch) if k == 0 else (seed, epoch, k))
        rows.append(_sample(train[k], rng.permutation(sizes[k])[pos]))
    return np.stack(rows)


def _cat(batches) -> np.ndarray:
    return np.concatenate([b.numpy() for b in batches])


def test_samples_cross_documents_and_split(synthetic, tok_model: Path, tmp_path: Path) -> None:
    train, val_streams = _streams(synthetic[1], "90,10")
    data = _data(synthetic, tok_model, tmp_path)
    n_train, n_val = _counts((train, val_streams))
    assert (data.train_samples, data.val_samples) == (n_train, n_val)
    assert n_val > 0 and data.source_names == ["one", "two"]
    eos = Tokenizer.load(tok_model).eos_id
    epoch = _cat(data.train_microbatches(0, 0, 1, 1, n_train))
    assert all(b.shape == (1, SEQ + 1) for b in data.train_microbatches(0, 0, 1, 1, 4))
    # The first n_train draws are the windows of each source's train stream: the blend by size takes each
    # source's share, so (with a period of 2^20 draws) no source repeats before all are read.
    expected = {tuple(r) for r in _windows(train)}
    assert {tuple(r) for r in epoch} == expected and len(expected) == n_train
    # Some samples hold the end of one document and the start of the next.
    assert any(eos in r[:-1] for r in epoch)
    # Validation is every source's validation windows, source by source, wrapping around; disjoint from train.
    val = _cat(data.val_microbatches(0, 0, 1, 1, n_val))
    np.testing.assert_array_equal(val, _windows(val_streams))
    assert not expected & {tuple(r) for r in val}
    b1 = _cat(data.val_microbatches(1, 0, 1, 2, 4))
    np.testing.assert_array_equal(b1, _windows(val_streams)[[(4 + j) % n_val for j in range(4)]])
    # One source's validation alone (val_loss/<name>): its windows only.
    n_two = _sizes(val_streams)[1]
    np.testing.assert_array_equal(_cat(data.val_microbatches(0, 0, 1, 1, n_two, source=1)),
                                  _windows(val_streams[1:]))
    assert epoch.dtype == np.int64


def test_validation_start_is_a_document_boundary() -> None:
    from megazero.data.samples import validation_start

    offsets = np.array([0, 10, 20, 30], dtype="<u8")
    assert validation_start(offsets, 0.5) == 20  # 15 tokens: a tie between 10 and 20, the later
    assert validation_start(offsets, 0.6) == 20 and validation_start(offsets, 0.4) == 10  # the nearer
    assert validation_start(offsets, 1.0) == 30  # no validation weight: everything trains
    assert validation_start(np.array([0, 100, 105], dtype="<u8"), 0.98) == 100  # the last document validates
    assert validation_start(np.array([0, 5, 105], dtype="<u8"), 0.01) == 5  # the first one trains
    # a long document across the mark: the nearer boundary, not the next one (which would leave ~nothing)
    assert validation_start(np.array([0, 90, 190, 200], dtype="<u8"), 0.5) == 90
    assert validation_start(np.array([0, 100], dtype="<u8"), 0.5) == 100  # one document: it cannot be split


def test_every_source_is_split_by_whole_documents(synthetic, tok_model: Path, tmp_path: Path) -> None:
    """As Megatron-LM splits each dataset: every source gives validation a run of its last documents, keeps
    the others for training, and cuts no document between the two."""
    data = _data(synthetic, tok_model, tmp_path)
    val = data.samples.val.window(0, len(data.samples.val))
    train = data.samples.train.window(0, len(data.samples.train))
    pos, heads = 0, []
    for docs in synthetic[1]:
        for k in range(1, len(docs)):  # at least one document on each side
            tail = np.concatenate(docs[k:])
            if np.array_equal(val[pos:pos + len(tail)], tail):
                break
        else:
            pytest.fail("the validation stream does not continue with a run of this source's last documents")
        pos += len(tail)
        heads += docs[:k]
    assert pos == len(val)
    np.testing.assert_array_equal(train, np.concatenate(heads))


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_global_batch_is_layout_invariant(synthetic, tok_model: Path, tmp_path: Path, dp: int, micro_batch: int) -> None:
    data = _data(synthetic, tok_model, tmp_path)
    gb = 8
    for step in range(0, 20, 3):  # crosses epoch boundaries (n_train < 20 * 8)
        shares = [data.train_microbatches(step * gb, r, dp, micro_batch, gb) for r in range(dp)]
        for share in shares:
            assert len(share) == gb // dp // micro_batch
            assert all(mb.shape == (micro_batch, SEQ + 1) for mb in share)
        np.testing.assert_array_equal(_cat(m for s in shares for m in s),
                                      _expected_train(synthetic[1], 7, step * gb, gb))
        val = [m for r in range(dp) for m in data.val_microbatches(step, r, dp, micro_batch, gb)]
        np.testing.assert_array_equal(_cat(val), _cat(data.val_microbatches(step, 0, 1, gb, gb)))


def test_shuffle_seeded_and_resume(synthetic, tok_model: Path, tmp_path: Path) -> None:
    gb = 4
    a = _data(synthetic, tok_model, tmp_path, seed=7)
    run = [_cat(a.train_microbatches(s * gb, 0, 1, 2, gb)) for s in range(40)]
    resumed = _data(synthetic, tok_model, tmp_path, seed=7)
    for s in [39, 25, 26, 3]:
        np.testing.assert_array_equal(_cat(resumed.train_microbatches(s * gb, 0, 1, 2, gb)), run[s])
    other = _data(synthetic, tok_model, tmp_path, seed=8)
    assert not np.array_equal(_cat(other.train_microbatches(0, 0, 1, 2, gb)), run[0])
    np.testing.assert_array_equal(run[0], _expected_train(synthetic[1], 7, 0, gb))
    # Epoch 1 is a different order from epoch 0.
    n_train = a.train_samples
    e0 = _cat(a.train_microbatches(0, 0, 1, 1, n_train))
    e1 = _cat(a.train_microbatches(n_train, 0, 1, 1, n_train))
    assert not np.array_equal(e0, e1) and {tuple(r) for r in e0} == {tuple(r) for r in e1}


def test_batch_and_split_errors(synthetic, tok_model: Path, tmp_path: Path) -> None:
    data = _data(synthetic, tok_model, tmp_path)
    for args, needle in [((0, 0, 3, 1, 8), "train.global_batch 8"), ((0, 0, 2, 3, 8), "train.micro_batch 3"),
                         ((0, 2, 2, 1, 8), "dp_rank 2")]:
        with pytest.raises(UserError) as e:
            data.train_microbatches(*args)
        one_line_error(e, needle)
    for split in ["98", "a,b", "0,1", "98,-2"]:
        with pytest.raises(UserError) as e:
            _data(synthetic, tok_model, tmp_path, split=split)
        one_line_error(e, "data.split", repr(split))
    with pytest.raises(UserError) as e:  # 0.1% validation: each source's last document, too few tokens for 201
        build_data(_cfg(synthetic[0], tok_model, tmp_path / "cache", "999,1"), VOCAB, 200, 7, True, lambda: None)
    one_line_error(e, "too small", "model.seq_len 200")
    no_val = _data(synthetic, tok_model, tmp_path, split="1,0")
    everything = sum(len(d) for docs in synthetic[1] for d in docs)
    assert no_val.val_samples == 0 and no_val.train_samples == (everything - 1) // SEQ


# ---------------------------------------------------------------- build_data


def test_build_data_from_text_trains_and_caches(texts: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    inputs = [texts / "b.txt", texts / "sub"]
    cfg = SimpleNamespace(**vars(_cfg(inputs, "train", cache)), text_key="body")
    data = build_data(cfg, VOCAB, SEQ, 0, True, lambda: None)
    assert Tokenizer.load(data.tokenizer_path).vocab_size == VOCAB
    docs = _expected_docs(data.tokenizer_path, _documents_of(texts, nested=False))
    train, val_stream = _streams((docs[:1], docs[1:]), "90,10")  # b.txt, then sub/'s documents
    n_train, n_val = _counts((train, val_stream))
    assert (data.train_samples, data.val_samples) == (n_train, n_val)
    val = _cat(data.val_microbatches(0, 0, 1, 1, n_val))
    np.testing.assert_array_equal(val, _windows(val_stream))
    built = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert not [p for p in built if ".tmp-" in p.name]
    # A non-builder rank finds everything built; nothing is rebuilt.
    again = build_data(cfg, VOCAB, SEQ, 0, False, lambda: None)
    assert again.tokenizer_path == data.tokenizer_path
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == built
    # A changed input gets a new dataset and tokenizer.
    os.utime(texts / "b.txt", ns=(1, 1))
    changed = build_data(cfg, VOCAB, SEQ, 0, True, lambda: None)
    assert changed.tokenizer_path != data.tokenizer_path
    # A non-builder rank whose cache is empty says so instead of crashing.
    with pytest.raises(UserError) as e:
        build_data(_cfg(inputs, "train", tmp_path / "other"), VOCAB, SEQ, 0, False, lambda: None)
    one_line_error(e, "data.cache_dir")


def test_build_data_config_errors(synthetic, texts: Path, tok_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    other_vocab = _write(tmp_path / "other", [np.arange(50)], 300)
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "a.txt").write_text("some text\n")
    (dangling / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    cases = [
        (_cfg([dangling], "train", cache), VOCAB, ["data.paths", "cannot read", "gone.txt"]),
        (_cfg([other_vocab], tok_model, cache), VOCAB, ["data.paths", str(other_vocab), "300"]),
        (_cfg([tmp_path / "nope.txt"], "train", cache), VOCAB, ["data.paths", str(tmp_path / "nope.txt")]),
        (_cfg(synthetic[0], "train", cache), VOCAB, ["data.tokenizer", synthetic[0][0]]),
        (_cfg(synthetic[0], tmp_path / "no.model", cache), VOCAB, ["data.tokenizer", "no.model"]),
        (_cfg(synthetic[0], tok_model, cache), VOCAB - 1, ["model.vocab_size", str(VOCAB - 1)]),
    ]
    for cfg, vocab, needles in cases:
        with pytest.raises(UserError) as e:
            build_data(cfg, vocab, SEQ, 0, True, lambda: None)
        one_line_error(e, *needles)
    # A dataset whose ids exceed the model's vocabulary, with a tokenizer that fits.
    big = _write(tmp_path / "big", [np.array([1, 2, 350])], 400)
    ds = IndexedDataset(big)
    with pytest.raises(UserError) as e:
        ds.check_vocab(300)
    one_line_error(e, str(big), "350")


def test_builtin_corpus(tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    max_bytes = 700_000
    docs = list(iter_corpus(max_bytes))
    assert docs == list(iter_corpus(max_bytes))
    assert sum(len(d.encode()) for d in docs) <= max_bytes
    first = sorted(topics)[0]
    assert docs[0] == topics[first]
    assert any("def " in d and "import " in d for d in docs)  # library source follows the topics
    cfg = _cfg([], "train", tmp_path / "cache", split="98,2")
    data = build_data(cfg, 512, 64, 0, True, lambda: None, builtin_max_bytes=max_bytes)
    assert data.train_samples > 0 and data.val_samples > 0
    jsonl = list((tmp_path / "cache").glob("corpus-*.jsonl"))
    assert len(jsonl) == 1
    tok = Tokenizer.load(data.tokenizer_path)
    assert tok.vocab_size == 512
    encoded = _expected_docs(data.tokenizer_path, docs)
    stream = np.concatenate(encoded)
    train, val_stream = _streams((encoded,), "98,2", seq=64)
    assert (data.train_samples, data.val_samples) == _counts((train, val_stream), seq=64)
    first_rows = _cat(data.val_microbatches(0, 0, 1, 1, 1))
    np.testing.assert_array_equal(first_rows[0], val_stream[0][:65])
    eos_at = int(np.argmax(stream == tok.eos_id))
    assert tok.decode(stream[:eos_at].tolist()) == docs[0]
    write_corpus(tmp_path / "c2.jsonl", max_bytes)
    assert (tmp_path / "c2.jsonl").read_bytes() == jsonl[0].read_bytes()


def test_document_masking_needs_document_boundaries(synthetic, tok_model: Path, tmp_path: Path) -> None:
    """data.document_mask finds documents by their end-of-text token: a preprocessed source whose documents end
    with it loads (its eos_id is the tokenizer's); one whose documents lack it is refused in one line."""
    cfg = SimpleNamespace(**vars(_cfg(synthetic[0], tok_model, tmp_path / "cache")), document_mask=True)
    data = build_data(cfg, VOCAB, SEQ, 7, True, lambda: None)
    assert data.eos_id == Tokenizer.load(tok_model).eos_id >= 0
    rng = np.random.default_rng(5)
    bare = _write(tmp_path / "bare", [rng.integers(3, VOCAB, size=20) for _ in range(10)], VOCAB)
    cfg = SimpleNamespace(**vars(_cfg([str(bare)], tok_model, tmp_path / "cache2")), document_mask=True)
    with pytest.raises(UserError) as e:
        build_data(cfg, VOCAB, SEQ, 7, True, lambda: None)
    one_line_error(e, "data.document_mask")
    assert "no document boundaries" in str(e.value) and str(bare) in str(e.value)
    cfg.document_mask = False  # the same source trains without the mask
    build_data(cfg, VOCAB, SEQ, 7, True, lambda: None)


def test_document_boundaries_are_checked_past_the_first_4096_documents(tok_model: Path, tmp_path: Path) -> None:
    """Every document is checked, not a prefix: one past the 4096th that lacks the end-of-text token is refused
    in one line naming the source and that document's index."""
    eos = Tokenizer.load(tok_model).eos_id
    rng = np.random.default_rng(9)
    docs = [np.append(rng.integers(3, VOCAB, size=int(rng.integers(1, 4))), eos) for _ in range(6000)]
    docs[5000] = docs[5000][:-1]
    late = _write(tmp_path / "late", docs, VOCAB)
    cfg = SimpleNamespace(**vars(_cfg([str(late)], tok_model, tmp_path / "cache")), document_mask=True)
    with pytest.raises(UserError) as e:
        build_data(cfg, VOCAB, SEQ, 7, True, lambda: None)
    one_line_error(e, "data.document_mask", str(late), "document 5000 ", "no document boundaries")


def test_first_unended_document_reads_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs in bounded chunks of documents: a bad one in a later chunk is still found, by its index in
    the whole source; empty documents are skipped; a source with no token at all has no boundary (-1)."""
    monkeypatch.setattr(build_module, "_BOUNDARY_CHUNK", 3)
    lens = [0, 2, 0, 0, 1, 3, 2, 0, 4, 1]
    offsets = np.cumsum([0] + lens).astype("<u8")
    tokens = np.full(int(offsets[-1]), 7, dtype="<u2")
    tokens[offsets[1:].astype(np.int64)[np.array(lens) > 0] - 1] = 1
    assert build_module.first_unended_document(offsets, tokens, 1) is None
    tokens[int(offsets[9]) - 1] = 5  # document 8, in the third chunk
    assert build_module.first_unended_document(offsets, tokens, 1) == 8
    assert build_module.first_unended_document(np.zeros(5, dtype="<u8"), np.zeros(0, dtype="<u2"), 1) == -1
