"""One run per log.dir: a second run on a folder in use is refused in one line, before it changes anything there,
on every one of its ranks; a lock left by a killed run does not block its resume."""
from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megazero.checkpoint import store as checkpoint
from tests.hostile import ROOT, assert_one_line, call, pretrain_main
from tests.runs import pretrain_cmd, read_metrics, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    return write_corpus(base / "text"), base / "cache"


def _args(overrides: list[str]) -> list[str]:
    argv = ["--config", TINY]
    for o in overrides:
        argv += ["--set", o]
    return argv


def _popen(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    base.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.Popen(cmd, cwd=ROOT, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _hold(log: Path, pid: int, host: str):
    """The lock as a run holds it (log.dir/run.lock, flock'ed, 'pid N host H' inside): the file stays open."""
    log.mkdir(parents=True, exist_ok=True)
    f = open(log / "run.lock", "a+")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.truncate(0)
    f.write(f"pid {pid} host {host}\n")
    f.flush()
    return f


def test_two_runs_started_at_once_on_one_folder(corpus, tmp_path):
    """The issue's case: the same fresh run twice at once (seeds 1 and 2, a save every step). One exits 2 in one
    line naming the folder and the other's pid and host; the other finishes with every step's metrics and its
    checkpoints."""
    log, steps = tmp_path / "run", 8
    procs = [_popen(pretrain_cmd(small_overrides(*corpus, log, steps=steps, **{
        "train.seed": seed, "train.save_every": 1, "train.keep_last": 2}))) for seed in (1, 2)]
    outputs = [p.communicate(timeout=180) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], (codes, [e[-2000:] for _, e in outputs])
    won = codes.index(0)
    lost = 1 - won
    assert_one_line(codes[lost], outputs[lost][1], str(log), f"pid {procs[won].pid}", socket.gethostname())
    assert [r["step"] for r in read_metrics(log)] == list(range(1, steps + 1))
    names = sorted(p.name for p in (log / "checkpoints").iterdir())
    assert names == [f"step_{steps - 1:08d}", f"step_{steps:08d}"], names
    state = checkpoint.read_model_state(log / "checkpoints" / names[-1])
    assert state


def test_a_folder_in_use_is_refused_before_anything_in_it_changes(corpus, tmp_path, capsys):
    """log.overwrite=true on a folder whose run is alive: refused, and its checkpoints, metrics and TensorBoard
    files are as they were."""
    log = tmp_path / "run"
    (log / "checkpoints" / "step_00000002").mkdir(parents=True)
    (log / "metrics.jsonl").write_text('{"step": 1}\n')
    (log / "events.out.tfevents.1.host").write_text("x")
    held = _hold(log, 4242, "node-a7")
    before = sorted(str(p.relative_to(log)) for p in log.rglob("*"))
    try:
        code, _, err = call(pretrain_main, _args(small_overrides(*corpus, log, steps=1, **{"log.overwrite": "true"})),
                            capsys)
    finally:
        held.close()
    assert_one_line(code, err, str(log), "pid 4242", "node-a7")
    assert sorted(str(p.relative_to(log)) for p in log.rglob("*")) == before
    assert (log / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("kind", ["folder", "link", "fifo"])
def test_a_lock_file_that_is_not_a_plain_file_is_one_line(kind, corpus, tmp_path, capsys):
    """run.lock planted as a folder, a link out of log.dir or a FIFO: refused in one line, never followed or
    waited on; the link's target is untouched."""
    log, target = tmp_path / "run", tmp_path / "elsewhere.txt"
    log.mkdir()
    target.write_text("mine")
    {"folder": lambda p: p.mkdir(), "link": lambda p: p.symlink_to(target), "fifo": os.mkfifo}[kind](log / "run.lock")
    code, _, err = call(pretrain_main, _args(small_overrides(*corpus, log, steps=1)), capsys)
    assert_one_line(code, err, str(log / "run.lock") if kind != "fifo" else "run.lock, which is not a plain file")
    assert target.read_text() == "mine"
    assert not (log / "metrics.jsonl").exists()


def test_every_rank_of_a_refused_run_exits_at_once(corpus, tmp_path):
    """Two ranks at pp=2 on a folder in use: the writing rank (1, the last stage) finds the lock taken; rank 0
    learns it from rank 1 and exits 2 too, with the line, instead of waiting in a collective for the rank that
    left (which would end in exit 4)."""
    from tests.dist import free_port

    log = tmp_path / "run"
    sets = small_overrides(*corpus, log, steps=2, **{"parallel.pp": 2, "launch.timeout_minutes": 0.5})
    port = str(free_port())
    held = _hold(log, 777, "node-b3")
    try:
        procs = [_popen(pretrain_cmd(sets), env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                  "MASTER_PORT": port}) for r in range(2)]
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        held.close()
    assert [p.returncode for p in procs] == [2, 2], [e[-2000:] for _, e in outputs]
    assert_one_line(2, outputs[0][1], str(log), "pid 777", "node-b3")
    assert not outputs[1][1].strip(), outputs[1][1][-2000:]  # rank 0 speaks for the node
    assert not (log / "metrics.jsonl").exists()


def test_a_resume_after_the_run_was_killed_is_not_blocked_by_its_lock(corpus, tmp_path, capsys):
    """SIGKILL leaves log.dir/run.lock behind, naming the dead process: the lock itself died with it, so
    train.resume=auto continues."""
    log = tmp_path / "run"
    sets = small_overrides(*corpus, log, steps=100, **{"train.save_every": 1})
    proc = _popen(pretrain_cmd(sets))
    deadline = time.monotonic() + 120
    while checkpoint.latest_checkpoint(log / "checkpoints") is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    assert f"pid {proc.pid} " in (log / "run.lock").read_text()  # the killed run's file is still there
    code, out, err = call(pretrain_main, _args(sets + ["train.resume=auto", "train.exit_after=1"]), capsys)
    assert code == 0, err[-3000:]
    assert "resumed from" in out
