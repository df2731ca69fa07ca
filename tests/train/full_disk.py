"""The runs of tests/train/test_hostile_disk.py, inside a mount namespace of their own over a small tmpfs.

``python -m tests.train.full_disk DISK CORPUS CACHE REPORT``: DISK is the freshly mounted tmpfs (the runs'
log.dir is under it; data.cache_dir is not). A ballast file leaves chosen room free before each run. Every
run is pretrain.py's main in this process (one torch import for all of them); what each one said and left
is written to REPORT as JSON, for the test to judge. Nothing here asserts.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tests.hostile import pretrain_main
from tests.runs import pretrain_cmd, small_overrides

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def free(disk: Path) -> int:
    st = os.statvfs(disk)
    return st.f_bavail * st.f_frsize


def leave_free(disk: Path, room: int) -> int:
    """Size the ballast so that ``room`` bytes stay free (0: fill the disk to the last block); the room left."""
    ballast = disk / "ballast"
    ballast.unlink(missing_ok=True)
    todo = free(disk) - room if room else 1 << 40
    chunk = b"\0" * (1 << 20)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while todo > 0:
                todo -= f.write(chunk[:min(len(chunk), todo)])
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return free(disk)


def files(folder: Path) -> list[str]:
    """Every entry under ``folder``, relative, folders marked with a slash."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) + ("/" if p.is_dir() else "") for p in folder.rglob("*"))


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def train(log: Path, corpus: Path, cache: Path, steps: int, **extra) -> dict:
    """One run in this process: its exit code, stderr, and what its log.dir holds after it."""
    values = {"train.save_every": 1, "train.keep_last": 1, **extra}
    argv = ["--config", TINY]
    for o in small_overrides(corpus, cache, log, steps=steps, **values):
        argv += ["--set", o]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = pretrain_main(argv)
        except BaseException:  # noqa: BLE001 (reported, for the test to fail on)
            code = -1
            err.write(traceback.format_exc())
    metrics = log / "metrics.jsonl"
    return {"code": code, "err": err.getvalue(), "files": files(log),
            "metrics": metrics.read_text() if metrics.is_file() else None}


def train_ranks(log: Path, corpus: Path, cache: Path, steps: int, nproc: int = 2, **extra) -> dict:
    """One run of ``nproc`` ranks under torchrun (a process each): its exit code, the error lines its ranks
    said, and what its log.dir holds after it."""
    values = {"train.save_every": 1, "train.keep_last": 1, "parallel.dp": nproc, **extra}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(pretrain_cmd(small_overrides(corpus, cache, log, steps=steps, **values), nproc),
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=240)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    return {"code": proc.returncode, "err": "\n".join(said) or proc.stderr[-3000:], "files": files(log)}


def short_write(full: Path, roomy: Path, size: int) -> dict:
    """torch's zip writer words a full disk as "unexpected pos"; another rank's error reaches rank 0 pickled,
    without the OSError behind it. The line a save would say for it, on the full disk and on a roomy one."""
    from torch.distributed.checkpoint.api import CheckpointException

    said = {}
    for name, root in (("full", full), ("roomy", roomy)):
        short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        try:
            from megazero.checkpoint.save_failure import failed_write

            said[name] = str(failed_write(CheckpointException("save failed", {1: short}), root,
                                          root / "step_00000009.tmp", size, remove=False))
        except BaseException:  # noqa: BLE001 (reported, for the test to fail on)
            said[name] = traceback.format_exc()
    return said


def main(argv: list[str]) -> int:
    disk, corpus, cache, report = (Path(a) for a in argv)
    run, fresh = disk / "run", disk / "fresh"
    phases: dict[str, dict] = {}

    def phase(name: str, log: Path, steps: int, room: int | None, runner=train, **extra) -> dict:
        left = leave_free(disk, room) if room is not None else free(disk)
        t0 = time.perf_counter()
        result = runner(log, corpus, cache, steps, **extra)
        phases[name] = {**result, "free_before": left, "free_after": free(disk), "seconds": time.perf_counter() - t0}
        return phases[name]

    phase("first", run, 1, None)  # the whole disk free: step 1's checkpoint
    step1 = run / "checkpoints" / "step_00000001"
    size = tree_bytes(step1) if step1.is_dir() else 0
    phases["first"]["checkpoint_bytes"] = size
    # room for the logs, not for a second checkpoint beside the first
    phase("sync_full", run, 2, size // 2, **{"train.resume": "auto"})
    phase("sync_resumed", run, 2, 1 << 40, **{"train.resume": "auto"})
    phase("async_full", run, 3, size // 2, **{"train.resume": "auto", "train.async_save": "true"})
    phase("metrics_full", run, 3, 0, **{"train.resume": "auto"})  # not a block left
    phase("tensorboard_full", fresh, 1, 0)  # a fresh run's first block is TensorBoard's
    phases["short_write"] = short_write(run / "checkpoints", cache, size)  # the disk still full
    phase("finished", run, 3, 1 << 40, **{"train.resume": "auto", "train.async_save": "true"})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run))
    acc.Reload()
    phases["finished"]["tensorboard_loss_steps"] = [e.step for e in acc.Scalars("train/loss")] \
        if "train/loss" in acc.Tags()["scalars"] else []
    # two dp ranks, each writing the half of the state it owns into the one folder: the whole does not fit
    phase("dp2_full", disk / "dp2", 1, size // 2, runner=train_ranks)
    Path(report).write_text(json.dumps(phases, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
