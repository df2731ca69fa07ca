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

    python bench/data.py [--mb 32] [--repeats 3] [--workers 1,2,4] [--quick]

``--quick``: a ~1 MB corpus and one repeat, to check the script. Not a test.
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

from megazero.data.indexed import IndexedDataset, bin_path, index_path  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=32.0, help="corpus size in MB (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each contender (median quoted)")
    ap.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    ap.add_argument("--quick", action="store_true", help="a ~1 MB corpus and one repeat: checks the script")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeats = 1.0, 1
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
