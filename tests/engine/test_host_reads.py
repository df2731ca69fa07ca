"""A training step reads the device from the host once: the optimizer's one wait (the agreed flags and the
gradient norm, which decide whether and how far to step); a logged step reads its loss and memory figures
too. On a GPU each read waits for the stream, and one after the update keeps the host from queueing the next
step's work meanwhile. Counted here on the CPU, where every read goes through the same tensor methods: each
call of the ones that copy a value to the host (``tolist``, ``item``, ``bool``, ``int``, ``float``,
``numpy``, ``cpu``, ``nonzero``) made from a step's start to the next's, after the first step (which builds
what it caches)."""
from __future__ import annotations

import collections
import traceback

import torch

from megazero.train import trainer
from megazero.train.run import run
from tests.runs import ROOT, small_overrides, write_corpus

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy", "cpu", "nonzero")


def test_a_step_reads_the_device_once_and_a_logged_step_twice(tmp_path, monkeypatch):
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
    step, close = trainer.Trainer.train_step, trainer.MetricsLogger.close

    def watched(self):  # a step's reads: from its start to the next step's (the last: to the logs' closing)
        active[0] = collections.Counter()
        seen.append(active[0])
        return step(self)

    def closed(self):
        active[0] = None
        return close(self)
    monkeypatch.setattr(trainer.Trainer, "train_step", watched)
    monkeypatch.setattr(trainer.MetricsLogger, "close", closed)
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    run(str(ROOT / "configs" / "tiny-llama.yaml"),
        small_overrides(text, cache, tmp_path / "run", steps=5, **{"model.arch": "llama", "model.kv_heads": 2,
                                                                  "log.every": 4}))
    assert len(seen) == 5
    for reads in seen[1:3]:  # steps 2 and 3, not logged: the optimizer's one wait
        assert [where for _, where in reads] == ["step < host_values"] and sum(reads.values()) == 1, reads
    # step 4, logged: and its loss and the memory figures, read to be logged (step 5 is the last: it saves)
    assert sorted(where for _, where in seen[3]) == ["_host_loss < host_values", "fit < memory_record",
                                                     "step < host_values"], seen[3]
    assert sum(seen[3].values()) == 3, seen[3]
