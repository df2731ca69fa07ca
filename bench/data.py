"""Preprocessing benchmark: ``megazero.data.preprocess`` at 1, 2 and 4 workers against raw sentencepiece.

A synthetic corpus is written to a temporary folder: English-like text (made-up words drawn from a fixed
vocabulary with Zipf frequencies, sentences and paragraphs) from a seeded generator, as several ``.jsonl``
files of documents of varied length, the same bytes on every run. A BPE tokenizer is trained on a small
sample of it (``train_tokenizer``). Then, per repeat, in turn:

  raw sentencepiece  ``SentencePieceProcessor.encode(documents, num_threads=1)`` on the documents already
                     in memory: one thread, nothing but encoding (the ceiling of one worker)
  preprocess N       ``preprocess(files, model, prefix, "text", workers=N)``, the whole job: reading and
                     parsing the JSON lines, encoding, writing the .bin/.idx (and spawning the workers)

tokens/s counts the text's tokens (not the EOS appended per document) over the wall time. The table gives
the median over the repeats (and the fastest), and per worker the ratio
``(tokens/s at N workers / N) / raw single-thread tokens/s`` (target >= 0.8: the parallel machinery costs
< 20% of a worker's time). workers=1 encodes in-process over sentencepiece's own threads (all cores),
so its ratio can exceed 1. The outputs of every N are checked to be byte-identical.

Scale (``--scale-tokens``, default 2e8): a synthetic preprocessed dataset of that many tokens
(uint16, documents of 1000 tokens) is opened by ``build_data`` in a fresh process at ``model.seq_len`` 2,
i.e. 1e8 samples, with torch imported before measuring, as in a run: first as the builder (the ids are
scanned once, the permutation file written), then as a rank that finds the index files cached, and then
with the index files unused (``IndexFiles(None)``: the permutation built in the rank's memory, as before
they existed). Each reports the seconds to open the data and read the first batch, and the growth of the
process's resident memory (VmRSS) over the same process before opening (targets: cached open < 2 s,
growth < 50 MB).

    python bench/data.py [--mb 32] [--repeats 3] [--workers 1,2,4] [--scale-tokens 2e8] [--quick]

``--quick``: a ~1 MB corpus, one repeat and 2e6 tokens at scale, to check the script. Not a test.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import sentencepiece as spm  # noqa: E402

from megazero.data.indexed import IndexedDataset, IndexedDatasetBuilder, bin_path, index_path  # noqa: E402
from megazero.data.preprocess import preprocess  # noqa: E402
from megazero.data.tokenizer import train_tokenizer  # noqa: E402

SEED = 1234
FILES = 4
VOCAB = 8192
SAMPLE_DOCS = 300  # documents the tokenizer is trained on (keeps training to seconds)
_SYLLABLES = ["a", "an", "be", "ca", "de", "di", "el", "en", "er", "fo", "ga", "he", "in", "is", "ka", "la", "le",
              "lo", "ma", "me", "mi", "na", "ne", "no", "on", "or", "pa", "pe", "qu", "ra", "re", "ri", "ro", "sa",
              "se", "st", "ta", "te", "th", "ti", "to", "un", "ur", "va", "ve", "wi", "ya", "ze", "ing", "tion"]


def write_corpus(root: Path, total_bytes: int) -> list[Path]:
    """``FILES`` .jsonl files of about ``total_bytes`` of text in all; the same bytes for the same size."""
    rng = np.random.default_rng(SEED)
    words = np.array(sorted({"".join(rng.choice(_SYLLABLES, size=rng.integers(1, 5))) for _ in range(6000)}))
    freq = 1.0 / np.arange(1, len(words) + 1)  # Zipf: a few words are most of the text, as in English
    freq /= freq.sum()
    seps = np.array([" "] * 14 + [", ", ". ", ".\n"])
    files = [root / f"part-{i:02d}.jsonl" for i in range(FILES)]
    per_file = total_bytes // FILES
    for path in files:
        with path.open("w", encoding="utf-8") as f:
            written = 0
            while written < per_file:
                n = int(rng.integers(20, 1500))  # words: short notes to long articles
                text = "".join(np.char.add(words[rng.choice(len(words), size=n, p=freq)],
                                           seps[rng.integers(0, len(seps), size=n)]).tolist())
                line = json.dumps({"text": text[0].upper() + text[1:].rstrip() + "."}) + "\n"
                written += len(line)
                f.write(line)
    return files


def documents(files: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for path in files for line in path.open(encoding="utf-8")]


def raw_tokens_per_s(model: Path, docs: list[str]) -> tuple[float, int]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    t0 = time.perf_counter()
    ids = sp.encode(docs, num_threads=1)
    elapsed = time.perf_counter() - t0
    tokens = sum(map(len, ids))
    return tokens / elapsed, tokens


def preprocess_tokens_per_s(files: list[Path], model: Path, prefix: Path, workers: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    preprocess(files, model, prefix, "text", workers=workers)
    elapsed = time.perf_counter() - t0
    ds = IndexedDataset(prefix)
    digest = hashlib.sha256(bin_path(prefix).read_bytes() + index_path(prefix).read_bytes()).hexdigest()
    return (ds.n_tokens - len(ds)) / elapsed, digest


_OPEN = """
import json, sys, time
from types import SimpleNamespace
import torch  # a run has it: not counted as the data's
from megazero.data import build_data
from megazero.data import blend
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
prefix, tok, cache, role, seq = sys.argv[1:6]
if role == 'in memory':
    blend.IndexFiles.__init__ = lambda self, cache_dir, write: (setattr(self, 'dir', None), setattr(self, 'write', False))[0]
cfg = SimpleNamespace(paths=[prefix], tokenizer=tok, split='99,1', cache_dir=cache)
before, t0 = rss(), time.perf_counter()
data = build_data(cfg, %d, int(seq), 0, role == 'builder', lambda: None, train_samples=1000)
data.train_microbatches(12345, 0, 1, 4, 8)
print(json.dumps({'rss': rss() - before, 'seconds': time.perf_counter() - t0, 'samples': data.train_samples}))
""" % VOCAB


def scale(root: Path, model: Path, n_tokens: int, seq_len: int) -> None:
    """Open an ``n_tokens`` dataset as the builder, as a rank with the indices cached, and without them."""
    import subprocess

    doc = 1000
    rng = np.random.default_rng(SEED)
    t0 = time.perf_counter()
    with IndexedDatasetBuilder(root / "big", VOCAB) as b:
        for start in range(0, n_tokens, 1 << 24):
            chunk = rng.integers(3, VOCAB, min(1 << 24, n_tokens - start)).astype(np.uint16)
            for part in np.split(chunk, range(doc, len(chunk), doc)):
                b.add_document(part)
        b.finalize()
    print(f"\nscale: {n_tokens:.3g} tokens ({bin_path(root / 'big').stat().st_size / 1e6:.0f} MB .bin, "
          f"documents of {doc}), model.seq_len {seq_len}; written in {time.perf_counter() - t0:.1f} s\n")
    print("| open | samples | seconds (open + first batch) | resident memory growth MB |")
    print("|---|---|---|---|")
    for role in ("builder", "rank, indices cached", "in memory"):
        out = subprocess.run([sys.executable, "-c", _OPEN, str(root / "big"), str(model), str(root / "cache"),
                              role.split(",")[0], str(seq_len)], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])
        r = json.loads(out.stdout)
        print(f"| {role} | {r['samples']:,} | {r['seconds']:.2f} | {r['rss'] / 2 ** 20:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=32.0, help="corpus size in MB (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each contender (median quoted)")
    ap.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    ap.add_argument("--scale-tokens", type=float, default=2e8, help="tokens of the scale dataset (0: skip)")
    ap.add_argument("--scale-seq-len", type=int, default=2, help="model.seq_len at scale (2: 1e8 samples at 2e8)")
    ap.add_argument("--quick", action="store_true", help="a ~1 MB corpus, one repeat, 2e6 tokens at scale")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeats, args.scale_tokens = 1.0, 1, 2e6
    counts = [int(w) for w in args.workers.split(",")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        t0 = time.perf_counter()
        files = write_corpus(root / "corpus", int(args.mb * 1e6))
        docs = documents(files)
        sample = root / "sample.jsonl"
        sample.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:SAMPLE_DOCS]), encoding="utf-8")
        model = train_tokenizer([sample], VOCAB, root / "tok")
        size = sum(p.stat().st_size for p in files)
        print(f"corpus: {len(files)} .jsonl files, {size / 1e6:.1f} MB, {len(docs)} documents; "
              f"{VOCAB}-piece BPE trained on {min(SAMPLE_DOCS, len(docs))} documents; "
              f"setup {time.perf_counter() - t0:.1f} s; "
              f"{cores} cores, load average {os.getloadavg()[0]:.1f} (other work shares them above ~0)")

        raw: list[float] = []
        runs: dict[int, list[float]] = {n: [] for n in counts}
        digests: set[str] = set()
        tokens = 0
        for repeat in range(args.repeats):
            rate, tokens = raw_tokens_per_s(model, docs)
            raw.append(rate)
            for n in counts:
                rate, digest = preprocess_tokens_per_s(files, model, root / f"out-{n}", n)
                runs[n].append(rate)
                digests.add(digest)
            print(f"repeat {repeat + 1}/{args.repeats}: raw {raw[-1] / 1e6:.2f} M tok/s, "
                  + ", ".join(f"{n} workers {runs[n][-1] / 1e6:.2f} M tok/s" for n in counts), flush=True)
        if len(digests) != 1:
            raise SystemExit(f"outputs differ between worker counts {counts}: {len(digests)} distinct .bin/.idx")
        report_throughput(args, raw, runs, counts, tokens, cores)
        if args.scale_tokens:
            scale(root, model, int(args.scale_tokens), args.scale_seq_len)


def report_throughput(args, raw: list[float], runs: dict[int, list[float]], counts: list[int], tokens: int,
                      cores: int) -> None:
    """The throughput table: medians, fastest, and the per-worker ratio to raw sentencepiece."""
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    base = statistics.median(raw)
    print(f"\n{tokens} tokens per pass; medians of {args.repeats} repeats (fastest in brackets); "
          f"outputs byte-identical for workers {counts}\n")
    print("| contender | tokens/s | per worker / raw 1-thread |")
    print("|---|---|---|")
    print(f"| raw sentencepiece, 1 thread | {base / 1e6:.2f} M ({max(raw) / 1e6:.2f} M) | 1.00 |")
    for n in counts:
        med = statistics.median(runs[n])
        note = f" ({cores} threads)" if n == 1 else ""
        print(f"| preprocess, {n} worker{'s' if n > 1 else ''}{note} | {med / 1e6:.2f} M "
              f"({max(runs[n]) / 1e6:.2f} M) | {med / n / base:.2f} |")
    over = [n for n in counts if n > cores]
    print(f"\nThis machine has {cores} cores: workers=1 encodes over {cores} threads, and with more workers "
          f"than cores" + (f" ({', '.join(map(str, over))})" if over else "")
          + " the workers share them (and the reading process), so the per-worker ratio there "
          "measures the machine, not the overhead.")


if __name__ == "__main__":
    main()
