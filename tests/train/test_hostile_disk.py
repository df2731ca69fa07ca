"""A full disk under a run: every writer (the checkpoint, sync and async; metrics.jsonl; TensorBoard) stops the
run in one line that says "no space left on <folder>", the partial files it made are gone, the previous
checkpoint stays the latest, and once there is room again ``train.resume=auto`` finishes the run.

The disk is a real one: an 8 MB tmpfs mounted in a mount namespace of its own (``unshare``), filled by a
ballast file (tests/train/full_disk.py runs the runs there, one torch import for all). Where no tmpfs can
be mounted (no unshare, or user and mount namespaces not permitted), the test is skipped and says why.
"""
from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from tests.hostile import ROOT, run_process
from tests.runs import write_corpus

MOUNT = 'mount -t tmpfs -o size=8m tmpfs "$0" || exit 97; exec "$@"'
NAMESPACES = (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"])
UNITS = {"bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Run tests/train/full_disk.py over a fresh tmpfs; its report (or a skip, where none can be mounted)."""
    if shutil.which("unshare") is None:
        pytest.skip("cannot mount a small tmpfs to fill: no unshare command here")
    base = tmp_path_factory.mktemp("full_disk")
    corpus, cache, disk, out = write_corpus(base / "text"), base / "cache", base / "disk", base / "report.json"
    disk.mkdir()
    refusals = []
    for namespace in NAMESPACES:
        proc = run_process([*namespace, "sh", "-c", MOUNT, str(disk), sys.executable, "-m", "tests.train.full_disk",
                            str(disk), str(corpus), str(cache), str(out)], timeout=300, cwd=ROOT)
        if proc.returncode == 97 or (proc.returncode != 0 and proc.stderr.startswith("unshare:")):
            refusals.append((proc.stderr.strip().splitlines() or ["refused"])[-1])
            continue
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
        return {**json.loads(out.read_text()), "disk": str(disk)}
    pytest.skip(f"cannot mount a small tmpfs to fill (mount and user namespaces not permitted here: "
                f"{'; '.join(refusals)})")


def _one_line(phase: dict, *fragments: str) -> str:
    """Exit 2, and stderr is one ``error:`` line holding every fragment."""
    err = phase["err"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert phase["code"] == 2 and len(lines) == 1 and "Traceback" not in err, (phase["code"], err[-3000:])
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _needs(line: str) -> float:
    found = re.search(r"needs about ([0-9.]+) (bytes|KB|MB|GB)", line)
    assert found, line
    return float(found.group(1)) * UNITS[found.group(2)]


def _steps(metrics: str) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.splitlines()]


def test_a_full_disk_mid_save_is_one_line_leaves_nothing_and_resumes(report):
    first = report["first"]
    assert first["code"] == 0, first["err"][-3000:]
    size = first["checkpoint_bytes"]
    assert size > 2_000_000, size  # two of them do not fit beside the ballast
    for name, step, kept in (("sync_full", 2, 1), ("async_full", 3, 2)):
        full, root = report[name], f"{report['disk']}/run/checkpoints"
        line = _one_line(full, f"checkpoint {root}/step_{step:08d}: no space left on {root} (needs about ",
                         f"the partial step_{step:08d}.tmp was removed and the previous checkpoint stays the latest")
        assert abs(_needs(line) - size) <= 0.1 * size, (line, size)  # the tensors' bytes: within 10% of the files
        checkpoints = sorted(f for f in full["files"] if f.startswith("checkpoints/step_") and f.endswith("/"))
        assert checkpoints == [f"checkpoints/step_{kept:08d}/"], full["files"]  # nothing partial, the last kept
        assert not [f for f in full["files"] if f.endswith(".tmp") or f.endswith(".tmp/")], full["files"]
        # the partial is gone: the room left before the run is free again, less the logs' few blocks
        assert full["free_after"] >= full["free_before"] - 64 * 1024, (full["free_before"], full["free_after"])
    resumed = report["sync_resumed"]  # the async failure's resume is the last phase's
    assert resumed["code"] == 0, resumed["err"][-3000:]
    assert _steps(resumed["metrics"]) == [1, 2]


def test_a_full_disk_under_two_ranks_says_what_the_whole_checkpoint_needs(report):
    """Each dp rank writes only the parameters it owns into the one folder: the need said is the whole
    checkpoint's (within 10% of step 1's files, which hold the same tensors), not one rank's share."""
    full, size = report["dp2_full"], report["first"]["checkpoint_bytes"]
    root = f"{report['disk']}/dp2/checkpoints"
    lines = full["err"].splitlines()
    assert full["code"] != 0 and lines and all(line.startswith("error: ") for line in lines), full
    for line in lines:  # each rank's
        assert f"checkpoint {root}/step_00000001: no space left on {root} (needs about " in line, line
        assert abs(_needs(line) - size) <= 0.1 * size, (line, size)
    assert not [f for f in full["files"] if f.startswith("checkpoints/step_")], full["files"]  # the partial is gone


def test_metrics_and_tensorboard_on_a_full_disk_are_one_line_and_leave_nothing(report):
    metrics = report["metrics_full"]
    before = report["async_full"]["metrics"]
    disk = report["disk"]
    _one_line(metrics, f"metrics {disk}/run/metrics.jsonl: no space left on {disk}/run (needs about ")
    assert metrics["metrics"] == before  # the history is whole
    assert "metrics.jsonl.tmp" not in metrics["files"], metrics["files"]
    board = report["tensorboard_full"]
    _one_line(board, f"TensorBoard events {disk}/fresh/events.out.tfevents.*: no space left on {disk}/fresh (")
    assert not [f for f in board["files"] if "tfevents" in f or f.endswith(".tmp")], board["files"]
    finished = report["finished"]
    assert finished["code"] == 0, finished["err"][-3000:]
    assert _steps(finished["metrics"]) == [1, 2, 3]
    assert finished["tensorboard_loss_steps"] == [1, 2, 3]  # each step once: the failed runs' steps are redone


def test_torchs_short_write_on_a_full_disk_is_named_a_full_disk(report):
    """"unexpected pos 704 vs 598" is a full disk where statvfs finds no room (the disk of the runs above, full
    to the last block), and stays itself where there is room (it is then not the disk's doing)."""
    said = report["short_write"]
    assert said["full"].startswith("checkpoint ") and "step_00000009: no space left on " in said["full"], said
    assert f"{report['disk']}/run/checkpoints (needs about " in said["full"], said
    assert "unexpected pos" not in said["full"], said
    assert "the write failed (RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs " \
           "598)" in said["roomy"], said


@pytest.mark.parametrize("n,text", [(0, "0 bytes"), (1, "1 byte"), (999, "999 bytes"), (1000, "1.0 KB"),
                                    (4096, "4.1 KB"), (999_949, "999.9 KB"), (999_960, "1.0 MB"),
                                    (2_335_216, "2.3 MB"), (15 * 10**9, "15.0 GB"), (3 * 10**12, "3.0 TB")])
def test_sizes_read_well_small_and_large(n, text):
    from megazero.disk import size_text

    assert size_text(n) == text


def test_a_quota_a_read_only_disk_and_a_bug_each_say_what_they_are(tmp_path):
    """EDQUOT is a full disk too; another refusal by the disk names the file and the reason; an error that is
    not the disk's is not dressed up as one (None: the caller keeps it as it is)."""
    import errno

    from megazero.disk import write_refusal

    target = tmp_path / "metrics.jsonl"
    quota = write_refusal(OSError(errno.EDQUOT, "Disk quota exceeded"), target, tmp_path, 5_000_000)
    assert quota.startswith(f"no space left on {tmp_path} (disk quota exceeded, needs about 5.0 MB, "), quota
    assert quota.endswith(" free)"), quota
    read_only = OSError(errno.EROFS, "Read-only file system", str(target))
    assert write_refusal(read_only, target, tmp_path) == f"cannot write {target} (Read-only file system)"
    assert write_refusal(ValueError("a bug"), target, tmp_path) is None
