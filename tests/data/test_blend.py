"""Weighted blends of data sources and the index files that order the samples (megazero.data.blend)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megazero.config.load import load_config
from megazero.data.blend import BLOCK, PREBUILD_MIN, IndexFiles, epoch_permutation
from megazero.data.indexed import IndexedDatasetBuilder
from megazero.data.samples import GPTSamples
from megazero.errors import UserError
from megazero.data.tokenizer import train_tokenizer
from tests.hostile import assert_one_line, run_process
from tests.runs import ROOT, write_corpus
from tests.hostile import one_line_error

SEQ = 8
WEIGHTS = [0.7, 0.2, 0.1]


def _source(n_samples: int, seed: int, doc_len: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and document offsets of a source holding ``n_samples`` training samples (split "100,0")."""
    n_tokens = n_samples * SEQ + 1
    tokens = np.random.default_rng(seed).integers(0, 1000, n_tokens).astype(np.uint16)
    offsets = np.append(np.arange(0, n_tokens, doc_len), n_tokens).astype(np.uint64)
    return tokens, offsets


def _blend(sizes=(40_000, 3_000, 200), weights=WEIGHTS, files=None, split="100,0") -> GPTSamples:
    return GPTSamples([_source(n, i) for i, n in enumerate(sizes)], SEQ, 7, split, weights=weights, files=files)


def _worst_prefix(sources: np.ndarray, weights, n0: int = 1000) -> tuple[float, float]:
    """The largest |share - weight| over prefixes of >= n0 samples, and the largest |count - n * weight|."""
    k = len(weights)
    cum = np.cumsum(np.eye(k, dtype=np.int64)[sources], axis=0)
    n = np.arange(1, len(sources) + 1)[:, None]
    off = np.abs(cum - n * np.asarray(weights))
    return float((off / n)[n0 - 1:].max()), float(off.max())


def test_every_prefix_holds_each_source_within_one_percent_of_its_weight() -> None:
    """Weights 0.7/0.2/0.1 over sources of 40000, 3000 and 200 samples (the small ones cycle through many
    epochs): over the first 3 periods of the blend, every prefix of >= 1000 samples holds each source's
    share within 1% of its weight (measured: 0.06%); every source stays within 1.6 samples of n * weight."""
    samples = _blend()
    first = samples.source_of(samples.train_sample_ids(np.arange(3 * BLOCK)))
    share, count = _worst_prefix(first, WEIGHTS)
    # one sample within a period, plus each period's rounding of w * 2^16 to whole positions (<= 0.5 each)
    assert share < 0.01 and count <= 1.0 + 3 * 0.5, (share, count)


def test_many_sources_of_equal_weight_stay_within_one_sample() -> None:
    """One source of weight 0.5 and 49 sharing the rest equally: sources with equal weights must not draw
    in bursts (a stride rule that places them at equal times does: 1.2% off at n = 1004)."""
    weights = [0.5] + [0.5 / 49] * 49
    samples = _blend(sizes=[500] * 50, weights=weights)
    first = samples.source_of(samples.train_sample_ids(np.arange(20_000)))
    share, count = _worst_prefix(first, weights)
    assert share < 0.01 and count <= 1.0 + 1e-9, (share, count)


def test_each_source_reads_its_epochs_in_order_across_periods() -> None:
    """A source's j-th draw is position j % n of its epoch j // n, counted across the blend's periods (not
    restarting each period), so its draws are its epochs' permutations end to end; and a long run keeps at
    most two epochs per source in memory."""
    samples = _blend(sizes=(5_000, 700, 90))
    positions = np.arange(3 * BLOCK + 100)
    source, sample = samples.order.locate(positions)
    for k, n in enumerate((5_000, 700, 90)):
        got = sample[source == k]
        epochs = -(-len(got) // n)
        want = np.concatenate([epoch_permutation(n, 7, k, e) for e in range(epochs)])[: len(got)]
        np.testing.assert_array_equal(got, want)
        assert epochs >= 20  # many epochs, over three periods
    for step in range(0, 50_000, 997):  # and after many steps, the held epochs are bounded
        samples.train_sample_ids(np.arange(step * 64, step * 64 + 64))
    assert len(samples.order._perms) <= 2 * 3, list(samples.order._perms)


def test_the_stream_is_the_same_at_any_dp() -> None:
    """The samples each rank reads, concatenated in global order, are the dp=1 stream, step after step."""
    samples = _blend()
    gb = 16
    for step in (0, 1, 250, 4000):  # 4000 * 16 draws: the 200-sample source is hundreds of epochs in
        one = np.concatenate(samples.train_batch_ids(step * gb, 0, 1, 2, gb))
        for dp in (2, 4):
            parts = [np.concatenate(samples.train_batch_ids(step * gb, r, dp, 2, gb)) for r in range(dp)]
            np.testing.assert_array_equal(np.concatenate(parts), one)
        np.testing.assert_array_equal(one, samples.train_sample_ids(np.arange(step * gb, (step + 1) * gb)))


def test_index_files_are_written_once_and_memory_mapped(tmp_path: Path) -> None:
    """The builder writes the blend and the permutations (each with its checksum) and keeps no copy; a
    reader maps them (np.memmap) and reads the same order as one built in memory. A damaged file: the
    builder finds it against its checksum and builds it again; a reader given ids out of range stops with
    one line; a file of the wrong shape is built in memory."""
    sizes = (PREBUILD_MIN + 50_000, PREBUILD_MIN + 10)  # both over PREBUILD_MIN: their permutations go to files
    positions = np.arange(0, 3 * sum(sizes), 101)
    memory = _blend(sizes, [0.5, 0.5]).train_sample_ids(positions)
    builder = _blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, write=True))
    builder.order.prebuild(3 * sum(sizes))
    assert not builder.order._perms  # written, not held
    npy = sorted(p.name for p in (tmp_path / "indices").glob("*.npy"))
    assert len([f for f in npy if f.startswith("blend-")]) == 1, npy
    # 3.22M draws of each: 2.93 epochs of the first source, 3.07 of the second
    assert len([f for f in npy if f.startswith("shuffle-")]) == 3 + 4, npy
    assert len(list((tmp_path / "indices").glob("*.sha256"))) == len(npy)
    np.testing.assert_array_equal(builder.train_sample_ids(positions), memory)
    reader = _blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, write=False))
    np.testing.assert_array_equal(reader.train_sample_ids(positions), memory)
    assert isinstance(reader.order.block, np.memmap)
    assert all(isinstance(p, np.memmap) for p in [*reader.order._perms.values(), *builder.order._perms.values()])
    shuffle = sorted((tmp_path / "indices").glob("shuffle-*.npy"))
    first = shuffle[0].read_bytes()
    for f in shuffle:  # right shape, ids out of range
        arr = np.load(f)
        np.save(f, np.full_like(arr, 2 ** 31))
    with pytest.raises(UserError) as e:
        _blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, False)).train_sample_ids(positions)
    one_line_error(e, str(tmp_path / "indices"), "delete")
    again = _blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, write=True))  # the builder checks, rebuilds
    again.order.prebuild(3 * sum(sizes))
    assert shuffle[0].read_bytes() == first
    np.testing.assert_array_equal(_blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, False))
                                  .train_sample_ids(positions), memory)
    np.save(shuffle[0], np.arange(10, dtype=np.uint32))  # the wrong length: built in memory
    np.testing.assert_array_equal(_blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, False))
                                  .train_sample_ids(positions), memory)
    blend = next((tmp_path / "indices").glob("blend-*.npy"))
    np.save(blend, np.zeros(BLOCK, dtype=np.int64))  # a period that is not one: every rank checks it
    np.testing.assert_array_equal(_blend(sizes, [0.5, 0.5], IndexFiles(tmp_path, False))
                                  .train_sample_ids(positions), memory)
    assert not list((tmp_path / "indices").glob(".*tmp*"))


def test_a_source_too_small_for_one_sequence_is_named() -> None:
    with pytest.raises(UserError) as e:
        GPTSamples([_source(100, 0), (np.arange(5, dtype=np.uint16), np.array([0, 5], dtype=np.uint64))], SEQ,
                   0, "100,0", labels=["big.jsonl", "tiny.jsonl"])
    one_line_error(e, "tiny.jsonl", "too small", "model.seq_len 8")
    assert "big.jsonl" not in str(e.value)
    with pytest.raises(UserError) as e:  # a weight so small it would get no position of a period
        GPTSamples([_source(100, 0), _source(100, 1)], SEQ, 0, "100,0", weights=[1.0, 1e-9], labels=["a", "b"])
    one_line_error(e, "b: weight 1e-09", "never be drawn")
    samples = GPTSamples([_source(100, 0), _source(100, 1)], SEQ, 0, "100,0", weights=[1e308, 1e308])
    assert samples.order.counts.tolist() == [BLOCK // 2, BLOCK // 2]  # finite weights whose sum is not


@pytest.mark.parametrize("paths, needles", [
    ("[{path: a, weight: 0}]", ["data.paths[0].weight=0", "> 0"]),
    ("[{path: a, weight: -1}]", ["data.paths[0].weight=-1", "> 0"]),
    ("[{path: a, weight: lots}]", ["data.paths[0].weight='lots'", "number"]),
    ("[{path: a, weight: .inf}]", ["data.paths[0].weight=inf", "finite"]),
    ("[{path: a, weight: 1}, b]", ["data.paths[1]='b'", "every entry needs a weight"]),
    ("[{path: a, wieght: 1}]", ["data.paths[0].wieght=1", "path, weight, name"]),
    ("[{weight: 1}]", ["data.paths[0]=", "needs path"]),
    ("[{path: a, name: x}, {path: b, name: x}]", ["data.paths[1].name='x'", "differ"]),
    ("[{path: a, name: 'a b'}]", ["data.paths[0].name='a b'", "letters"]),
])
def test_bad_blend_entries_are_one_line(paths: str, needles: list[str]) -> None:
    with pytest.raises(UserError) as e:
        load_config(ROOT / "configs" / "tiny.yaml", [f"data.paths={paths}"])
    one_line_error(e, *needles)


def test_bad_weight_exits_2_without_a_traceback(tmp_path: Path) -> None:
    proc = run_process([sys.executable, str(ROOT / "pretrain.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
                        "--set", "data.paths=[{path: x, weight: -0.5}]", "--dry-run"], cwd=tmp_path)
    assert_one_line(proc.returncode, proc.stderr, "data.paths[0].weight=-0.5")


_OPEN = """
import json, sys, time
from types import SimpleNamespace
import torch  # an empty run has it too
from megazero.data import build_data
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
cfg = SimpleNamespace(paths=[sys.argv[1]], tokenizer=sys.argv[2], split='99,1', cache_dir=sys.argv[3])
before, t0 = rss(), time.perf_counter()
data = build_data(cfg, 512, 8, 0, sys.argv[4] == 'builder', lambda: None, train_samples=int(sys.argv[5]))
data.train_microbatches(10_000, 0, 1, 4, 8)  # the first batch: the order's files are opened lazily
seconds = time.perf_counter() - t0
print(json.dumps({"rss": rss() - before, 'seconds': seconds, 'samples': data.train_samples}))
"""


def test_a_rank_opens_a_large_corpus_in_bounded_memory_and_time(tmp_path: Path) -> None:
    """2e7 tokens (40 MB of .bin; 2.5M samples of 8 tokens), torch imported in both measurements: with the
    indices cached, a rank opens the data and reads a batch in under 2 s, and its resident memory grows by
    under 8 MB (measured 5.5 MB): a fifth of the .bin, below reading the tokens (40 MB) or holding the
    epoch's permutation in memory (measured 17.5 MB with the index files off). The .bin and the permutation
    are memory-mapped: only the pages a batch reads become resident."""
    n_tokens, docs = 20_000_000, 20_000
    tokens = np.random.default_rng(0).integers(3, 512, n_tokens).astype(np.uint16)
    with IndexedDatasetBuilder(tmp_path / "big", 512) as b:
        for part in np.split(tokens, docs):
            b.add_document(part)
        b.finalize()
    del tokens
    tok = train_tokenizer(sorted(write_corpus(tmp_path / "text").iterdir())[:40], 512, tmp_path / "tok")
    args = [str(tmp_path / "big"), str(tok), str(tmp_path / "cache")]
    run = lambda role: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-c", _OPEN, *args, role, str(400_000)], capture_output=True, text=True, cwd=ROOT,
        check=False).stdout or 'null')
    first = run("builder")  # scans the ids once (cached), writes the permutation files
    assert (tmp_path / "cache" / "indices").is_dir()
    second = run("rank")
    assert first["samples"] == second["samples"] > 2_000_000
    assert second["seconds"] < 2.0 and second["rss"] < 8 * 2 ** 20, second


def test_per_source_validation_reaches_tensorboard_and_the_console(tmp_path: Path, capsys) -> None:
    """val_loss/<name> goes to metrics.jsonl, to TensorBoard beside val/loss as val/loss/<name>, and to the
    console line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megazero.train.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, total_steps=1, enabled=True, tensorboard=True)
    log.log(1, {"loss": 3.0, "val_loss": 2.5, "val_ppl": 12.18, "val_loss/web": 2.0, "val_loss/code": 3.0})
    log.close()
    assert "val web 2.0000, code 3.0000" in capsys.readouterr().out
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["val_loss/web"] == 2.0 and record["val_loss/code"] == 3.0
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"val/loss", "val/loss/web", "val/loss/code"} <= tags, tags
    assert acc.Scalars("val/loss/code")[0].value == 3.0
