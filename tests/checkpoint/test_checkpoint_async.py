"""Asynchronous checkpoint saves: the checkpoint holds the state as of save(), whatever training does next;
a kill mid-write leaves the previous checkpoint latest; two gloo ranks commit correct checkpoints while
training's own collectives run beside DCP's background ones."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megazero.checkpoint import store as checkpoint
from megazero.checkpoint.unpickle import SafeFileSystemReader
from megazero.checkpoint.writer import CheckpointWriter, _StagedWriter
from megazero.errors import UserError
from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(64, 32, generator=g), "model/h": torch.randn(64, generator=g).bfloat16(),
            "optim/w/exp_avg": torch.randn(64, 32, generator=g), "optim/w/step": torch.tensor(3.0)}


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, in this process."""
    import torch.distributed.checkpoint as dcp

    stored = checkpoint.stored_tensors(path)
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in stored.items()}
    with checkpoint.quiet_dcp():
        dcp.load(out, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return out


def _held_writes(monkeypatch) -> threading.Event:
    """Background writes wait for the returned event: the test decides when the write happens."""
    release = threading.Event()
    original = _StagedWriter.write_data

    def held(self, plan, planner):
        assert release.wait(60), "the test never released the write"
        return original(self, plan, planner)

    monkeypatch.setattr(_StagedWriter, "write_data", held)
    return release


def test_async_checkpoint_is_the_state_at_save_even_as_training_changes_it(tmp_path, monkeypatch):
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    checkpoint.save(tmp_path / "sync", 1, expected, {"consumed_samples": 8}, keep_last=1, run_id="r")
    release = _held_writes(monkeypatch)
    writer = CheckpointWriter(tmp_path / "async", keep_last=1, async_save=True)
    path = writer.save(1, state, {"consumed_samples": 8}, "r")
    for t in state.values():  # the optimizer's next steps, before a byte is written
        t.mul_(-3).add_(7)
    assert writer.poll() is None and not path.exists()  # not committed while the write is pending
    release.set()
    assert writer.wait() == path and checkpoint.latest_checkpoint(tmp_path / "async") == path
    writer.close()
    ours, reference = _read(path), _read(tmp_path / "sync" / "step_00000001")
    assert ours.keys() == reference.keys() == expected.keys()
    for k in expected:
        assert ours[k].dtype == expected[k].dtype and torch.equal(ours[k], expected[k]), k
        assert torch.equal(ours[k], reference[k]), k
    meta = checkpoint.read_meta(path, require=())
    assert meta["consumed_samples"] == 8 and meta["run_id"] == "r" and meta["step"] == 1


def test_one_save_in_flight_and_the_next_save_commits_the_previous(tmp_path, monkeypatch):
    release = _held_writes(monkeypatch)
    writer = CheckpointWriter(tmp_path, keep_last=5, async_save=True)
    writer.save(1, _state(), {}, "r")
    threading.Timer(0.3, release.set).start()
    t0 = time.perf_counter()
    writer.save(2, _state(), {}, "r")  # waits for step 1's write, commits it, then stages step 2
    assert time.perf_counter() - t0 >= 0.25  # it did wait for the release (timer 0.3 s, less scheduling slack)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    writer.close()  # commits step 2
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]


def test_a_failed_background_write_is_one_line_and_the_previous_stays_latest(tmp_path, monkeypatch):
    writer = CheckpointWriter(tmp_path, keep_last=5, async_save=True)
    writer.save(1, _state(), {}, "r")
    writer.wait()

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_StagedWriter, "write_data", full_disk)
    writer.save(2, _state(), {}, "r")
    with pytest.raises(UserError, match=r"step_00000002: no space left on .* free\); the partial step_00000002.tmp "
                                        r"was removed and the previous checkpoint stays the latest$"):
        writer.wait()
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    monkeypatch.undo()
    writer.save(3, _state(), {}, "r")
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]  # .tmp cleared


_KILLED_CHILD = """
import os, sys, time, torch
sys.path.insert(0, {root!r})
from megazero.checkpoint.writer import CheckpointWriter, _StagedWriter

original = _StagedWriter.write_data

def write_then_stall(self, plan, planner):  # the shards are on disk; DCP's .metadata and the commit are not
    done = original(self, plan, planner)
    os.write(1, b"written\\n")  # one write: print's text and newline are two, and interleave across threads
    time.sleep(600)
    return done

writer = CheckpointWriter({ckpt!r}, keep_last=5, async_save=True)
state = {{"model/w": torch.arange(6.0).reshape(2, 3)}}
writer.save(1, state, {{"consumed_samples": 8}}, "r")
writer.wait()
_StagedWriter.write_data = write_then_stall
state["model/w"].add_(1)
writer.save(2, state, {{"consumed_samples": 16}}, "r")
state["model/w"].add_(1)
os.write(1, b"returned\\n")
while True:  # training goes on, polling
    writer.poll()
    time.sleep(0.01)
"""


def test_sigkill_during_the_background_write_leaves_the_previous_checkpoint_latest(tmp_path):
    ckpt = tmp_path / "checkpoints"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD.format(root=str(ROOT), ckpt=str(ckpt))],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}  # either order
        assert lines == {"written", "returned"}, lines
        tmp = ckpt / "step_00000002.tmp"
        assert any(tmp.glob("*.distcp")) and not (tmp / "meta.json").exists()
        assert not (ckpt / "step_00000002").exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    latest = checkpoint.latest_checkpoint(ckpt)
    assert latest.name == "step_00000001"
    loaded = {"model/w": torch.zeros(2, 3)}
    assert checkpoint.load(latest, loaded)["consumed_samples"] == 8
    assert torch.equal(loaded["model/w"], torch.arange(6.0).reshape(2, 3))
    writer = CheckpointWriter(ckpt, keep_last=5, async_save=True)  # the next run's save clears the debris
    writer.save(3, {"model/w": torch.ones(2, 3)}, {"consumed_samples": 24}, "r")
    writer.close()
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000001", "step_00000003"]


def _full(step: int, world: int) -> dict[str, torch.Tensor]:
    """The logical tensors at save ``step``: two tp-sharded (rows, columns), one replicated, one per rank."""
    out = {"model/a": torch.arange(24.0).reshape(4, 6) + 100 * step,
           "optim/a/exp_avg": torch.arange(12.0).reshape(3, 4) - step,
           "model/b": torch.arange(5.0) * step}
    out.update({f"model/own{r}": torch.full((3,), 10.0 * r + step) for r in range(world)})
    return out


def _two_ranks(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def local_state(step: int) -> dict[str, torch.Tensor]:
        f = _full(step, world)
        return {"model/a": DTensor.from_local(f["model/a"].chunk(world, 0)[rank].clone(), mesh, [Shard(0)],
                                              run_check=False),
                "optim/a/exp_avg": DTensor.from_local(f["optim/a/exp_avg"].chunk(world, 1)[rank].clone(), mesh,
                                                      [Shard(1)], run_check=False),
                "model/b": f["model/b"].clone(), f"model/own{rank}": f[f"model/own{rank}"].clone()}

    writer = CheckpointWriter(Path(root) / "async", keep_last=2, async_save=True)
    sync = CheckpointWriter(Path(root) / "sync", keep_last=5, async_save=False)
    last = None  # the last path poll() or wait() reported committed
    for step in (1, 2, 3):
        state = local_state(step)
        writer.save(step, state, {"consumed_samples": 8 * step}, "run-a")
        for t in state.values():  # training's next step overwrites the tensors at once
            (t.to_local() if isinstance(t, DTensor) else t).fill_(-1.0)
        sync.save(step, local_state(step), {"consumed_samples": 8 * step}, "run-a")  # default-group DCP meanwhile
        x = torch.ones(4)
        for _ in range(10):  # and training's collectives
            dist.all_reduce(x)
            last = writer.poll() or last
        assert torch.equal(x, torch.full((4,), float(world ** 10)))
    last = writer.wait() or last
    writer.close()
    result = {"committed": str(last)}
    if rank == 0:
        async_root, sync_root = Path(root) / "async", Path(root) / "sync"
        result["listed"] = [p.name for p in checkpoint.list_checkpoints(async_root)]
        result["equal"] = {}
        for path in checkpoint.list_checkpoints(async_root):
            step = checkpoint.read_meta(path, require=())["step"]
            ours, reference, expected = _read(path), _read(sync_root / path.name), _full(step, world)
            result["equal"][step] = (ours.keys() == expected.keys() == reference.keys()
                                     and all(torch.equal(ours[k], expected[k]) and torch.equal(ours[k], reference[k])
                                             for k in expected))
    result["needs"] = _needs_said(rank, Path(root))
    dist.barrier()
    return result


def _needs_said(rank: int, root: Path) -> dict:
    """Each rank holding only its own (uneven) share, as under ZeRO: the files of a good save of it, and what
    each writer says a full disk needed for the next."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    def full_disk(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    owned = {f"model/own{rank}": torch.zeros(16384 * (rank + 1))}  # 64 KB on rank 0, 128 KB on rank 1
    said = {}
    for kind in ("sync", "async"):
        writer = CheckpointWriter(root / f"needs-{kind}", keep_last=5, async_save=kind == "async")
        good = writer.save(1, owned, {}, "run-n")
        writer.wait()
        original = FileSystemWriter.write_data
        FileSystemWriter.write_data = full_disk  # every rank's write: DCP's sync and async writers alike
        try:
            writer.save(2, owned, {}, "run-n")
            writer.wait()
        except UserError as e:
            said[kind] = {"line": str(e), "files": sum(f.stat().st_size for f in good.iterdir())}
        finally:
            FileSystemWriter.write_data = original
            writer.close()
    return said


def test_two_gloo_ranks_commit_correct_async_checkpoints(tmp_path):
    results = run_ranks(2, _two_ranks, str(tmp_path), timeout=240)
    assert results[0]["listed"] == ["step_00000002", "step_00000003"]  # keep_last=2 of this run's
    assert results[0]["equal"] == {2: True, 3: True}
    assert {r["committed"] for r in results} == {str(tmp_path / "async" / "step_00000003")}
    for rank, result in enumerate(results):  # the whole checkpoint's need, not the rank's share
        for kind in ("sync", "async"):
            said = result["needs"][kind]
            found = re.search(r"needs about ([0-9.]+) KB", said["line"])
            assert found and abs(float(found.group(1)) * 1e3 - said["files"]) <= 0.1 * said["files"], (rank, said)
