"""Tests for parallel preprocessing (``--workers``) and its progress bar.

The output must not depend on the number of workers: the same .bin/.idx bytes, in input order, equal to
sentencepiece called directly. Batches are made small here so that a few hundred documents span dozens of
batches, more than the workers hold in flight.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from tqdm import tqdm

from megazero.data import preprocess as pre
from megazero.data.indexed import IndexedDataset, bin_path, index_path
from megazero.data.tokenizer import Tokenizer, train_tokenizer
from megazero.errors import UserError

VOCAB = 400
SMALL_BATCH_CHARS = 2_000  # ~10 documents per batch: ~50 batches over the corpus


def _sentences(rng: np.random.Generator, words: list[str], n: int) -> str:
    return " ".join(" ".join(rng.choice(words, size=rng.integers(2, 9))).capitalize() + "." for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[str]]:
    """Two .jsonl files of many small documents and a .txt between them; and the documents in order."""
    rng = np.random.default_rng(3)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "zen", "dor", "th", "ing"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(200)]
    root = tmp_path_factory.mktemp("corpus")
    files, docs = [], []
    for name, n in [("a.jsonl", 250), ("b.txt", 1), ("c.jsonl", 250)]:
        texts = [_sentences(rng, words, int(rng.integers(1, 12))) + ("\n" if i % 7 == 0 else "") for i in range(n)]
        path = root / name
        if name.endswith(".txt"):
            path.write_text(texts[0], encoding="utf-8")
        else:
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        files.append(path)
        docs += texts
    return files, docs


@pytest.fixture(scope="module")
def model(corpus: tuple[list[Path], list[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(corpus[0], VOCAB, tmp_path_factory.mktemp("tok") / "t")


def _bytes(prefix: Path) -> bytes:
    return bin_path(prefix).read_bytes() + b"|" + index_path(prefix).read_bytes()


def test_any_worker_count_writes_the_same_bytes(corpus, model: Path, tmp_path: Path, monkeypatch) -> None:
    files, docs = corpus
    monkeypatch.setattr(pre, "_BATCH_CHARS", SMALL_BATCH_CHARS)
    n_batches = sum(1 for _ in pre._batches(files, "text"))
    assert n_batches > 4 * pre._IN_FLIGHT_PER_WORKER * 2, n_batches  # more batches than 4 workers hold

    pools = []  # worker counts of the process pools started: workers=1 starts none
    in_workers = pre._encode_in_workers
    monkeypatch.setattr(pre, "_encode_in_workers", lambda tok, b, n: pools.append(n) or in_workers(tok, b, n))

    pre.preprocess(files, model, tmp_path / "w1", workers=1)
    pre.preprocess(files, Tokenizer.load(model), tmp_path / "w4", workers=4)
    assert pre.main(["--input", *map(str, files), "--tokenizer", str(model), "--output", str(tmp_path / "w2"),
                     "--workers", "2"]) == 0

    assert pools == [4, 2]
    sp = spm.SentencePieceProcessor(model_file=str(model))
    expected = np.concatenate([np.array(sp.encode(d) + [sp.eos_id()]) for d in docs])
    ds = IndexedDataset(tmp_path / "w1")
    assert len(ds) == len(docs)
    np.testing.assert_array_equal(ds.tokens, expected)
    assert _bytes(tmp_path / "w2") == _bytes(tmp_path / "w1")
    assert _bytes(tmp_path / "w4") == _bytes(tmp_path / "w1")


def test_reads_ahead_a_bounded_number_of_batches(corpus, model: Path) -> None:
    """Memory stays bounded: the reader is never more than the in-flight limit ahead of the writer."""
    workers, read, ahead = 2, [0], []
    batch = [corpus[1][0]]

    def batches():
        for i in range(30):
            read[0] += 1
            yield batch, i

    encoded = pre._encode_in_workers(Tokenizer.load(model), batches(), workers)
    for consumed, (_, lengths, position) in enumerate(encoded, 1):
        assert position == consumed - 1 and len(lengths) == 1  # in input order
        ahead.append(read[0] - consumed)
    assert max(ahead) <= workers * pre._IN_FLIGHT_PER_WORKER, ahead


def test_progress_bar_on_stderr(corpus, model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    files, _ = corpus
    monkeypatch.setattr(pre, "_BATCH_CHARS", SMALL_BATCH_CHARS)
    pre.preprocess(files, model, tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: drawn at once (a log: after 30 s)
    pre.preprocess(files, model, tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "tokenising: 100%" in final and "tok/s" in final and "docs/s" in final, err
    done, total = re.search(r"\| ?([\d.]+\w?)/([\d.]+\w?) \[", final).groups()  # input bytes: all of them
    assert done == total == tqdm.format_sizeof(sum(p.stat().st_size for p in files), divisor=1024), final


def test_bad_workers_is_one_line_exit_2(corpus, model: Path, tmp_path: Path, capsys) -> None:
    files, _ = corpus
    for bad in ["0", "-1", "two", "1.5", ""]:
        code = pre.main(["--input", str(files[0]), "--tokenizer", str(model), "--output", str(tmp_path / "o"),
                         "--workers", bad])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --workers {bad!r} is invalid"), err
        assert "positive integer" in err
    with pytest.raises(UserError, match=r"^workers=0 is invalid; give a positive integer"):
        pre.preprocess(files, model, tmp_path / "o", workers=0)
    assert list(tmp_path.iterdir()) == []


def test_worker_error_is_the_callers_one_line_error(corpus, model: Path, tmp_path: Path) -> None:
    """A worker that cannot load the tokenizer reports why, and nothing half-written is left."""
    copy = tmp_path / "gone.model"
    shutil.copy(model, copy)
    tok = Tokenizer.load(copy)
    copy.unlink()
    with pytest.raises(UserError) as e:
        pre.preprocess(corpus[0], tok, tmp_path / "out", workers=2)
    assert "\n" not in str(e.value) and f"{copy} does not exist" in str(e.value), e.value
    assert list(tmp_path.iterdir()) == []


_READ_AND_WAIT = """
import multiprocessing, sys, time
from pathlib import Path
from megazero.data import preprocess as pre
from megazero.data.tokenizer import Tokenizer
stream = pre._encode_in_workers(Tokenizer.load(sys.argv[1]), iter([(["a few words"], i) for i in range(6)]), 2)
next(stream)
print(*[p.pid for p in multiprocessing.active_children() if p.name.startswith("SpawnProcess")], flush=True)
time.sleep(600)
"""


def test_workers_end_when_the_process_that_started_them_is_killed(model: Path) -> None:
    """SIGKILL (the OOM killer, a scheduler's last word) to the process reading the results: its tokenising
    workers end within a second or two, instead of waiting for work for ever."""
    proc = subprocess.Popen([sys.executable, "-c", _READ_AND_WAIT, str(model)], cwd=Path(__file__).parents[2],
                            stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(w) for w in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # not read to its end: the workers hold the pipe too
    assert len(workers) == 2, workers

    def alive() -> list[int]:
        found = []
        for pid in workers:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                found.append(pid)
        return found

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent by 5 s"
