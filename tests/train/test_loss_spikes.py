"""train.on_spike: a poisoned global batch (the test's data source scrambles the token ids of step 12's batch)
is a spike; ``rollback`` goes back to the checkpoint from before the window and skips the batches through the
spike, and the run then equals one whose data never had them; ``stop`` exits 3 in one line.

Sizes: the tiny GPT in fp32, 20 steps, a window of 4 and z 6. The poisoned loss (6.29) stands 9.9 standard
deviations above its window (mean 5.85, std 0.044, measured); no clean step of these runs exceeds z 6. Exactness:
the rolled-back run loads the very state the reference holds at step 8 and then reads the same samples at the
same steps, so its losses and final weights equal the reference's bit for bit. At tp 2 x pp 2 x dp 2 the layout
sums in another order: the curve within 1e-5 relative of one process (fp32 layouts: ~1e-6).
"""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from megazero.checkpoint.store import read_meta, read_model_state
from megazero.config.load import load_config
from megazero.data.gpt_data import GPTData
from megazero.errors import LossSpikeStop, UserError
from megazero.train.loss_spikes import SpikeWatch, rollback_target
from megazero.train.run import run
from tests.dist import run_ranks
from tests.runs import assert_curves_match, read_metrics, ROOT, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
GB, STEPS, POISONED, WINDOW = 8, 20, 12, 4
ORIGINAL = GPTData.train_microbatches
BACK_TO = 8  # the newest checkpoint (every 2 steps) at or before step POISONED - WINDOW
SPIKES = {"train.save_every": 2, "train.keep_last": 12, "train.spike_window": WINDOW, "train.spike_z": 6,
          "train.global_batch": GB}


def _data(poison: bool = True, skip: int = 0):
    """GPTData.train_microbatches as the test's data source: step POISONED's batch replaced by random ids
    (``poison``), or the data of a run that never had the ``skip`` batches after step BACK_TO."""

    def microbatches(self, consumed, dp_rank, dp, micro_batch, global_batch):
        if skip and consumed >= BACK_TO * global_batch:
            consumed += skip * global_batch
        out = ORIGINAL(self, consumed, dp_rank, dp, micro_batch, global_batch)
        if poison and consumed == (POISONED - 1) * global_batch:  # each token id scrambled: alike at any layout
            out = [(m * 211 + 97) % 512 for m in out]
        return out
    return microbatches


def _overrides(tmp_path, folder, *extra, **values):
    text, cache = write_corpus(tmp_path / "text"), tmp_path / "cache"
    return small_overrides(text, cache, tmp_path / folder, steps=STEPS, **{**SPIKES, **values}) + list(extra)


def _curve(folder):
    """{step: record}: a step's last record is the one the run kept (a rollback's steps come again)."""
    return {r["step"]: r for r in read_metrics(folder) if "loss" in r and "spike_z" not in r}


def _last(folder):
    return read_model_state(max((folder / "checkpoints").glob("step_*"))) if folder.exists() else None


def test_a_spike_rolls_back_skips_its_batches_and_trains_as_if_they_never_were(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(GPTData, "train_microbatches", _data(poison=False, skip=POISONED - BACK_TO))
    run(TINY, _overrides(tmp_path, "never", **{"train.on_spike": "rollback"}))
    monkeypatch.setattr(GPTData, "train_microbatches", _data())
    run(TINY, _overrides(tmp_path, "rolled", **{"train.on_spike": "rollback"}))
    out = capsys.readouterr().out
    assert (f"rolled back to step {BACK_TO} and skipped the global batches of steps {BACK_TO + 1}-{POISONED} (4; "
            "rollback 1 of train.max_rollbacks=5)") in out, out[-3000:]
    records = read_metrics(tmp_path / "rolled")
    spikes = [r for r in records if "spike_z" in r]
    assert [r["step"] for r in spikes] == [POISONED] and spikes[0]["spike_z"] > 6, spikes
    assert [(r["step"], r["rolled_back_to"], r["skipped_batches"]) for r in records if "rolled_back_to" in r] == \
        [(POISONED, BACK_TO, 4)]
    want, got = _curve(tmp_path / "never"), _curve(tmp_path / "rolled")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert [got[s]["loss"] for s in want] == [want[s]["loss"] for s in want]  # bit for bit
    assert [got[s]["grad_norm"] for s in want] == [want[s]["grad_norm"] for s in want]
    a, b = _last(tmp_path / "never"), _last(tmp_path / "rolled")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the rollback saved step 8 again, past the spike: resumed from it, the run never sees the poison again
    saved = read_meta(tmp_path / "rolled" / "checkpoints" / f"step_{BACK_TO:08d}")
    assert (saved["consumed_samples"], saved["rollbacks"], saved["skipped_batches"]) == (POISONED * GB, 1, 4)
    assert len(saved["loss_window"]) == WINDOW
    run(TINY, _overrides(tmp_path, "resumed", f"train.resume={tmp_path / 'rolled' / 'checkpoints'}/"
                                              f"step_{BACK_TO:08d}", **{"train.on_spike": "rollback"}))
    resumed = read_metrics(tmp_path / "resumed")
    assert not [r for r in resumed if "spike_z" in r], resumed
    got = _curve(tmp_path / "resumed")
    assert [got[s]["loss"] for s in range(BACK_TO + 1, STEPS + 1)] == \
        [want[s]["loss"] for s in range(BACK_TO + 1, STEPS + 1)]


def test_a_run_stopped_before_the_spike_and_resumed_rolls_back_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """Stopped at step 10 (saved) and resumed: the window of losses comes back from meta.json, so step 12 is judged
    as in the uninterrupted run, rolled back to step 8 alike, and every later loss and the final weights equal it
    bit for bit. Resumed with an empty window, step 12 would not be judged (4 losses needed) and the run would
    train through the poison."""
    monkeypatch.setattr(GPTData, "train_microbatches", _data())
    spikes = {"train.on_spike": "rollback"}
    run(TINY, _overrides(tmp_path, "whole", **spikes))
    run(TINY, _overrides(tmp_path, "halves", "train.exit_after=10", **spikes))
    run(TINY, _overrides(tmp_path, "halves", "train.resume=auto", **spikes))
    events = [[(r["step"], r["rolled_back_to"]) for r in read_metrics(tmp_path / f) if "rolled_back_to" in r]
              for f in ("whole", "halves")]
    assert events[0] == events[1] == [(POISONED, BACK_TO)], events
    want, got = _curve(tmp_path / "whole"), _curve(tmp_path / "halves")
    assert [got[s]["loss"] for s in sorted(want)] == [want[s]["loss"] for s in sorted(want)]
    a, b = _last(tmp_path / "whole"), _last(tmp_path / "halves")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stop_exits_3_in_one_line_naming_the_step_and_the_z_score(tmp_path, monkeypatch):
    monkeypatch.setattr(GPTData, "train_microbatches", _data())
    with pytest.raises(LossSpikeStop) as err:
        run(TINY, _overrides(tmp_path, "run", **{"train.on_spike": "stop"}))
    assert err.value.exit_code == 3
    message = str(err.value)
    assert message.startswith(f"step {POISONED}: loss 6.2") and " standard deviations above the last 4 steps' " \
        "mean " in message and message.endswith("(train.spike_z=6); stopped before saving (train.on_spike=rollback "
                                                "would roll back and skip the batches)"), message
    assert "\n" not in message
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved[-1] == f"step_{POISONED - 2:08d}", saved  # the spike's state is never saved


def test_the_rollbacks_end_at_max_rollbacks(tmp_path, monkeypatch):
    monkeypatch.setattr(GPTData, "train_microbatches", _data())
    with pytest.raises(LossSpikeStop, match=rf"^step {POISONED}: .*; train.max_rollbacks=0 rollbacks already made, "
                                            r"so the run stops before saving$"):
        run(TINY, _overrides(tmp_path, "run", **{"train.on_spike": "rollback", "train.max_rollbacks": 0}))


def test_the_window_judges_only_when_full_and_never_a_non_finite_loss():
    watch = SpikeWatch("stop", 3, 6.0, 0)
    assert [watch.check(s, x) for s, x in enumerate([1.0, 50.0, float("nan"), 1.1])] == [None] * 4
    assert list(watch.losses) == [1.0, 50.0, 1.1]  # full now: a loss past mean + 6 std would be a spike
    window = [1.0, 50.0, 1.1]
    assert watch.check(5, 200.0).z == pytest.approx((200 - statistics.mean(window)) / statistics.stdev(window))
    assert watch.check(6, 60.0) is None and list(watch.losses) == [50.0, 1.1, 60.0]


def test_the_rollback_target_is_on_this_runs_current_line(tmp_path):
    """Saves in the order written: run A at 2, 4, 6, 8; another run's step 7; A rolled back to 4 and saved 4 and
    6 again. At limit 8 the target is A's new 6: neither the abandoned 8 nor the other run's 7."""
    for sequence, (step, run_id) in enumerate([(2, "A"), (8, "A"), (7, "B"), (4, "A"), (6, "A")], start=1):
        folder = tmp_path / f"step_{step:08d}"
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"format": 1, "step": step, "sequence": sequence,
                                                      "run_id": run_id}))
    assert rollback_target(tmp_path, "A", 8).name == "step_00000006"
    assert rollback_target(tmp_path, "A", 5).name == "step_00000004"
    assert rollback_target(tmp_path, "A", 1) is None
    assert rollback_target(tmp_path, "B", 8).name == "step_00000007"


def test_a_spike_that_finds_no_checkpoint_before_its_window_stops_in_one_line(tmp_path, monkeypatch):
    """A window of 8 (z 2.5: the poisoned loss stands 3.0 std above steps 4-11, measured; every clean step of
    these 12 is below its window's mean) and saves every 5 steps: the spike at step 12 needs a checkpoint at or
    before step 4, and only steps 5 and 10 exist. The config passes ((3 - 1) x 5 >= 8): on the cadence one is
    kept, but not this early in the run."""
    monkeypatch.setattr(GPTData, "train_microbatches", _data())
    with pytest.raises(LossSpikeStop, match=rf"^step {POISONED}: .*; no checkpoint of this run at or before step 4 "
                                            r"\(the spike's window\) is left to roll back to in .*; stopped before "
                                            r"saving$"):
        run(TINY, _overrides(tmp_path, "run", **{"train.on_spike": "rollback", "train.save_every": 5,
                                                 "train.keep_last": 3, "train.spike_window": 8,
                                                 "train.spike_z": 2.5}))


@pytest.mark.parametrize("key, value, valid", [
    ("train.spike_z", 0, "must be >= 1e-09"), ("train.spike_window", 1, "must be >= 2"),
    ("train.max_rollbacks", -1, "must be >= 0"),
])
def test_bad_spike_settings_are_one_line(key, value, valid):
    with pytest.raises(UserError, match=rf"^{TINY}: {key}={value}(\.0)? is invalid; {valid}"):
        load_config(TINY, [f"{key}={value}"])


def test_a_rollback_that_keeps_no_checkpoint_from_before_the_window_is_refused():
    with pytest.raises(UserError, match=r"train.on_spike='rollback' is invalid; rolls back to a checkpoint at least "
                                        r"train.spike_window=100 steps before the spike, but \(train.keep_last - 1\) "
                                        r"x train.save_every = \(2 - 1\) x 50 = 50 steps back is the oldest kept"):
        load_config(TINY, ["train.on_spike=rollback", "train.save_every=50"])


LAYOUTS = {8: ("tp2_pp2_dp2", ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]),
           4: ("cp2_dp2_z3", ["parallel.cp=2", "parallel.dp=2", "zero.stage=3", "zero.bucket_mb=0.02"])}


def _layout(rank, world, tmp_path):
    GPTData.train_microbatches = _data()  # this rank's own process
    name, extra = LAYOUTS[world]
    run(TINY, _overrides(tmp_path, name, *extra, **{"train.on_spike": "rollback"}))
    return True


def test_the_same_spike_rolls_back_alike_at_tp2_pp2_dp2_and_cp2_dp2_zero3(tmp_path, monkeypatch):
    """Pipeline, tensor and data parallel; context parallel with ZeRO 3 over several buckets: the loss every
    rank agrees is the global batch's at each, so each rolls back at the same step, skipping the same batches."""
    monkeypatch.setattr(GPTData, "train_microbatches", _data())
    run(TINY, _overrides(tmp_path, "one", **{"train.on_spike": "rollback"}))
    for world, (name, _) in LAYOUTS.items():
        run_ranks(world, _layout, tmp_path)
        one, many = read_metrics(tmp_path / "one"), read_metrics(tmp_path / name)
        events = [[(r["step"], r["rolled_back_to"], r["skipped_batches"]) for r in rs if "rolled_back_to" in r]
                  for rs in (one, many)]
        assert events[0] == events[1] == [(POISONED, BACK_TO, 4)], (name, events)
        want, got = _curve(tmp_path / "one"), _curve(tmp_path / name)
        assert_curves_match(name, [want[s] for s in sorted(want)], [got[s] for s in sorted(got)])


ONEBIT = {"optim.name": "onebit_adam", "optim.onebit_adam.freeze_step": BACK_TO, "zero.stage": 1,
          "parallel.dp": 2, "train.on_spike": "rollback"}


def _onebit(rank, world, tmp_path):
    GPTData.train_microbatches = _data(poison=False, skip=POISONED - BACK_TO)
    run(TINY, _overrides(tmp_path, "onebit_never", **ONEBIT))
    GPTData.train_microbatches = _data()
    run(TINY, _overrides(tmp_path, "onebit_rolled", **ONEBIT))
    return True


def test_a_rollback_into_the_onebit_warm_up_forgets_the_later_error_feedback(tmp_path):
    """1-bit Adam at dp 2 compresses from step BACK_TO + 1 (its warm-up ends at the checkpoint rolled back to):
    the rolled-back run must start its compressed steps from zero error feedback, as a run that never had the
    poisoned batches does; with the error feedback of steps 9-12 kept, its losses part from step 10 on."""
    run_ranks(2, _onebit, tmp_path)
    want, got = _curve(tmp_path / "onebit_never"), _curve(tmp_path / "onebit_rolled")
    assert [(r["step"], r["rolled_back_to"]) for r in read_metrics(tmp_path / "onebit_rolled")
            if "rolled_back_to" in r] == [(POISONED, BACK_TO)]
    assert [got[s]["loss"] for s in sorted(want)] == [want[s]["loss"] for s in sorted(want)]  # bit for bit
