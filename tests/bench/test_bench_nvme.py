"""bench/nvme.py --smoke runs end to end at toy sizes on the CPU: the disk's raw throughput, the optimizer step
with its states in memory and on the disk with their ratio, the NVMe step's bytes and effective GB/s, and (--train)
the whole training step both ways, their losses equal. What is checked is the script's output and that it leaves
nothing on the disk, not speed."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_prints_the_disk_the_two_steps_and_the_bytes_and_leaves_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nvme.py"), "--smoke", "--train", "--path",
                           str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"\((O_DIRECT|buffered I/O)\), records of [0-9,]+ bytes, two in flight: write [0-9.]+ GB/s, "
                     r"read [0-9.]+ GB/s", out), out
    rows = re.findall(r"^\| states (in memory|on the disk) .*\| ([0-9.]+) \| [0-9. ]+ \| ([0-9.]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["in memory", "on the disk"] * 2, out
    assert float(rows[0][2]) == float(rows[2][2]) == 1.0, out
    assert "| training step (forward, backward, optimizer) |" in out and \
        "The two runs' losses are equal at every step." in out, out
    moved = re.search(r"The NVMe step moves ([0-9.]+) GB in and ([0-9.]+) GB out: ([0-9.]+) GB/s effective", out)
    assert moved and float(moved.group(3)) > 0, out
    assert not list(tmp_path.iterdir())
