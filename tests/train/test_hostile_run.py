"""Hostile and unlucky runs: garbled launcher variables, a used or damaged log.dir, a model too big, NaN,
signals, a killed rank (a frozen one: test_hang.py). Each ends in one line with its documented exit code
(megazero/errors.py), and nothing is lost: earlier checkpoints stay intact and loadable.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megazero.checkpoint import store as checkpoint
from tests.hostile import ROOT, assert_one_line, call, pretrain_main
from tests.runs import pretrain_cmd, read_metrics, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    return write_corpus(base / "text"), base / "cache"


def _args(overrides: list[str], *extra: str) -> list[str]:
    argv = ["--config", TINY]
    for o in overrides:
        argv += ["--set", o]
    return argv + list(extra)


def _losses(log_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(log_dir)}


def _finite_and_loadable(ckpt: Path) -> None:
    state = checkpoint.read_model_state(ckpt)
    assert state and all(torch.isfinite(t).all() for t in state.values()), ckpt


# --- the launcher's environment -----------------------------------------------------------------

@pytest.mark.parametrize("env,name", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "1e3"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[a-b]"}, "SLURM_JOB_NODELIST"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "job-7"}, "SLURM_JOB_ID"),
])
def test_a_garbled_launcher_variable_is_one_line(env, name, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, _, err = call(pretrain_main, ["--config", TINY, "--dry-run"], capsys)
    assert_one_line(code, err, f"environment variable {name}=")


def test_a_garbled_local_world_size_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    code, _, err = call(pretrain_main, _args(small_overrides(*corpus, tmp_path / "run", steps=1)), capsys)
    assert_one_line(code, err, "LOCAL_WORLD_SIZE='eight'")


# --- the log folder -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4), copied by the tests that need one."""
    log = tmp_path_factory.mktemp("trained") / "run"
    assert pretrain_main(_args(small_overrides(*corpus, log, steps=4, **{"train.save_every": 2}))) == 0
    return log


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_metrics_jsonl_as_a_folder_is_one_line(corpus, tmp_path, capsys):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    code, _, err = call(pretrain_main, _args(small_overrides(*corpus, tmp_path / "run", steps=1)), capsys)
    assert_one_line(code, err, "metrics.jsonl, which is not a file")


def test_a_fresh_run_refuses_a_log_dir_holding_another_run(corpus, trained, tmp_path, capsys):
    log = _copy(trained, tmp_path / "run")
    before = sorted(p.name for p in (log / "checkpoints").iterdir())
    code, _, err = call(pretrain_main, _args(small_overrides(*corpus, log, steps=4)), capsys)
    assert_one_line(code, err, "holds an earlier run's checkpoints", "train.resume=auto", "log.overwrite=true")
    assert sorted(p.name for p in (log / "checkpoints").iterdir()) == before
    _finite_and_loadable(checkpoint.latest_checkpoint(log / "checkpoints"))


def test_overwrite_replaces_the_earlier_run_and_keeps_foreign_entries(corpus, trained, tmp_path, capsys):
    log = _copy(trained, tmp_path / "run")
    (log / "checkpoints" / "step_00000002_good").mkdir()  # the user's copy: not megazero's to delete
    old = checkpoint.checkpoint_run_id(checkpoint.latest_checkpoint(log / "checkpoints"))
    code, out, err = call(pretrain_main, _args(small_overrides(*corpus, log, steps=3), "--set", "log.overwrite=true"),
                          capsys)
    assert code == 0, err
    assert "ignoring 1 entry megazero did not write (step_00000002_good)" in out
    names = sorted(p.name for p in (log / "checkpoints").iterdir())
    assert names == ["step_00000002_good", "step_00000003"], names
    assert checkpoint.checkpoint_run_id(log / "checkpoints" / "step_00000003") != old
    assert [r["step"] for r in read_metrics(log)] == [1, 2, 3]


def test_resuming_a_finished_run_says_so_and_changes_nothing(corpus, trained, tmp_path, capsys):
    log = _copy(trained, tmp_path / "run")
    metrics = (log / "metrics.jsonl").read_text()
    code, out, err = call(pretrain_main, _args(small_overrides(*corpus, log, steps=4), "--set", "train.resume=auto"),
                          capsys)
    assert code == 0 and not err.strip(), err
    assert "is finished (step 4 of train.steps=4)" in out and "log.overwrite=true" in out
    assert (log / "metrics.jsonl").read_text() == metrics


def test_a_model_too_big_for_memory_is_one_line(corpus, tmp_path, capsys):
    """The plan (a lower bound) exceeds this host's free memory: refused before anything is allocated."""
    big = small_overrides(*corpus, tmp_path / "run", steps=1, **{
        "model.layers": 64, "model.hidden": 16384, "model.heads": 128, "model.seq_len": 2048,
        "model.vocab_size": 512, "train.micro_batch": 2, "train.global_batch": 8})
    t0 = time.perf_counter()
    code, _, err = call(pretrain_main, _args(big), capsys)
    assert_one_line(code, err, "the plan needs at least", "GB on this host (1 process) but", "GB is free")
    assert time.perf_counter() - t0 < 30  # refused from the plan, not after building terabytes of model


def test_the_memory_refusal_names_the_knobs_that_would_fit():
    """Activations dominate (fp32, 24 layers of 32 x 2048 tokens): the plan needs ~114 GB; checkpointing
    activations brings it under 20 GB, halving micro_batch does not; and a plan within the memory passes."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.errors import UserError
    from megazero.plan.fits import check_fits, needed_bytes

    sets = ["model.layers=24", "model.hidden=1024", "model.heads=16", "model.seq_len=2048", "model.vocab_size=512",
            "train.micro_batch=32", "train.global_batch=32", "parallel.tp=1", "parallel.pp=1",
            "parallel.sequence_parallel=false", "train.precision=fp32", "zero.stage=0"]
    cfg = resolve(load_config(TINY, sets), 1, "cpu")
    need = needed_bytes(cfg, range(1), "cpu")
    assert 100e9 < need < 130e9, need
    with pytest.raises(UserError, match=r"needs at least 1\d\d\.\d\d GB on this host \(1 process\) but "
                                         r"20\.00 GB is free.*fits with any of: "
                                         r"model\.activation_checkpointing=true$"):
        check_fits(cfg, torch.device("cpu"), 0, 0, 1, available=20 * 10**9)
    check_fits(cfg, torch.device("cpu"), 0, 0, 1, available=need)  # exactly enough: no error


# --- non-finite values --------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_diverging_run_stops_before_saving_and_its_last_checkpoint_resumes(corpus, tmp_path, capsys, precision):
    """lr=1e6 sends the loss to NaN within a few steps: exit 3, one line naming the step; the newest checkpoint
    (saved every step while finite) is finite, and a run resumes from it. (Its weights already took a 1e6 step,
    so the resumed run may well go non-finite again: then it stops the same way.)"""
    log = tmp_path / "run"
    sets = small_overrides(*corpus, log, steps=30, **{"train.lr": "1.0e6", "train.min_lr": 0, "train.save_every": 1,
                                                      "train.precision": precision, "train.keep_last": 2})
    code, _, err = call(pretrain_main, _args(sets), capsys)
    line = assert_one_line(code, err, "not finite", "stopped before saving", exit_code=3)
    step = int(line.split("step ")[1].split(":")[0])
    latest = checkpoint.latest_checkpoint(log / "checkpoints")
    assert latest is not None and latest.name == f"step_{step - 1:08d}", (line, latest)
    _finite_and_loadable(latest)
    resumed = small_overrides(*corpus, log, steps=step + 1, **{"train.precision": precision, "train.save_every": 0})
    code, out, err = call(pretrain_main, _args(resumed, "--set", "train.resume=auto"), capsys)
    assert f"resumed from {latest} at step {step - 1}" in out
    if code != 0:
        assert_one_line(code, err, f"step {step}: ", "not finite", exit_code=3)
    _finite_and_loadable(checkpoint.latest_checkpoint(log / "checkpoints"))


def test_skip_policy_skips_then_stops_after_max_skipped(corpus, tmp_path, capsys):
    log = tmp_path / "run"
    sets = small_overrides(*corpus, log, steps=40, **{"train.lr": "1.0e6", "train.min_lr": 0,
                                                      "train.on_nonfinite": "skip", "train.max_skipped": 3})
    code, _, err = call(pretrain_main, _args(sets), capsys)
    assert_one_line(code, err, "3 updates in a row were skipped", "train.max_skipped=3", exit_code=3)
    records = read_metrics(log)
    assert [r.get("skipped") for r in records[-2:]] == [1, 1], records[-3:]


# --- signals: finish the step, save, exit 128 + N -----------------------------------------------

def _wait_for_step(log: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = log / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.is_file():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
            if lines and lines[-1]["step"] >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def _popen(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    base.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.Popen(cmd, cwd=ROOT, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SIGNAL_STEPS = 25  # the signal is sent once step 3 is logged and lands a step or two later: well before the
# end (20 steps of ~0.1 s here, more on a loaded machine, where the run slows as the test does)


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The uninterrupted one-process run's losses, which each interrupted one must reproduce."""
    log = tmp_path_factory.mktemp("straight") / "run"
    assert pretrain_main(_args(small_overrides(*corpus, log, steps=SIGNAL_STEPS))) == 0
    return _losses(log)


# (SIGINT's single stop is this same path: test_a_second_sigint_stops_at_once_without_saving sends its first)
@pytest.mark.parametrize("sig,background", [(signal.SIGTERM, False), (signal.SIGUSR1, False), (signal.SIGTERM, True)])
def test_a_stop_signal_saves_the_step_reached_and_resume_matches(corpus, straight, tmp_path, sig, background):
    """One process: the signal lands mid-run; the step finishes, is saved (also when saves are asynchronous:
    the write is waited for), the exit code is 128 + N with one line on stdout and nothing on stderr;
    train.resume=auto then gives the uninterrupted run's losses."""
    steps = SIGNAL_STEPS
    log = tmp_path / "run"
    proc = _popen(pretrain_cmd(small_overrides(*corpus, log, steps=steps,
                                               **{"train.async_save": str(background).lower(), "train.save_every": 5})))
    _wait_for_step(log, 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and not err.strip(), err[-2000:]
    stopped = [line for line in out.splitlines() if line.startswith("stopped: ")]
    assert len(stopped) == 1 and signal.Signals(sig).name in stopped[0], out[-2000:]
    reached = int(stopped[0].split("step ")[1].split(":")[0])
    assert reached < steps
    assert checkpoint.latest_checkpoint(log / "checkpoints").name == f"step_{reached:08d}"
    assert pretrain_main(_args(small_overrides(*corpus, log, steps=steps), "--set", "train.resume=auto")) == 0
    assert _losses(log) == straight  # exact: the resume restores every state the losses depend on


def test_a_second_sigint_stops_at_once_without_saving(corpus, tmp_path):
    """Two Ctrl-C within one step: the second ends the run where it is, with one line and no save. The model is
    made big enough that a step takes far longer than the gap between the two signals."""
    log = tmp_path / "run"
    slow = small_overrides(*corpus, log, steps=200, **{"train.save_every": 0, "model.hidden": 384, "model.layers": 4,
                                                       "model.heads": 6, "model.seq_len": 128, "train.global_batch": 16,
                                                       "train.micro_batch": 16})  # ~2 s a step here
    proc = _popen(pretrain_cmd(slow))
    _wait_for_step(log, 1, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # the first is served (a flag) before the second arrives: signals of one kind do not queue
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err[-2000:])
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and len(lines) == 1 and "SIGINT received twice" in lines[0], err[-2000:]
    assert checkpoint.latest_checkpoint(log / "checkpoints") is None


def _has_open(pid: int, path: Path) -> bool:
    """Whether the process has the file open (Linux: its /proc/PID/fd links)."""
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_stop_signal_during_data_preparation_exits_at_once(corpus, tmp_path):
    """Tokenising a corpus of 20 million blank lines (about 40 s here, 200 KB compressed) before the first step:
    SIGTERM 3 s into it ends the run within 5 s, with one line on stderr and exit 143; there is nothing to save,
    and the cache holds no dataset, finished or partial."""
    import gzip

    from megazero.data.tokenizer import train_tokenizer

    blank = tmp_path / "blank.jsonl.gz"
    with gzip.open(blank, "wb", compresslevel=1) as f:
        for _ in range(20):
            f.write(b"\n" * 1_000_000)
    model = train_tokenizer([corpus[0]], 512, tmp_path / "tok" / "t")
    cache, log = tmp_path / "cache", tmp_path / "run"
    proc = _popen(pretrain_cmd(small_overrides(blank, cache, log, steps=5, **{"data.tokenizer": str(model)})))
    deadline = time.monotonic() + 120
    while not _has_open(proc.pid, blank):  # the run is reading the corpus: data preparation has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(3)
    assert proc.poll() is None and _has_open(proc.pid, blank) and not (log / "metrics.jsonl").exists()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 5 s after SIGTERM: {proc.communicate()}") from None
    assert time.monotonic() - sent < 5
    assert_one_line(proc.returncode, err, "SIGTERM", "before the first step", exit_code=128 + signal.SIGTERM)
    left = sorted(p.name for p in cache.rglob("*") if p.is_file())
    assert not [n for n in left if ".idx" in n or ".bin" in n], left


# --- several ranks: preemption through torchrun, a killed rank restarted, a frozen rank -----------------

MULTI_STEPS = 12  # the interrupted runs stop at step 3 or more, and at 5: well before the end


def _multi(corpus, log: Path, **extra) -> list[str]:
    """2 ranks, 2 pipeline stages, 4 microbatches per step: the stages stand at different points of a step when
    a signal lands, and still agree on one. (Each torchrun worker is a fresh interpreter: ~3 s of start-up, paid
    again on a restart; 2 pipeline stages are the case the agreement is for, more ranks the same all-reduce.)"""
    return small_overrides(*corpus, log, steps=MULTI_STEPS, **{"parallel.pp": 2, **extra})


def _train(rank: int, world: int, overrides: list[str]) -> bool:
    from megazero.train.run import run

    run(TINY, overrides)
    return True


@pytest.fixture(scope="module")
def multi_straight(corpus, tmp_path_factory):
    """The uninterrupted 2-rank run the interrupted ones must reproduce, on ranks forked from the test's server
    rather than torchrun's interpreters (the same code and one thread a rank: the same losses, bit for bit;
    the interrupted runs and their resumes are torchrun's)."""
    from tests.dist import run_ranks

    log = tmp_path_factory.mktemp("multi") / "straight"
    run_ranks(2, _train, _multi(corpus, log))
    return _losses(log)


def _children(pid: int) -> list[int]:
    """Processes whose parent is pid (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_sigterm_to_torchrun_saves_the_step_reached_and_resume_matches(corpus, multi_straight, tmp_path):
    """SIGTERM to torchrun reaches every worker: they agree on a step, finish it, save it and exit 143 (torchrun
    itself then reports the signal and exits 1, which no worker can prevent); resume=auto gives the
    uninterrupted run's losses exactly. The resume runs on forked ranks, as the uninterrupted run does: what
    is torchrun's here is the signal's way to the workers, and a resume under torchrun is the next test's."""
    log = tmp_path / "run"
    proc = _popen(pretrain_cmd(_multi(corpus, log), nproc=2))
    _wait_for_step(log, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    stopped = [line for line in out.splitlines() if line.startswith("stopped: ")]
    assert len(stopped) == 1 and "SIGTERM received; saved" in stopped[0], (out[-2000:], err[-3000:])
    assert "Traceback" not in out, out[-3000:]  # the workers' own output; torchrun's report is on its stderr
    reached = int(stopped[0].split("step ")[1].split(":")[0])
    assert reached < MULTI_STEPS
    latest = checkpoint.latest_checkpoint(log / "checkpoints")
    assert latest.name == f"step_{reached:08d}"
    _finite_and_loadable(latest)
    from tests.dist import run_ranks

    run_ranks(2, _train, _multi(corpus, log, **{"train.resume": "auto"}))
    assert _losses(log) == multi_straight


def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_finishes_the_same(corpus, multi_straight, tmp_path):
    """torchrun --max-restarts 2 and train.resume=auto: one rank SIGKILLed once, the job recovers by itself
    (torchrun restarts every worker, they resume from the latest checkpoint) and ends with the uninterrupted
    run's losses."""
    log = tmp_path / "run"
    cmd = pretrain_cmd(_multi(corpus, log, **{"train.resume": "auto", "train.save_every": 2}), nproc=2)
    cmd[cmd.index("--nproc-per-node"):cmd.index("--nproc-per-node")] = ["--max-restarts", "2"]
    proc = _popen(cmd)
    _wait_for_step(log, 5, proc)
    workers = sorted(_children(proc.pid))
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in out, out[-2000:]
    assert _losses(log) == multi_straight


def test_an_interrupted_checkpoint_write_stops_as_interrupted(tmp_path, monkeypatch):
    """A second stop signal that lands inside DCP's write comes back wrapped in DCP's CheckpointException (a
    BaseException the CLI does not know): the save re-raises the interruption itself, so the run ends as
    interrupted (exit 130, one line); any other write failure is one line too."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from megazero.errors import UserError
    from megazero.train.signals import Interrupted

    def interrupted(*args, **kwargs):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(Interrupted):
        checkpoint.save(tmp_path / "c", 1, {"model/w": torch.ones(4)}, {"consumed_samples": 1}, keep_last=1)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(UserError, match=r"step_00000002: no space left on .*c \(needs about 16 bytes, .* free\); the "
                                        r"partial step_00000002.tmp was removed and the previous checkpoint stays "
                                        r"the latest"):
        checkpoint.save(tmp_path / "c", 2, {"model/w": torch.ones(4)}, {"consumed_samples": 2}, keep_last=1)
    assert checkpoint.latest_checkpoint(tmp_path / "c") is None
    assert not (tmp_path / "c" / "step_00000002.tmp").exists()


def test_fp16_overflows_count_toward_max_skipped_only_at_the_minimum_scale():
    """fp16 starts its loss scale at 2^16 and halves it on overflows (skipping each step): that back-off is
    the scaler's job, not a run to stop. Only overflows with the scale at its minimum count, and an update
    resets the count; outside fp16 every skip counts."""
    from megazero.errors import NonFiniteStop
    from megazero.train.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard("stop", max_skipped=3, fp16=True)
    for step in range(1, 31):  # 30 overflows on the way down from 2^16: no stop
        guard.check(step, True, False, float("inf"), None, scale_at_min=False)
    guard.check(31, True, False, float("inf"), None, scale_at_min=True)
    guard.check(32, False, False, 1.0, None, scale_at_min=True)  # an update: the count starts again
    guard.check(33, True, False, float("inf"), None, scale_at_min=True)
    guard.check(34, True, False, float("inf"), None, scale_at_min=True)
    with pytest.raises(NonFiniteStop, match=r"step 35: 3 updates in a row were skipped \(train.max_skipped=3\)"):
        guard.check(35, True, False, float("inf"), None, scale_at_min=True)
    skip = NonFiniteGuard("skip", max_skipped=2, fp16=False)
    skip.check(1, True, False, float("nan"), "layers.0.mlp.fc1.weight")
    with pytest.raises(NonFiniteStop, match=r"step 2: 2 updates in a row .*first non-finite gradient: layers\.0"):
        skip.check(2, True, False, float("nan"), "layers.0.mlp.fc1.weight")
    with pytest.raises(NonFiniteStop, match=r"step 1: the loss is not finite; stopped before saving"):
        NonFiniteGuard("stop", max_skipped=10, fp16=True).check(1, False, True, 1.0, None)


def test_a_run_refuses_more_layers_per_rank_than_it_can_build():
    """--dry-run plans any layer count; a run would build each layer as a module (host memory and a Python loop
    the byte plan does not see), so past 4096 per rank it is refused in one line before anything is built."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.errors import UserError
    from megazero.plan.fits import check_fits

    sets = ["model.layers=1000000", "model.hidden=8", "model.heads=1", "model.seq_len=8", "parallel.tp=1",
            "parallel.pp=2", "parallel.sequence_parallel=false", "train.precision=fp32", "zero.stage=0"]
    cfg = resolve(load_config(TINY, sets), 2, "cpu")
    with pytest.raises(UserError, match=r"model\.layers=1000000 puts up to 500,000 layers on a rank "
                                         r"\(parallel\.pp=2\); a run builds at most 4096 per rank"):
        check_fits(cfg, torch.device("cpu"), 0, 0, 2, available=10**15)
    check_fits(resolve(load_config(TINY, sets[1:] + ["model.layers=8192"]), 2, "cpu"), torch.device("cpu"), 0, 0, 2,
               available=10**15)  # 4096 per rank: built
