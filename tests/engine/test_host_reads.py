"""A training step reads the device from the host twice: the optimizer's one wait (the agreed flags and the
gradient norm, which decide whether and how far to step) and the loss to log. On a GPU each read waits for the
stream, and one after the update keeps the host from queueing the next step's work meanwhile. Counted here on
the CPU, where every read goes through the same tensor methods: each call of the ones that copy a value to
the host (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``numpy``, ``cpu``, ``nonzero``) made during a
step, after the first step (which builds what it caches)."""
from __future__ import annotations

import collections
import traceback

import torch

from megazero.train import trainer
from megazero.train.run import run
from tests.runs import ROOT, small_overrides, write_corpus

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy", "cpu", "nonzero")


def test_a_step_reads_the_device_twice(tmp_path, monkeypatch):
    seen: list[collections.Counter] = []
    active: list = [None]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if active[0] is not None:
                here = [f for f in traceback.extract_stack()[:-1] if "megazero" in f.filename or "/parallel/" in
                        f.filename]
                active[0][(_name, f"{here[-2].name} < {here[-1].name}" if len(here) > 1 else "?")] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    step = trainer.Trainer.train_step

    def watched(self):
        active[0] = collections.Counter()
        try:
            return step(self)
        finally:
            seen.append(active[0])
            active[0] = None
    monkeypatch.setattr(trainer.Trainer, "train_step", watched)
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    run(str(ROOT / "configs" / "tiny-llama.yaml"),
        small_overrides(text, cache, tmp_path / "run", steps=3, **{"model.arch": "llama", "model.kv_heads": 2}))
    assert len(seen) == 3
    for reads in seen[1:]:
        assert sum(reads.values()) == 2, reads
        assert sorted(where for _, where in reads) == ["step < host_values", "train_step < host_values"], reads
