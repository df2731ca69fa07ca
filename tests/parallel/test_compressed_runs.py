"""0/1 Adam and 1-bit LAMB in whole runs (pretrain's loop, 4 gloo ranks): tp 2 with sequence parallelism x dp 2
at ZeRO 1, 30 steps, var_freeze_step 6, kappa 2, local_step_scaler 4, H 4, so the ranks take local steps from
step 11 and the save at step 15 falls inside a synchronisation interval (14 synchronised, 16 next): each rank's
momentum, accumulator and weights are its own there. Resumed from it at the same layout the run is exact (every
step's loss and norm, every stored tensor at the end, each rank's own); resumed with the error feedback dropped
(the loaded buffers zeroed) its losses part from the step after the save's first synchronisation, so the test
would fail against such a resume. Another dp is refused in one line. 1-bit LAMB (a warm-up of 10, 20 steps)
resumes exactly from its save at 15 and is refused at another dp the same way. A resume may switch to AdamW on
request (optim.switch_from). Under fp16 with skipped steps the last train step still synchronises. The metrics
reach metrics.jsonl: bytes sent, the share of silent steps, the intervals; the optimizer bytes at the end are
the planner's. Bad settings are one line and exit 2.

Exact: a resume at the same layout repeats the same operations on the same values (fp32, the CPU)."""
from __future__ import annotations

from unittest.mock import patch

import pytest

from megazero.train.run import run
from tests.dist import run_ranks
from tests.runs import assert_resume_exact, read_metrics, ROOT, small_overrides, write_corpus

CONFIG = str(ROOT / "configs" / "tiny.yaml")
STEPS, SAVED = 30, 15
AFTER = 5  # the dropped-feedback and switched resumes stop this many steps after the save (train.exit_after)
SKIPS = 22  # the fp16 run's steps: its last, less the 4 skipped, is optimizer step 18, inside an interval of 4
ZERO_ONE = {"optim.name": "zero_one_adam", "optim.zero_one_adam.var_freeze_step": 6,
            "optim.zero_one_adam.var_update_scaler": 2, "optim.zero_one_adam.local_step_scaler": 4,
            "optim.zero_one_adam.local_step_clipper": 4, "train.lr": "2.0e-3", "zero.stage": 1,
            "zero.bucket_mb": 0.02}
TP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2"]
ONEBIT_LAMB = ["optim.name=onebit_lamb", "optim.onebit_lamb.freeze_step=10", "train.lr=1.0e-2", "train.steps=20"]
LAMB_STEPS = 20  # its save at 15 is past the warm-up; 5 steps after it show the resume


def _overrides(text, cache, log_dir, extra=()):
    return small_overrides(text, cache, log_dir, steps=STEPS, **ZERO_ONE) + list(extra)


def _ranks(rank, world, text, cache, base):
    from megazero.checkpoint import store
    from megazero.errors import UserError
    from megazero.parallel.zero.zero_one_adam import ShardedZeroOneAdam

    run(CONFIG, _overrides(text, cache, base / "whole", TP2 + [f"train.save_every={SAVED}"]))
    saved = store.checkpoint_dir(base / "whole" / "checkpoints", SAVED)
    run(CONFIG, _overrides(text, cache, base / "resumed", TP2 + [f"train.resume={saved}"]))
    loaded, own_state = ShardedZeroOneAdam.states_loaded, ShardedZeroOneAdam.rank_state

    def without_feedback(self):
        loaded(self)
        for t in self.worker + self.server:
            t.zero_()

    with patch.object(ShardedZeroOneAdam, "states_loaded", without_feedback):
        run(CONFIG, _overrides(text, cache, base / "dropped", TP2 + [f"train.resume={saved}",
                                                                    f"train.exit_after={AFTER}"]))

    def without_silent(self, step):  # a checkpoint as megazero wrote it before it kept the silent-step count
        return {k: t for k, t in own_state(self, step).items() if k != "silent"}

    with patch.object(ShardedZeroOneAdam, "rank_state", without_silent):
        run(CONFIG, _overrides(text, cache, base / "old", TP2 + [f"train.save_every={SAVED}",
                                                                 f"train.exit_after={SAVED}"]))
    run(CONFIG, _overrides(text, cache, base / "old_resumed", TP2 + [
        f"train.resume={store.checkpoint_dir(base / 'old' / 'checkpoints', SAVED)}", f"train.exit_after={AFTER}"]))
    run(CONFIG, _overrides(text, cache, base / "switched", TP2 + [f"train.resume={saved}", "optim.name=adamw",
                                                                 "optim.switch_from=zero_one_adam",
                                                                 f"train.exit_after={AFTER}"]))
    from megazero.engine import build

    make_scaler = build.make_scaler

    def overflowing(precision: str):  # from 2^20 the first steps overflow
        scaler = make_scaler(precision)
        scaler.scale = 2.0 ** 20
        return scaler

    with patch.object(build, "make_scaler", overflowing):
        run(CONFIG, _overrides(text, cache, base / "skips", TP2 + ["train.precision=fp16", f"train.steps={SKIPS}"]))
    refused = []
    for name, extra in (("refused", []), ("lamb_refused", ONEBIT_LAMB)):
        folder = "whole" if name == "refused" else "lamb_whole"
        if name == "lamb_refused":  # 1-bit LAMB: its warm-up to 10, the save at 15 past it
            run(CONFIG, _overrides(text, cache, base / folder, TP2 + ONEBIT_LAMB + [f"train.save_every={SAVED}"]))
            lamb_saved = store.checkpoint_dir(base / folder / "checkpoints", SAVED)
            run(CONFIG, _overrides(text, cache, base / "lamb_resumed", TP2 + ONEBIT_LAMB + [f"train.resume={lamb_saved}"]))
        here = store.checkpoint_dir(base / folder / "checkpoints", SAVED)
        try:
            run(CONFIG, _overrides(text, cache, base / name, extra + ["parallel.dp=4", f"train.resume={here}"]))
            refused.append(None)
        except UserError as e:
            refused.append(str(e))
    return refused


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("zero_one")
    text, cache = write_corpus(base / "text"), base / "cache"
    run(CONFIG, small_overrides(text, cache, base / "build", steps=1))  # builds the data the ranks read
    refused = run_ranks(4, _ranks, text, cache, base)
    return base, refused


def _records(folder):
    return [r for r in read_metrics(folder) if "loss" in r]


def test_a_resume_inside_an_interval_is_exact_at_its_layout(runs):
    base, _ = runs
    assert_resume_exact(base / "whole", base / "resumed", SAVED, STEPS)
    whole = _records(base / "whole")
    by_step = {r["step"]: r for r in whole}
    assert by_step[SAVED]["optim/compressed_bytes"] == 0 and by_step[SAVED + 1]["optim/compressed_bytes"] > 0
    assert by_step[SAVED]["optim/sync_interval"] == 4 and by_step[3]["optim/var_interval"] == 2
    assert by_step[STEPS]["optim/var_interval"] == 0 and 0 < by_step[STEPS]["optim/silent_share"] < 1


def test_a_checkpoint_from_before_the_silent_count_resumes_with_the_count_rebuilt(runs):
    """A checkpoint saved without ``silent`` (megazero before the learning-rate rule) resumes: the share of silent
    steps is rebuilt from the step rule's closed form, and the run is the uninterrupted one (losses exact)."""
    from megazero.checkpoint import store

    base, _ = runs
    kinds = store.stored_tensors(store.checkpoint_dir(base / "old" / "checkpoints", SAVED))
    assert any(k.endswith("/sums") for k in kinds) and not any(k.endswith("/silent") for k in kinds)
    whole = {r["step"]: r for r in _records(base / "whole")}
    resumed = _records(base / "old_resumed")
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, SAVED + AFTER + 1))
    for r in resumed:
        want = whole[r["step"]]
        assert (r["loss"], r["optim/silent_share"]) == (want["loss"], want["optim/silent_share"]), (r, want)
    assert resumed[-1]["optim/silent_share"] > 0


def test_a_save_between_synchronisations_holds_the_last_synchronisations_weights(runs):
    """At step 15 each rank's weights are its own: the checkpoint's model/ tensors are the masters (what an
    export reads), not one rank's local weights for some parameters and another's for others."""
    import torch

    from megazero.checkpoint import store

    base, _ = runs
    saved = store.checkpoint_dir(base / "whole" / "checkpoints", SAVED)
    kinds = store.stored_tensors(saved)
    names = [k[len("model/"):] for k in kinds if k.startswith("model/")]
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in kinds.items()
             if k.startswith("model/") or k.endswith("/master")}
    store.load(saved, state)
    assert names and all(torch.equal(state[f"model/{n}"], state[f"optim/{n}/master"]) for n in names)


def test_a_resume_that_dropped_the_error_feedback_would_differ(runs):
    base, _ = runs
    want = {r["step"]: r["loss"] for r in _records(base / "whole")}
    got = {r["step"]: r["loss"] for r in _records(base / "dropped")}
    assert sorted(got) == list(range(SAVED + 1, SAVED + AFTER + 1)), got
    assert any(got[t] != want[t] for t in got), got  # assert_resume_exact's first comparison fails


def test_a_switch_to_adamw_continues_from_the_masters_and_moments(runs):
    """optim.switch_from: AdamW takes the last synchronisation's masters and the moments; the run goes on at a
    loss near the uninterrupted run's (the lines it prints: tests/train/test_zero_one_resume.py)."""
    base, _ = runs
    want = {r["step"]: r for r in _records(base / "whole")}[SAVED + AFTER]
    got = _records(base / "switched")
    assert [r["step"] for r in got] == list(range(SAVED + 1, SAVED + AFTER + 1))
    assert "optim/compressed_bytes" not in got[-1] and abs(got[-1]["loss"] - want["loss"]) < 0.1 * want["loss"]


def test_the_last_train_step_synchronises_after_skipped_steps(runs):
    """fp16 from a loss scale of 2^20: the first steps overflow and are skipped, so the optimizer's steps lag the
    train steps. The run's last train step still synchronises (it sends the compressed accumulator), though its
    optimizer step is not at the end of an interval; the step before it is a local step."""
    base, _ = runs
    by_step = {r["step"]: r for r in _records(base / "skips")}
    skipped = [t for t, r in by_step.items() if r.get("skipped")]
    assert skipped and (SKIPS - len(skipped)) % 4, skipped  # the last optimizer step is inside an interval of 4
    assert by_step[SKIPS - 1]["optim/compressed_bytes"] == 0 < by_step[SKIPS]["optim/compressed_bytes"]


def test_a_resume_at_another_dp_is_refused_in_one_line(runs):
    _, refused = runs
    for line in refused[0]:  # rank 0's lines: 0/1 Adam's, 1-bit LAMB's
        assert line is not None and "\n" not in line, line
        assert "parallel.dp is 2 there and 4 here" in line and "per rank" in line, line


def test_a_onebit_lamb_resume_past_the_warm_up_is_exact_at_its_layout(runs):
    base, _ = runs
    assert_resume_exact(base / "lamb_whole", base / "lamb_resumed", SAVED, LAMB_STEPS)
    whole = {r["step"]: r for r in _records(base / "lamb_whole")}
    assert whole[10]["optim/compressed_bytes"] == 0 < whole[11]["optim/compressed_bytes"]
    assert whole[LAMB_STEPS]["optim/trust_min"] > 0


def _argv(overrides: list[str]) -> list[str]:
    return ["--config", CONFIG] + [a for o in overrides for a in ("--set", o)]


def test_bad_settings_are_one_line(tmp_path, capsys):
    from tests.hostile import assert_one_line, call, pretrain_main

    sets = small_overrides(write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run", steps=STEPS,
                           **ZERO_ONE) + ["parallel.dp=2"]
    for stage in (2, 3):
        code, _, err = call(pretrain_main, _argv(sets + [f"zero.stage={stage}"]), capsys)
        assert_one_line(code, err, "zero.stage", str(stage), "zero_one_adam", "use 0 or 1")
    for key in ("var_freeze_step", "local_step_clipper"):
        code, _, err = call(pretrain_main, _argv(sets + [f"optim.zero_one_adam.{key}={STEPS}"]), capsys)
        assert_one_line(code, err, f"optim.zero_one_adam.{key}", str(STEPS), f"train.steps={STEPS}")
    code, _, err = call(pretrain_main, _argv(sets + ["parallel.dp=1"]), capsys)
    assert_one_line(code, err, "parallel.dp", "1", "zero_one_adam", "nothing to exchange")
    lamb = sets + ONEBIT_LAMB[:-1]  # (train.steps as the others')
    code, _, err = call(pretrain_main, _argv(lamb + ["zero.stage=2"]), capsys)
    assert_one_line(code, err, "zero.stage", "2", "onebit_lamb", "use 0 or 1")
    code, _, err = call(pretrain_main, _argv(lamb + [f"optim.onebit_lamb.freeze_step={STEPS}"]), capsys)
    assert_one_line(code, err, "optim.onebit_lamb.freeze_step", str(STEPS), f"train.steps={STEPS}")
    code, _, err = call(pretrain_main, _argv(lamb + ["parallel.dp=1"]), capsys)
    assert_one_line(code, err, "parallel.dp", "1", "onebit_lamb", "nothing to exchange")


def test_the_states_past_the_freeze_are_the_plans(runs):
    """The optimizer states a rank holds at the end (past the freeze: 1-bit Adam's, the accumulator, the frozen
    denominator, the anchor and, the weights being fp32, a master apart from them) against the planner's, within
    the buckets' padding (5%, as tests/plan/test_moe_plan.py)."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.stage_plan import make_plan

    base, _ = runs
    cfg = resolve(load_config(CONFIG, _overrides(base / "text", base / "cache", base / "plan", TP2)), 4, "cpu")
    planned = make_plan(cfg).stages[0].model_state["optimizer"]
    measured = _records(base / "whole")[-1]["optimizer_gb"] * 1e9
    assert abs(measured - planned) <= 0.05 * planned, (measured, planned)
