"""A hung run says who waits on whom: a rank stopped on purpose (SIGSTOP) mid-run, 4 ranks on gloo; its peers
give up after launch.timeout_minutes (6 s here), each surviving rank writes its record in log.dir/hang, and one
of them prints the summary naming the stopped rank, the group and the ranks waiting on it.
``python -m megazero.hang`` prints the same summary from the records afterwards.

The rank stops itself where the issue asks, through the test's own wrapper around pretrain.py (the product is
not told): at pp 2 x dp 2 before its 20th pipeline send (a backward's gradient to stage 0, in step 3 or so), at
tp 2 x dp 2 on entering its 200th tp all-reduce.
The groups are the mesh's own (made with the timeout): a group made without it would wait torch's default 30
minutes, and the test would time out instead. Both layouts run at once: each one's survivors wait out their
timeout while the other's ranks work.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megazero import hang
from tests.hostile import ROOT
from tests.runs import pretrain_cmd, small_overrides, write_corpus

LAYOUTS = {  # the rank stopped, where, and the line naming what its peer waits on (tp fastest, then dp, then pp)
    "tp2_dp2": ({"parallel.tp": 2, "parallel.dp": 2}, 1, ("all_reduce", "tp", 200),
                "tp group [0,1]: rank 0 waits on all_reduce tag "),
    "pp2_dp2": ({"parallel.pp": 2, "parallel.dp": 2}, 2, ("exchange", "pp", 20),
                "pp group [0,2]: rank 0 waits on recv of grad from rank 2 "),
}
# pretrain.py with Comm.<method> on group <name> stopping this process (SIGSTOP) at its <n>th call
STOPPING = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from megazero.parallel.comm import Comm
method, name, n = {where!r}
original, calls = getattr(Comm, method), [0]
def stopping(self, *args, **kwargs):
    sends = method != "exchange" or any(op[0] == "send" for op in args[0])
    if self.name == name and sends:
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGSTOP)
    return original(self, *args, **kwargs)
setattr(Comm, method, stopping)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _start(tmp_path: Path, layout: str) -> list[subprocess.Popen]:
    """The layout's 4 ranks, one of them wrapped to stop itself; their output in files (both layouts run at once)."""
    from tests.dist import free_port

    parallel, stopped, where, _ = LAYOUTS[layout]
    sets = small_overrides(write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run", steps=400,
                           **{**parallel, "launch.timeout_minutes": 0.1, "train.save_every": 0})
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    cmd = pretrain_cmd(sets)
    wrapped = [cmd[0], "-c", STOPPING.format(root=str(ROOT), where=where), *cmd[1:]]
    procs = []
    for r in range(4):
        with (tmp_path / f"out_{r}").open("w") as out, (tmp_path / f"err_{r}").open("w") as err:
            procs.append(subprocess.Popen(wrapped if r == stopped else cmd, cwd=ROOT, stdout=out, stderr=err,
                                          env={**base, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": "4",
                                               "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4",
                                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
    return procs


def _stopped(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` stopped itself (its state in /proc is T)."""
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> dict[str, tuple[Path, list[int], list[str], float]]:
    """Both layouts at once (the survivors of each wait out their timeout while the other runs): per layout, its
    folder, the survivors' exit codes and stderr, and how long they ran on after the rank stopped."""
    folders = {name: tmp_path_factory.mktemp(name) for name in LAYOUTS}
    procs = {name: _start(folders[name], name) for name in LAYOUTS}
    frozen: dict[str, float] = {}
    ended: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 240
        while len(ended) < len(LAYOUTS):
            assert time.monotonic() < deadline, f"stopped at {sorted(frozen)}, ended {sorted(ended)}"
            for name, ranks in procs.items():
                stopped = LAYOUTS[name][1]
                survivors = [p for r, p in enumerate(ranks) if r != stopped]
                if name not in frozen:
                    assert all(p.poll() is None for p in ranks), \
                        [(folders[name] / f"err_{r}").read_text()[-2000:] for r in range(4)]
                    if _stopped(ranks[stopped]):
                        frozen[name] = time.monotonic()
                elif name not in ended and all(p.poll() is not None for p in survivors):
                    ended[name] = time.monotonic()
            time.sleep(0.02)
    finally:
        for ranks in procs.values():
            for p in ranks:
                p.kill()
                p.wait()
    out = {}
    for name, ranks in procs.items():
        stopped = LAYOUTS[name][1]
        alive = [r for r in range(4) if r != stopped]
        out[name] = (folders[name], [ranks[r].returncode for r in alive],
                     [(folders[name] / f"err_{r}").read_text() for r in alive], ended[name] - frozen[name])
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_stopped_rank_is_named_by_every_record_and_one_summary(hung, layout):
    _, stopped, _, waits = LAYOUTS[layout]
    folder, codes, errs, waited = hung[layout]
    log = folder / "run"
    assert codes == [4, 4, 4], [e[-2000:] for e in errs]
    assert 5 < waited < 6 + 30, waited  # the timeout, plus at most 30 s (a step, the grace of 5 s, the exit)
    assert sorted(p.name for p in (log / "hang").glob("rank_*.json")) == \
        [f"rank_{r}.json" for r in range(4) if r != stopped]
    summary = (log / "hang" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith(f"hang: rank {stopped} wrote no record (stopped, or gone before the timeout)"), summary
    named = [line for line in summary if line.startswith(waits)]
    assert len(named) == 1 and named[0].endswith(f"; rank {stopped} wrote no record"), summary
    printed = [e for e in errs if summary[0] in e]  # one rank printed it, under its one error line
    assert len(printed) == 1, errs
    lines = [x for x in printed[0].splitlines() if x.strip()]
    assert lines[0].startswith("error: rank ") and "launch.timeout_minutes=0.1" in lines[0] and \
        lines[1:] == summary and "Traceback" not in printed[0], printed[0][-3000:]
    for e in errs:  # every other survivor: its one line
        if e is not printed[0]:
            assert len([x for x in e.splitlines() if x.strip()]) == 1, e[-3000:]
    again = subprocess.run([sys.executable, "-m", "megazero.hang", str(log)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.splitlines() == summary, again.stdout + again.stderr


def _op(seq, kind, group, members, tag="activation", peer=None, state="completed", action="F1", step=3):
    return {"seq": seq, "kind": kind, "group": group, "members": members, "tag": tag, "bytes": 64, "peer": peer,
            "state": state, "step": step, "action": action}


def test_the_summary_names_a_rank_behind_on_a_group_and_a_transfer_never_answered():
    """Synthetic records, every rank present: rank 1 is in the tp all-reduce #7 that rank 0 never reached
    (rank 0 waits on a receive from rank 2, which waits in another group)."""
    records = {
        0: {"rank": 0, "world": 3, "step": 5, "action": "wait recv_f2", "ops": [
            _op(6, "all_reduce", "tp", [0, 1]), _op(4, "recv", "pp", [0, 2], peer=2, state="async", action="recv_f2")]},
        1: {"rank": 1, "world": 3, "step": 5, "action": "F2", "ops": [
            _op(7, "all_reduce", "tp", [0, 1], state="posted", action="F2")]},
        2: {"rank": 2, "world": 3, "step": 5, "action": "B1", "ops": [
            _op(9, "all_reduce", "dp", [2, 3], state="posted", tag="grad", action="B1")]},
    }
    lines = hang.summarize(records)
    assert lines[0] == "hang: all 3 ranks wrote a record: each waits on another (below)"
    assert "pp group [0,2]: rank 0 waits on recv of activation from rank 2 (action recv_f2) at step 5; rank 2 is at " \
           "step 5, in B1, waiting on dp: all_reduce tag grad (its operation #9 on the group)" in lines, lines
    assert "tp group [0,1]: rank 1 waits on all_reduce tag activation (its operation #7 on the group) at step 5; " \
           "rank 0 is at step 5, in wait recv_f2, waiting on pp: recv of activation from rank 2 (action recv_f2) " \
           "(it issued #6 on this group, not #7)" in lines, lines


def test_damaged_records_are_left_out_and_an_empty_folder_is_one_line(tmp_path):
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "rank_0.json").write_text("{not json")
    (tmp_path / "hang" / "rank_1.json").write_text(json.dumps({"rank": 1, "world": 2, "ops": [
        {"seq": "7", "kind": 3}, _op(2, "all_reduce", "dp", [0, 1], state="posted")]}))
    records = hang.read_records(tmp_path)
    assert list(records) == [1] and len(records[1]["ops"]) == 1
    assert hang.summarize(records)[0].startswith("hang: rank 0 wrote no record")
    out = subprocess.run([sys.executable, "-m", "megazero.hang", str(tmp_path / "nowhere")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "no hang records" in out.stderr


def test_a_new_run_sets_an_earlier_hang_aside_so_its_own_summary_is_claimed(tmp_path):
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "summary.txt").write_text("hang: an earlier one\n")
    (tmp_path / "hang.1").mkdir()  # an earlier one still
    assert hang.set_aside(tmp_path) == tmp_path / "hang.2" and not (tmp_path / "hang").exists()
    assert (tmp_path / "hang.2" / "summary.txt").read_text() == "hang: an earlier one\n"
    ops = SimpleNamespace(step=4, action="F1", record=lambda: [_op(3, "all_reduce", "dp", [0, 1], state="posted")])
    hang.write_record(tmp_path, 0, 2, ops, "error: rank 0: ...")
    assert hang.report(tmp_path, 0, 2, 0.1)[0].startswith("hang: rank 1 wrote no record")  # claimed: its own
    assert hang.set_aside(tmp_path / "nowhere") is None
