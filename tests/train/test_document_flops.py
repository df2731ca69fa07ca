"""Throughput and MFU count only the attention a document mask leaves: the kernels skip the masked blocks.

A run's metrics give FLOPs per token as tflops * 1e12 * world / tokens_per_s (both divide by the same step
time). Each step's figure must be the causal count with its attention part scaled by the share of the
causal mask the documents keep, computed here by walking the step's samples token by token. Without the mask
it is the causal count. Relative tolerance 1e-9: the same float64 arithmetic in another order, through JSON.
"""
from __future__ import annotations

import pytest
import torch

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.costs import attention_flops_per_token, model_flops_per_token
from megazero.train.run import run
from megazero.train.trainer import Trainer
from megazero.parallel.topology import Grid
from tests.runs import ROOT, read_metrics, small_overrides, write_corpus

CONFIG = str(ROOT / "configs" / "tiny.yaml")
STEPS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short documents (one file each): the interpreter's documentation topics cut at blank lines, so that
    most samples of 256 tokens pack several documents."""
    base = tmp_path_factory.mktemp("data")
    topics = write_corpus(base / "topics")
    text = base / "text"
    text.mkdir()
    for i, paragraph in enumerate(p for f in sorted(topics.iterdir()) for p in f.read_text().split("\n\n")):
        if paragraph.strip():
            (text / f"{i:05d}.txt").write_text(paragraph)
    return text, base / "cache"


def _kept_share(row: list[int], eos: int) -> float:
    """The causal entries a document mask keeps in one row, by walking it: token j sees the earlier tokens of
    its document and itself."""
    kept, start = 0, 0
    for j, token in enumerate(row):
        kept += j - start + 1
        if token == eos:
            start = j + 1
    return kept / (len(row) * (len(row) + 1) / 2)


def _flops_per_token(records: list[dict]) -> list[float]:
    return [r["tflops"] * 1e12 / r["tokens_per_s"] for r in records]  # world 1


@pytest.mark.parametrize("masked", [True, False])
def test_the_counted_flops_are_the_attention_the_mask_keeps(corpus, tmp_path, masked):
    text, cache = corpus
    sets = small_overrides(text, cache, tmp_path / "run", steps=STEPS, **{
        "model.seq_len": 256, "data.document_mask": str(masked).lower()})
    run(CONFIG, sets)
    cfg = resolve(load_config(CONFIG, sets), 1, "cpu")
    data = Trainer(cfg, Grid.build(1, 1, 1, "cpu"), torch.device("cpu")).data
    causal, attention = model_flops_per_token(cfg.model), attention_flops_per_token(cfg.model)
    assert 0 < attention < causal
    t = cfg.train
    expected = []
    for step in range(STEPS):
        rows = [r for mb in data.train_microbatches(step * t.global_batch, 0, 1, t.micro_batch, t.global_batch)
                for r in mb[:, :-1].tolist()]
        share = sum(_kept_share(r, data.eos_id) for r in rows) / len(rows) if masked else 1.0
        expected.append(causal - attention * (1 - share))
    assert _flops_per_token(read_metrics(tmp_path / "run")) == pytest.approx(expected, rel=1e-9)
    if masked:  # the corpus's documents end inside these samples: the count really shrinks
        assert max(expected) < causal
