"""1-bit Adam in whole runs (pretrain's loop, 4 gloo ranks): tp 2 with sequence parallelism x dp 2 at ZeRO 1, a
warm-up of 3 steps in 10. A checkpoint past the warm-up resumes exactly at its own layout (the error buffers are
saved per rank): every step's loss and norm, and every stored tensor at the end; so does a run stopped by SIGTERM
and resumed with resume=auto. It is refused, in one line, at dp 4 (naming every changed key) or with another
warm-up; a checkpoint within the warm-up (AdamW's states only), its last step included, continues at dp 4. The compressed bytes per step
reach metrics.jsonl. Bad settings are one line and exit 2.

Exact: a resume at the same layout repeats the same operations on the same values (fp32, the CPU)."""
from __future__ import annotations

import pytest

from megazero.train.run import run
from tests.dist import run_ranks
from tests.runs import assert_resume_exact, read_metrics, ROOT, small_overrides, write_corpus

CONFIG = str(ROOT / "configs" / "tiny.yaml")
STEPS, FREEZE, SAVED, SIGNALLED = 10, 3, 6, 6  # SAVED: a multiple of EARLY (the saves' period)
EARLY = FREEZE  # the warm-up's last step: no compressed step has run, the states are AdamW's
ONEBIT = {"optim.name": "onebit_adam", "optim.onebit_adam.freeze_step": FREEZE, "train.lr": "2.0e-3", "zero.stage": 1,
          "zero.bucket_mb": 0.02}
TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]


def _overrides(text, cache, log_dir, extra=()):
    return small_overrides(text, cache, log_dir, steps=STEPS, **ONEBIT) + list(extra)


def _ranks(rank, world, text, cache, base):
    from megazero.errors import UserError

    from megazero.checkpoint import store

    # the uninterrupted run saves at EARLY and SAVED (and 9, 10): the resumed runs start from those saves
    run(CONFIG, _overrides(text, cache, base / "whole", TP2 + [f"train.save_every={EARLY}", "train.keep_last=4"]))
    saved = store.checkpoint_dir(base / "whole" / "checkpoints", SAVED)
    run(CONFIG, _overrides(text, cache, base / "resumed", TP2 + [f"train.resume={saved}"]))
    refused = []
    for extra in (["parallel.dp=4"], TP2 + [f"optim.onebit_adam.freeze_step={FREEZE + 1}"]):
        try:
            run(CONFIG, _overrides(text, cache, base / "refused", extra + [f"train.resume={saved}"]))
            refused.append(None)
        except UserError as e:
            refused.append(str(e))
    _preempted(rank, text, cache, base / "preempted")
    run(CONFIG, _overrides(text, cache, base / "preempted", TP2 + ["train.resume=auto"]))
    early = store.checkpoint_dir(base / "whole" / "checkpoints", EARLY)
    run(CONFIG, _overrides(text, cache, base / "early_dp4", ["parallel.dp=4", f"train.resume={early}"]))
    return refused


def _preempted(rank, text, cache, log_dir):
    """SIGTERM to rank 0 once its step SIGNALLED has run: the ranks agree on the stop in the next step, save it
    and stop (``megazero.errors.Preempted``), as under a scheduler's preemption."""
    import os
    import signal

    from megazero.errors import Preempted
    from megazero.train import trainer

    original, calls = trainer.train_step, []

    def step_then_signal(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if rank == 0 and len(calls) == SIGNALLED:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    trainer.train_step = step_then_signal
    try:
        run(CONFIG, _overrides(text, cache, log_dir, TP2))
        raise AssertionError("the run was not stopped")
    except Preempted:
        pass
    finally:
        trainer.train_step = original


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("onebit")
    text, cache = write_corpus(base / "text"), base / "cache"
    run(CONFIG, small_overrides(text, cache, base / "build", steps=1))  # builds the data the ranks read
    refused = run_ranks(4, _ranks, text, cache, base)
    return base, refused


def _records(folder):
    return [r for r in read_metrics(folder) if "loss" in r]


def test_a_resume_past_the_warm_up_is_exact_at_its_layout(runs):
    base, _ = runs
    assert_resume_exact(base / "whole", base / "resumed", SAVED, STEPS)
    whole = _records(base / "whole")
    # the steps past the warm-up sent their compressed momenta, the warm-up none
    assert all(r["optim/compressed_bytes"] == 0 for r in whole[:FREEZE])
    assert all(r["optim/compressed_bytes"] > 0 for r in whole[FREEZE:])


def test_a_preempted_run_resumes_exactly(runs):
    """The stop is agreed in the step after the signal, so the save is of step SIGNALLED + 1; resume=auto
    continues from it in the same log.dir."""
    base, _ = runs
    from megazero.checkpoint import store

    saved = [int(p.name.split("_")[-1]) for p in store.list_checkpoints(base / "preempted" / "checkpoints")]
    assert saved[0] == SIGNALLED + 1, saved
    stopped = [r["step"] for r in _records(base / "preempted")]
    assert stopped[:SIGNALLED + 1] == list(range(1, SIGNALLED + 2)), stopped
    assert_resume_exact(base / "whole", base / "preempted", SIGNALLED + 1, STEPS)


def test_a_resume_past_the_warm_up_elsewhere_is_refused_in_one_line(runs):
    _, refused = runs
    for line in refused:
        assert line is not None and "\n" not in line
    dp, freeze = refused[0]
    assert "parallel.dp is 2 there and 4 here" in dp and "error-feedback buffers are per rank" in dp, dp
    assert f"optim.onebit_adam.freeze_step is {FREEZE} there and {FREEZE + 1} here" in freeze, freeze


def test_a_checkpoint_within_the_warm_up_continues_at_another_dp(runs):
    base, _ = runs
    got = _records(base / "early_dp4")
    assert [r["step"] for r in got] == list(range(EARLY + 1, STEPS + 1))
    assert all(r["optim/compressed_bytes"] > 0 for r in got if r["step"] > FREEZE)


def test_the_plan_counts_the_states_kept_past_the_warm_up(runs):
    """Past the warm-up every rank keeps the whole momentum, a scale-group byte and a worker error per element
    (the server error on a 1/dp chunk, the variance on the shard): the dry run's optimizer bytes are the logged
    ones (the largest rank's), within the buckets' padding (each bucket's momentum is padded to 8 x dp elements,
    at most 9 bytes each beyond the plan's) and the log's rounding (1e-9 GB: 1 byte); both are 896,064 bytes here.
    Planned as AdamW's sharded moments, the dry run counted 275,712: under a third of what a rank holds."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.stage_plan import make_plan

    base, _ = runs
    logged = [r for r in read_metrics(base / "whole") if "optimizer_gb" in r]
    assert logged[-1]["step"] == STEPS > FREEZE, logged[-1]
    measured = logged[-1]["optimizer_gb"] * 1e9
    cfg = resolve(load_config(CONFIG, _overrides(base / "text", base / "cache", base / "plan", TP2)), 4, "cpu")
    planned = max(s.model_state["optimizer"] for s in make_plan(cfg).stages)
    buckets = 64  # more than the run has: tp 2 splits ~120k parameters into 20 kB buckets
    assert abs(measured - planned) <= buckets * 8 * 2 * 9 + 1, (measured, planned)


def _argv(overrides: list[str]) -> list[str]:
    return ["--config", CONFIG] + [a for o in overrides for a in ("--set", o)]


def test_bad_settings_are_one_line(tmp_path, capsys):
    from tests.hostile import assert_one_line, call, pretrain_main

    sets = small_overrides(write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run", steps=STEPS,
                           **ONEBIT)
    for stage in (2, 3):
        code, _, err = call(pretrain_main, _argv(sets + [f"zero.stage={stage}"]), capsys)
        assert_one_line(code, err, "zero.stage", str(stage), "onebit_adam", "use 0 or 1")
    code, _, err = call(pretrain_main, _argv(sets + ["zero.offload_optimizer=cpu"]), capsys)
    assert_one_line(code, err, "zero.offload_optimizer", "cpu", "onebit_adam")
    code, _, err = call(pretrain_main, _argv(sets + [f"optim.onebit_adam.freeze_step={STEPS}"]), capsys)
    assert_one_line(code, err, "optim.onebit_adam.freeze_step", str(STEPS), f"train.steps={STEPS}")
    code, _, err = call(pretrain_main, _argv(sets + ["optim.onebit_adam.freeze_step=0"]), capsys)
    assert_one_line(code, err, "optim.onebit_adam.freeze_step", ">= 1")
