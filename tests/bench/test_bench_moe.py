"""bench/moe.py runs end to end (--smoke: toy sizes, one timed step, in this process; the ep part on 2 spawned
gloo ranks) and prints every table and ratio that docs/benchmarks.md records. What is checked is the output's
format and that the contenders compute the same thing, not speed."""
import re

from bench import moe

NUM = r"[0-9]+(?:\.[0-9]+)?(?:e[-+][0-9]+)?"


def test_smoke_prints_every_table_and_ratio(capsys):
    moe.main(["--smoke"])
    out = capsys.readouterr().out
    for heading in ("## Mixture of experts (CPU):", "### MoE layer, one process",
                    "### Expert parallelism: 2 gloo ranks", "Grouped matmul, cpu float32, forward + backward"):
        assert heading in out, heading
    for name in ("MoE layer", "per-expert loop", "dense SwiGLU", "ep 1", "ep 2"):  # a row with a time, each
        assert re.search(rf"^\| {name} \| {NUM} \| {NUM} \|", out, re.M), name
    for ratio in ("MoE layer / per-expert loop", "MoE layer / dense SwiGLU", "ep 2 / ep 1"):
        assert re.search(rf"^- ratio {ratio}: {NUM} \(rounds: {NUM}\)", out, re.M), ratio
    # the contenders compute the same layer: fp32, relative to the largest value (bound 1e-5)
    for what in ("MoE layer vs per-expert loop", "ep 2 vs ep 1"):
        found = re.findall(rf"^- {what}: max relative difference of the output.* ({NUM}) \(fp32\)$", out, re.M)
        assert len(found) == 1 and float(found[0]) <= 1e-5, (what, found)
    rows = re.findall(r"^\| 4 x \(32, 16\), 64 rows(?:, skewed)? \| \d+-\d+ \| ((?:[^|]+\|){3})", out, re.M)
    assert len(rows) == 2 and all(cell.strip() != "n/a" for r in rows for cell in r.split("|")[:-1]), rows
    assert len(re.findall(r"^- fastest at .*: (torch\._grouped_mm|loop|padded bmm)$", out, re.M)) == 2
    assert re.search(r"^- largest relative difference from the loop: .*: ok$", out, re.M)
