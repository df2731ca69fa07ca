"""bench/kernels.py runs end to end (--smoke: toy sizes, CPU, Triton interpreter), so a GPU session spends its
minutes measuring, not debugging the script. What is checked is the script's output, not speed."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernels.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # --smoke must set it itself
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_smoke_prints_every_table_and_target():
    proc = run("--smoke")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for heading in ("### Attention, float32, causal: TFLOP/s", "### Attention, float32: max |error|",
                    "### Grouped-query attention, float32, causal, head_dim 64, 2 query heads per k/v head",
                    "### AdamW over 4099 elements", "### Targets"):
        assert heading in out, heading
    # every head dim timed for megazero (a number, not n/a) and checked against the fp32 reference
    timed = re.findall(r"^\| 64 \| (64|128) \| \d+ x \d+ \| ([^|]+) \|", out, re.M)
    assert sorted(d for d, _ in timed) == ["128", "64"] and all(cell.strip() != "n/a" for _, cell in timed)
    errors = re.findall(r"^\| 64 \| (64|128) \| megazero triton \| (.+) \|$", out, re.M)
    assert len(errors) == 2
    for _, cells in errors:
        values = [float(c) for c in cells.split("|")]
        assert len(values) == 4 and max(values) < 1e-4  # fp32 kernels against the fp32 math backend
    # grouped-query attention: megazero's kernel on 2 query heads per k/v head, timed and within fp32 error
    gqa = re.findall(r"^\| 64 \| 2 x 2 \(1\) \| ([^|]+) \|[^|]+\|[^|]+\|[^|]+\| ([^|]+) \|", out, re.M)
    assert len(gqa) == 1 and gqa[0][0].strip() != "n/a" and float(gqa[0][1]) < 1e-4, gqa
    adam = re.findall(r"^\| (megazero triton AdamW|megazero torch adamw_step|torch.optim.AdamW)[^|]*\| 28 \| "
                      r"([0-9.]+) \|", out, re.M)
    assert len(adam) == 3
    targets = out.split("### Targets")[1]
    assert len(re.findall(r"^- AdamW: .*: (MET|MISSED)$", targets, re.M)) == 2
    for name in ("megazero triton", "megazero atomic dQ"):
        found = re.findall(rf"^- float32 errors, {name}, head_dim (64|128), seq 64: .*: (MET|MISSED)$", targets, re.M)
        assert len(found) == 2, name


def test_needs_a_gpu_without_smoke():
    proc = run()
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr


def test_gpu_checks_smoke(tmp_path):
    """bench/gpu_checks.py (the one script a GPU session runs) end to end at toy sizes on the CPU: every
    step runs, the loss comparisons are made, and only its four files are written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").exists() else proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.md", "log.txt", "profile.md", "summary.md"]
    assert summary.startswith("# GPU checks (smoke, CPU): all checks passed")
    assert len(re.findall(r"^- ok triton kernels follow torch kernels over 4 steps", summary, re.M)) == 1
    assert len(re.findall(r"^- ok (offloaded optimizer|ZeRO-3 offloaded) follows the on-device run", summary, re.M)) == 2
    assert len(re.findall(r"^- ok pipeline trace: [1-9][0-9]* spans", summary, re.M)) == 1
    assert len(re.findall(r"^- (torch|triton) kernels: [0-9,]+ tokens/s", summary, re.M)) == 2
    assert "### Targets" in (tmp_path / "kernels.md").read_text()
    # long-run safety: divergence stops, SIGTERM saves, async saves equal sync ones, a model too big is refused
    for check in ("diverging bf16 run: exit 3", "SIGTERM mid-run: exit 143", "async saves equal sync saves",
                  "model too big: exit 2"):
        assert len(re.findall(rf"^- ok {check}", summary, re.M)) == 1, check
    # the offloaded optimizer's copies: the script runs (on the CPU it has no copies to time)
    assert "Offloaded gradient copies (bench/offload_overlap.py):" in summary
    # the experts' grouped matmul against the per-expert loop: a table, and the results agree
    assert "Grouped matmul (bench/grouped_mm.py):" in summary
    assert len(re.findall(r"^- ok grouped matmul agrees with the per-expert loop", summary, re.M)) == 1
    # the CPU-rank benchmarks: pipeline schedules and tensor-parallel overlap run and report
    assert re.search(r"^\| zb1p even, overlap \| [0-9.]+ \|", summary, re.M)
    assert "Tensor-parallel overlap (bench/tp_overlap.py):" in summary
    # the step profile: a wall time per kernel set, in profile.md and summarised in summary.md
    assert len(re.findall(r"^- wall: [0-9.]+ ms/step", summary, re.M)) == 2
    assert len(re.findall(r"^- enqueueing one attention forward \(batch 1\): \d+ us",
                          (tmp_path / "profile.md").read_text(), re.M)) == 2


def test_gpu_checks_report_what_the_budget_left_out(tmp_path):
    """With no time left nothing runs, and the summary says so: a check that did not run is a failure."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--smoke", "--budget", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# GPU checks (smoke, CPU): FAILED: environment: not run, the time budget is spent")
    assert len(re.findall(r"^- FAILED .*: not run, the time budget is spent$", summary, re.M)) == 18  # every command of every section, the CPU-rank benchmarks included
