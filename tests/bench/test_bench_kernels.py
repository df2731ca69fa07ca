"""bench/kernels.py runs end to end (--smoke: toy sizes, CPU, Triton interpreter), so a GPU session spends its
minutes measuring, not debugging the script. What is checked is the script's output, not speed.

bench/kernels.py --smoke runs once, as the first command of bench/gpu_checks.py --smoke (its stdout is the
kernels.md checked here), which is run as the test suite runs it: ``--lean``, and its sections in two halves side
by side (each command is one process, mostly on one core; two keep both of the suite's cores busy). bench/mfu.py
--toy is checked from the same run (its table is the second half's mfu.md), not run again."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_checks import SECTIONS  # as a module of the tree: bench/ on sys.path would shadow HF's `kernels`

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernels.py"

# about equal halves of the lean smoke's time, in seconds, each alone:
# ~16 + 10 + 4 + 7 and ~4 + 10 + 1 + 4 + 2 + 2 + 8 + 3 (bench/gpu_checks.py's log.txt, the halves side by side)
HALVES = (("kernels", "train", "throughput", "pipeline"),
          ("mfu", "profile", "longrun", "offload", "grouped_mm", "newton_schulz", "tp_overlap", "nvme"))


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # --smoke must set it itself
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def gpu_checks_smoke(tmp_path_factory) -> list[tuple[int, str, Path]]:
    """(exit code, stderr, --out folder) of ``bench/gpu_checks.py --smoke --lean --only HALF`` for each half,
    both started at once, with 900 s of budget rather than a GPU slot's 540 (the halves share the cores, and maybe
    a busy machine's; the budget test below checks the budget itself). gpu_checks.py runs bench/kernels.py without
    TRITON_INTERPRET: its --smoke must set it."""
    assert sorted(s for half in HALVES for s in half) == sorted(SECTIONS)  # every section runs, once
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    procs = []
    for i, half in enumerate(HALVES):
        out = tmp_path_factory.mktemp(f"gpu-checks-{i}")
        procs.append((subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--smoke", "--lean",
                                        "--only", ",".join(half), "--budget", "900", "--out", str(out)], cwd=ROOT,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out))
    done = []
    for proc, out in procs:
        try:
            _, err = proc.communicate(timeout=1000)
        finally:
            proc.kill()
        done.append((proc.returncode, err, out))
    return done


def _passed(half: tuple[int, str, Path]) -> str:
    """The half's summary.md, once its exit code says every check passed."""
    code, err, out = half
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else err[-2000:]
    assert code == 0, summary
    return summary


def test_smoke_prints_every_table_and_target(gpu_checks_smoke):
    _passed(gpu_checks_smoke[0])
    out = (gpu_checks_smoke[0][2] / "kernels.md").read_text()  # bench/kernels.py --smoke's stdout
    for heading in ("### Attention, float32, causal: TFLOP/s", "### Attention, float32: max |error|",
                    "### Grouped-query attention, float32, causal, head_dim 64, 2 query heads per k/v head",
                    "### AdamW over 4099 elements", "### Targets"):
        assert heading in out, heading
    # every head dim timed for megazero (a number, not n/a) and checked against the fp32 reference
    causal = out.split("### Attention, float32, causal: TFLOP/s")[1].split("### ")[0]  # that table alone
    timed = re.findall(r"^\| 64 \| (64|128) \| \d+ x \d+ \| ([^|]+) \|", causal, re.M)
    assert sorted(d for d, _ in timed) == ["128", "64"] and all(cell.strip() != "n/a" for _, cell in timed)
    errors = re.findall(r"^\| 64 \| (64|128) \| megazero triton \| (.+) \|$", out, re.M)
    assert len(errors) == 2
    for _, cells in errors:
        values = [float(c) for c in cells.split("|")]
        assert len(values) == 4 and max(values) < 1e-4  # fp32 kernels against the fp32 math backend
    # grouped-query attention: megazero's kernel on 2 query heads per k/v head, timed and within fp32 error
    gqa = re.findall(r"^\| 64 \| 2 x 2 \(1\) \| ([^|]+) \|[^|]+\|[^|]+\|[^|]+\| ([^|]+) \|", out, re.M)
    assert len(gqa) == 1 and gqa[0][0].strip() != "n/a" and float(gqa[0][1]) < 1e-4, gqa
    # the document-masked row: the three runs each timed (the smoke's toy: seq 64, documents of 16 tokens)
    masked = out.split("### Document-masked attention, float32, causal: fwd+bwd ms")[1]
    rows = re.findall(r"^\| 64 \| 64 \| 1 x 2 \| 16 \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", masked, re.M)
    assert len(rows) == 1 and all(c.strip() != "n/a" for c in rows[0]), masked
    adam = re.findall(r"^\| (megazero triton AdamW|megazero torch adamw_step|torch.optim.AdamW)[^|]*\| 28 \| "
                      r"([0-9.]+) \|", out, re.M)
    assert len(adam) == 3
    targets = out.split("### Targets")[1]
    assert len(re.findall(r"^- AdamW: .*: (MET|MISSED)$", targets, re.M)) == 2
    for name in ("megazero triton", "megazero atomic dQ"):
        found = re.findall(rf"^- float32 errors, {name}, head_dim (64|128), seq 64: .*: (MET|MISSED)$", targets, re.M)
        assert len(found) == 2, name


def test_mfu_toy_prints_a_row_per_contender_with_its_ratio(gpu_checks_smoke):
    """bench/mfu.py --toy (the smoke's first command of its second half; mfu.md is its stdout) at toy sizes on the
    CPU, within the issue's bound of 30 s in the suite: a row per contender with its ratio to the eager peer, and
    the document-masked attention call's two paths."""
    _passed(gpu_checks_smoke[1])
    out = gpu_checks_smoke[1][2]
    took = re.findall(r"^===== bench/mfu.py: exit 0 after (\d+) s$", (out / "log.txt").read_text(), re.M)
    assert len(took) == 1 and int(took[0]) < 30, took
    stdout = (out / "mfu.md").read_text()
    rows = re.findall(r"^\| (megazero eager|peer eager) \| ([0-9.]+) \| [0-9. ]+ \| ([0-9.]+) \| [0-9,]+ \| "
                      r"[0-9.]+% \| ([0-9.]+) \|$", stdout, re.M)
    assert [r[0] for r in rows] == ["megazero eager", "peer eager"], stdout
    assert float(rows[1][2]) == 1.0 and float(rows[0][2]) > 0, rows
    assert all(5.0 < float(r[3]) < 7.5 for r in rows), rows  # a loss near ln(512) = 6.24: both train a model
    # the document-masked call: the path auto takes on the CPU against the dense mask, with its peak memory
    docs = re.findall(r"^\| (auto \(blocks\)|torch, dense mask) \| [0-9.]+ \| [0-9. ]+ \| ([0-9.]+) \| [0-9,]+ \| "
                      r"[0-9,.]+ \|$", stdout, re.M)
    assert [d[0] for d in docs] == ["auto (blocks)", "torch, dense mask"] and float(docs[1][1]) == 1.0, stdout


def test_needs_a_gpu_without_smoke():
    proc = run()
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr


def test_gpu_checks_smoke(gpu_checks_smoke):
    """bench/gpu_checks.py (the one script a GPU session runs) end to end at toy sizes on the CPU: every
    step runs, the loss comparisons are made, and only its four files are written."""
    summaries = [_passed(half) for half in gpu_checks_smoke]
    folders = [sorted(p.name for p in out.iterdir()) for _, _, out in gpu_checks_smoke]
    assert folders == [["kernels.md", "log.txt", "summary.md"], ["log.txt", "mfu.md", "profile.md", "summary.md"]], \
        folders
    assert all(s.startswith("# GPU checks (smoke, CPU): all checks passed") for s in summaries)
    summary = "\n".join(summaries)
    # the step against the peer, first of all: its table in the summary
    assert len(re.findall(r"^\| (megazero eager|peer eager) \| [0-9.]+ \|", summary, re.M)) == 2, summary
    kernels_md, profile_md = (gpu_checks_smoke[i][2] / name for i, name in ((0, "kernels.md"), (1, "profile.md")))
    # --lean: the Triton kernels' run against the torch one is tests/engine/test_kernels_training.py's
    assert "- skipped (--lean): triton kernels against torch kernels" in summary
    assert not re.findall(r"^- \S+ triton kernels follow torch kernels", summary, re.M)
    # --lean: the ZeRO-3 run offloads the optimizer too (no optimizer-only run), throughput with the torch kernels
    assert len(re.findall(r"^- ok (offloaded optimizer|ZeRO-3 offloaded) follows the on-device run", summary, re.M)) == 1
    assert "- ok ZeRO-3 offloaded follows the on-device run" in summary
    assert len(re.findall(r"^- ok pipeline trace: [1-9][0-9]* spans", summary, re.M)) == 1
    assert re.findall(r"^- (torch|triton) kernels: [0-9,]+ tokens/s", summary, re.M) == ["torch"]
    assert "### Targets" in kernels_md.read_text()
    # long-run safety, --lean: a model too big is refused; divergence, SIGTERM and async saves are made in-process
    # by tests/train/test_hostile_run.py and tests/train/test_train.py
    assert len(re.findall(r"^- ok model too big: exit 2", summary, re.M)) == 1
    assert re.findall(r"^- (?:ok|FAILED|skipped).*(?:diverging|SIGTERM|async).*$", summary, re.M) == [
        "- skipped (--lean): diverging bf16 run, SIGTERM mid-run, async saves equal sync saves"]
    # the offloaded optimizer's copies: the script runs (on the CPU it has no copies to time)
    assert "Offloaded gradient copies (bench/offload_overlap.py):" in summary
    # the experts' grouped matmul against the per-expert loop: a table, and the results agree
    assert "Grouped matmul (bench/grouped_mm.py):" in summary
    assert len(re.findall(r"^- ok grouped matmul agrees with the per-expert loop", summary, re.M)) == 1
    # Muon's Newton-Schulz: a row per shape, with TFLOP/s
    assert "Newton-Schulz (bench/newton_schulz.py):" in summary
    assert len(re.findall(r"^\| 32 x (32|64) \| float32 \| eager \| [0-9.]+ \| [0-9.]+ \|", summary, re.M)) == 2
    # the CPU-rank benchmarks: pipeline schedules and tensor-parallel overlap run and report
    assert re.search(r"^\| zb1p even, overlap \| [0-9.]+ \|", summary, re.M)
    assert "Tensor-parallel overlap (bench/tp_overlap.py):" in summary
    # the optimizer's states on the disk: the disk's figures and the step against the states in memory
    assert "Optimizer states on the disk (bench/nvme.py):" in summary
    assert re.search(r"^\| states on the disk \(nvme\) \| [0-9.]+ \|", summary, re.M), summary
    # the step profile: a wall time per kernel set, in profile.md and summarised in summary.md
    assert len(re.findall(r"^- wall: [0-9.]+ ms/step", summary, re.M)) == 2
    assert len(re.findall(r"^- enqueueing one attention forward \(batch 1\): \d+ us",
                          profile_md.read_text(), re.M)) == 2


def test_gpu_checks_report_what_the_budget_left_out(tmp_path):
    """With no time left nothing runs, and the summary says so: a check that did not run is a failure."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--smoke", "--budget", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# GPU checks (smoke, CPU): FAILED: environment: not run, the time budget is spent")
    assert len(re.findall(r"^- FAILED .*: not run, the time budget is spent$", summary, re.M)) == 21  # every command of every section, the CPU-rank benchmarks included


def test_gpu_checks_lean_needs_smoke():
    """--lean changes what the smoke run trains; a GPU run trains every run with the Triton kernels."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--lean"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--lean: only with --smoke" in proc.stderr.strip().splitlines()[-1], proc.stderr
