"""bench/mfu.py --toy runs end to end at toy sizes on the CPU (the issue's bound: under 30 s in the suite) and
prints the tables docs/benchmarks.md records: a row per contender with its ratio to the eager peer, and the
document-masked attention call's two paths."""
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_toy_prints_a_row_per_contender_with_its_ratio():
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mfu.py"), "--toy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    took = time.monotonic() - began
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\| (megazero eager|peer eager) \| ([0-9.]+) \| [0-9. ]+ \| ([0-9.]+) \| [0-9,]+ \| "
                      r"[0-9.]+% \| ([0-9.]+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["megazero eager", "peer eager"], proc.stdout
    assert float(rows[1][2]) == 1.0 and float(rows[0][2]) > 0, rows
    assert all(5.0 < float(r[3]) < 7.5 for r in rows), rows  # a loss near ln(512) = 6.24: both train a model
    # the document-masked call: the path auto takes on the CPU against the dense mask, with its peak memory
    docs = re.findall(r"^\| (auto \(blocks\)|torch, dense mask) \| [0-9.]+ \| [0-9. ]+ \| ([0-9.]+) \| [0-9,]+ \| "
                      r"[0-9,.]+ \|$", proc.stdout, re.M)
    assert [d[0] for d in docs] == ["auto (blocks)", "torch, dense mask"] and float(docs[1][1]) == 1.0, proc.stdout
    assert took < 30, took
