"""The layout planner (python -m megazero.plan) against hostile input: GPU counts and searches too large to
answer, cluster files with extreme values, and a --write that cannot be written. Each is one line, exit 2, at
once, and leaves no file behind.

A case that hung before is run under a watchdog (SIGALRM in this process), so that a regression fails the test
instead of the suite."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megazero.config.ranges import MAX_WORLD
from megazero.config.yaml_load import load_yaml
from megazero.plan import cli as planner_cli, search as planner_search
from megazero.plan.cluster import CLUSTER_DIR
from tests.hostile import ROOT, assert_one_line, call, watchdog

TINY = str(ROOT / "configs" / "tiny.yaml")
LLAMA_70B = str(ROOT / "configs" / "llama3-70b.yaml")
FEW = ["--layout", "tp=2,pp=2,zero_stage=1"]  # a search of a few layouts: the cluster cases cost milliseconds


def plan(argv: list[str], capsys, seconds: int = 60) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds taken) of the planner's main in this process, under a watchdog."""
    start = time.perf_counter()
    with watchdog(seconds):
        code, out, err = call(planner_cli.main, argv, capsys)
    return code, out, err, time.perf_counter() - start


# --- GPU counts and search sizes -------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [10 ** 18, 10 ** 30, MAX_WORLD + 1, -1])
def test_a_gpu_count_past_the_world_limit_is_refused_at_once(capsys, gpus):
    code, _, err, took = plan(["--config", TINY, "--cluster", "h100-80g", "--gpus", str(gpus)], capsys)
    assert_one_line(code, err, f"--gpus {gpus} is invalid", f"from 1 to {MAX_WORLD}")
    assert took < 5  # a check before anything is searched: milliseconds


def test_the_largest_gpu_count_with_the_largest_batch_answers_in_seconds(capsys):
    """2^20 GPUs and a 2^24-sequence batch: a search of hundreds of layouts of up to 2^20 ranks and 2^20
    microbatch passes each. About a second on an idle core (it took minutes: every rank and every schedule
    action was listed per layout); 30 s allows a loaded machine."""
    argv = ["--config", TINY, "--cluster", "h100-80g", "--gpus", str(MAX_WORLD), "--global-batch", str(2 ** 24),
            "--json", "--top", "3"]
    code, out, err, took = plan(argv, capsys, seconds=120)
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 3 and all(r["tp"] * r["pp"] * r["dp"] == MAX_WORLD for r in rows)
    assert took < 30


def test_a_search_of_too_many_layouts_is_refused_at_once(capsys):
    """720,720 GPUs (240 divisors) with llama3-70b's 80 layers and a batch of many divisors: 63,000 layouts and
    ~246M units of listed planning work (over megazero.plan.layouts.MAX_LISTED_WORK), minutes of planning.
    Refused before any is planned; --layout pp= narrows it to a search that answers."""
    argv = ["--config", LLAMA_70B, "--cluster", "h100-80g", "--gpus", "720720", "--global-batch", "11531520"]
    code, _, err, took = plan(argv, capsys)
    assert_one_line(code, err, "the search of 720720 GPUs is too large to answer in seconds", "--layout")
    assert took < 10  # listing the layouts and their work: a fraction of a second


def test_a_search_whose_plans_pass_the_work_bound_stops_in_one_line(capsys, monkeypatch):
    """The bound on planning work (deep pipelines over many GPUs with a deep model reach it: hours of plans
    before it), shown with a bound small enough for tiny's search."""
    monkeypatch.setattr(planner_search, "MAX_SEARCH_WORK", 5000)
    code, _, err, _ = plan(["--config", TINY, "--cluster", "h100-80g", "--gpus", "8"], capsys)
    assert_one_line(code, err, "the search of 8 GPUs is too large to answer in seconds", "5,000 units of work")


# --- cluster files ----------------------------------------------------------------------------------------

NUMBERS = load_yaml((CLUSTER_DIR / "h100-80g.yaml").read_text(), "h100-80g.yaml")
# (low, high) of each key, as megazero.plan.cluster gives them
BOUNDS = {"gpus_per_node": (1, 4096), "memory_gb": (0.001, 1e5), "peak_tflops": (0.1, 1e5),
          "hbm_gbps": (0.01, 1e6), "intra_node_gbps": (0.01, 1e6), "inter_node_gbps": (0.01, 1e6),
          "intra_node_latency_us": (0.001, 1e6), "inter_node_latency_us": (0.001, 1e6)}


def cluster_file(tmp_path: Path, **values) -> Path:
    """The H100 cluster with some keys' values replaced (by YAML text, or a number)."""
    text = "".join(f"{k}: {values.get(k, v)}\n" for k, v in NUMBERS.items())
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("key, text, shown", [
    ("peak_tflops", "5e-324", "5e-324"), ("peak_tflops", "1e308", "1e+308"), ("hbm_gbps", "1e308", "1e+308"),
    ("hbm_gbps", "1e-300", "1e-300"), ("memory_gb", "1e-9", "1e-09"), ("intra_node_gbps", "1e-12", "1e-12"),
    ("inter_node_gbps", "1e30", "1e+30"), ("inter_node_latency_us", "1e-30", "1e-30"),
    ("intra_node_latency_us", "1e300", "1e+300"), ("gpus_per_node", "1000000", "1000000"),
    ("peak_tflops", ".nan", "nan"), ("hbm_gbps", ".inf", "inf"), ("memory_gb", "-.inf", "-inf"),
    ("peak_tflops", "true", "True"), ("gpus_per_node", "true", "True"), ("inter_node_gbps", "'50'", "'50'"),
    ("memory_gb", "null", "None"), ("gpus_per_node", "8.0", "8.0"),
])
def test_an_extreme_cluster_value_is_one_line_naming_the_file_key_value_and_range(tmp_path, capsys, key, text,
                                                                                   shown):
    path = cluster_file(tmp_path, **{key: text})
    low, high = BOUNDS[key]
    code, _, err, _ = plan(["--config", TINY, "--cluster", str(path), "--gpus", "8"] + FEW, capsys)
    assert_one_line(code, err, str(path), f"{key}={shown} is invalid", f"from {low:g} to {high:g}")


@pytest.mark.parametrize("key", sorted(BOUNDS) + ["every key"])
def test_each_cluster_key_plans_at_its_bounds_and_is_refused_past_them(tmp_path, capsys, key):
    """At either bound (one key, or every key at once) the step-time model stays finite: the planner answers,
    or says in one line that no layout fits. Just past either bound the loader refuses."""
    keys = sorted(BOUNDS) if key == "every key" else [key]

    def run(end: int, past: bool) -> tuple[int, str, str, float]:
        values = {}
        for k in keys:
            low, high = BOUNDS[k]
            if not past:
                values[k] = (low, high)[end]
            elif k == "gpus_per_node":
                values[k] = (low - 1, high + 1)[end]
            else:
                values[k] = (low / 2, high * 2)[end]
        path = cluster_file(tmp_path, **values)
        return plan(["--config", TINY, "--cluster", str(path), "--gpus", "8", "--json"] + FEW, capsys)

    for end in (0, 1):
        code, out, err, _ = run(end, past=False)
        if code == 0:
            assert all(math.isfinite(r[k]) and r[k] >= 0 for r in json.loads(out)
                       for k in ("memory_gb", "step_s", "tflops_per_gpu", "mfu")), out
        else:
            assert_one_line(code, err, "no layout fits")
        code, _, err, _ = run(end, past=True)
        first = next(k for k in NUMBERS if k in keys)  # the file's first key past its bound is the one named
        low, high = BOUNDS[first]
        assert_one_line(code, err, f"{first}=", "is invalid", f"from {low:g} to {high:g}")


def test_an_unusable_cluster_name_is_one_line(capsys):
    code, _, err, _ = plan(["--config", TINY, "--cluster", "x" * 5000, "--gpus", "8"], capsys)
    assert_one_line(code, err, "--cluster 'xxx", "no such file")
    assert len(err) < 1000


# --- --write ----------------------------------------------------------------------------------------------


def write_argv(out: str) -> list[str]:
    return ["--config", TINY, "--cluster", "h100-80g", "--gpus", "8", "--top", "1", "--write", out] + FEW


@pytest.mark.parametrize("name", ["file/out.yaml", "missing/out.yaml", "out\0.yaml", "o" * 300 + ".yaml"])
def test_a_write_that_cannot_be_made_is_one_line_and_leaves_nothing(tmp_path, capsys, name):
    (tmp_path / "file").write_text("a file, not a folder\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, _, err, _ = plan(write_argv(str(tmp_path / name)), capsys)
    assert_one_line(code, err, "--write", "cannot write it")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_an_existing_write_target_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mine.yaml"
    out.symlink_to(tmp_path / "nowhere.yaml")  # a dangling link is a name taken too
    monkeypatch.setattr(planner_cli, "search", lambda *a, **k: pytest.fail("searched before refusing"))
    code, _, err, _ = plan(write_argv(str(out)), capsys)
    assert_one_line(code, err, f"--write {out}: already exists")
    assert out.is_symlink() and not (tmp_path / "nowhere.yaml").exists()


_FULL_DISK = """
import os, subprocess, sys
sys.path.insert(0, {root!r})
disk = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", disk], check=True)
fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT)
try:  # the disk, full
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    os.close(fd)
from megazero.plan import cli
code = cli.main({argv!r})
print("EXIT", code, sorted(os.listdir(disk)))
"""


def test_a_write_to_a_full_disk_is_one_line_and_leaves_no_file(tmp_path):
    """On a full 64 KB tmpfs (mounted in a user and mount namespace of its own, where this machine allows one)."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) to mount a small tmpfs")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode(errors='replace').strip()}")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = str(disk / "laid_out.yaml")
    script = _FULL_DISK.format(root=str(ROOT), argv=write_argv(out))
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", script, str(disk)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "EXIT 2 ['filler']" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert_one_line(2, r.stderr, f"--write {out}: cannot write it (No space left on device)")
