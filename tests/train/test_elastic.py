"""Elastic continuation: two torchrun agents (--nnodes 1:2, c10d rendezvous on localhost, 2 ranks each: the world
of 4 at tp 2 x dp 2, parallel.dp=auto, train.resume=auto); one agent and its ranks are killed mid-run, as a node
is lost. The survivor's ranks meet a closed connection, exit, and its agent restarts them on the nodes that
remain: world 2, tp 2 x dp 1, from the latest checkpoint, saying so in one line, with the global batch kept
(twice the microbatches per rank). Its losses after the restart equal those of a fresh 4-rank run resumed from
the same checkpoint within 1e-5 relative (fp32 layouts sum the same gradients in another order: ~1e-6); a
world that cannot hold tp x pp then exits in one line and leaves the checkpoints as they were.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from megazero.train.layout_change import layout_change
from megazero.train.run import run
from tests.dist import free_port, run_ranks
from tests.runs import ROOT, assert_curves_match, pretrain_cmd, read_metrics, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS, KILL_AT = 30, 12
ELASTIC = {"parallel.tp": 2, "parallel.dp": "auto", "train.save_every": 5, "train.keep_last": 10,
           "train.resume": "auto", "launch.timeout_minutes": 0.2}


def _agent(sets: list[str], port: int, out: Path, hosts: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
           # a lost node is noticed within ~3 s, and a rendezvous waits 5 s for nodes beyond the minimum: both
           # agents start together and must meet in the first one (a node joining a running job restarts it);
           # the survivor hosts the store, so the one that is killed does not take it along
           "--rdzv-conf", f"last_call_timeout=5,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3,"
                          f"is_host={int(hosts)}",
           "--max-restarts", "3", "--monitor-interval", "0.5", *pretrain_cmd(sets)[1:]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, stdout=out.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _tree(pid: int) -> list[int]:
    """A process and all its descendants (the agent and its ranks: a node's processes)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += _tree(int(child))
    return out


def _logged_step(log: Path) -> int:
    path = log / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = [json.loads(x)["step"] for x in lines if x.strip().endswith("}")]
    return steps[-1] if steps else 0


def _resumed(rank, world, sets):
    run(TINY, sets)
    return True


def test_a_lost_node_continues_on_the_survivor_with_the_global_batch_kept(tmp_path):
    text, cache, log = write_corpus(tmp_path / "text"), tmp_path / "cache", tmp_path / "run"
    sets = small_overrides(text, cache, log, steps=STEPS, **ELASTIC)
    run(TINY, small_overrides(text, cache, tmp_path / "warm", steps=1))  # the data, built once
    port = free_port()
    survivor = _agent(sets, port, tmp_path / "survivor.out", hosts=True)
    try:
        lost = _agent(sets, port, tmp_path / "lost.out", hosts=False)
        deadline = time.monotonic() + 120
        while _logged_step(log) < KILL_AT:
            assert time.monotonic() < deadline and survivor.poll() is None, (tmp_path / "survivor.out").read_text()
            time.sleep(0.05)
        for pid in _tree(lost.pid):
            os.kill(pid, signal.SIGKILL)
        assert survivor.wait(timeout=240) == 0, (tmp_path / "survivor.out").read_text()[-3000:]
    finally:
        for proc in (survivor, locals().get("lost")):
            if proc is not None and proc.poll() is None:
                for pid in _tree(proc.pid):
                    os.kill(pid, signal.SIGKILL)
    out = (tmp_path / "survivor.out").read_text()
    assert "world 4 → 2: dp 2 → 1, microbatches per rank 2 → 4 (global batch 8 kept)" in out, out[-3000:]
    found = re.search(r"resumed from (\S+) at step (\d+)", out)
    assert found and "grid pp=1 x dp=1 x tp=2 (world 2" in out, out[-3000:]
    checkpoint, at = Path(found.group(1)), int(found.group(2))
    # the first attempt's ranks recorded the lost peers (megazero.hang); the restart set that folder aside
    assert "wrote no record" in (log / "hang.1" / "summary.txt").read_text() and not (log / "hang").exists()
    assert KILL_AT - 5 <= at <= KILL_AT + 5, at  # the latest save (every 5 steps) before the node was lost
    # the reference: a fresh 4-rank run (tp 2 x dp 2) from the same checkpoint
    ref = small_overrides(text, cache, tmp_path / "fresh4", steps=STEPS, **{**ELASTIC, "train.resume": checkpoint})
    run_ranks(4, _resumed, ref)
    got = {r["step"]: r for r in read_metrics(log) if "loss" in r}  # a step's last record: the restarted run's
    want = [r for r in read_metrics(tmp_path / "fresh4") if "loss" in r]
    assert [r["step"] for r in want] == list(range(at + 1, STEPS + 1))
    assert_curves_match("elastic", want, [got[r["step"]] for r in want])
    # a world that cannot hold tp 2: one line, exit 2, the checkpoints untouched
    before = {p.name: p.stat().st_mtime_ns for p in (log / "checkpoints").rglob("*")}
    refused = subprocess.run(pretrain_cmd(small_overrides(text, cache, log, steps=STEPS + 10, **ELASTIC)), cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "parallel.tp*pp" in lines[0] and \
        "must divide the world size 1" in lines[0], refused.stderr[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in (log / "checkpoints").rglob("*")} == before


def test_the_line_names_what_changed_and_whether_the_global_batch_was_kept():
    saved = {"parallel": {"tp": 2, "pp": 2, "cp": 1, "ep": 1, "dp": 4}, "train": {"global_batch": 256,
                                                                                "micro_batch": 8}}
    cfg = SimpleNamespace(parallel=SimpleNamespace(tp=2, pp=2, cp=1, ep=1, dp=3),
                          train=SimpleNamespace(global_batch=264, micro_batch=8))
    assert layout_change(saved, cfg) == ("world 16 → 12: dp 4 → 3, microbatches per rank 8 → 11 "
                                         "(global batch 256 → 264)")
    cfg.train.global_batch, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = 256, 4, 4, 1
    assert layout_change(saved, cfg) == ("layout: tp 2 → 4, pp 2 → 1, microbatches per rank 8 → 8 "
                                         "(global batch 256 kept)")
    cfg.parallel.tp, cfg.parallel.pp = 2, 2
    assert layout_change(saved, cfg) is None
    assert layout_change({"parallel": {"dp": "auto"}, "train": {}}, cfg) is None  # an older or damaged record
