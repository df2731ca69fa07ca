"""bench/context_parallel.py runs end to end at toy sizes (2 gloo ranks, one timed step per variant) and prints
what docs/benchmarks.md records: the per-rank table, the hidden share, the step ratios, and one ring step's
transfers, also written as a Chrome trace. What is checked is the output's format, not speed."""
import json
import re

from bench import context_parallel

NUM = r"-?[0-9]+(?:\.[0-9]+)?"


def test_toy_run_prints_the_table_the_ratios_and_the_trace(capsys, tmp_path):
    trace = tmp_path / "ring.json"
    assert context_parallel.main(["--layers", "1", "--hidden", "128", "--seq-per-rank", "64", "--steps", "1",
                                  "--repeats", "1", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(rf"^ +0 +[01] +{NUM} +{NUM} +{NUM} +{NUM} +{NUM} +{NUM} +{NUM}% +{NUM} +{NUM}$", out,
                          re.M)) == 2, out
    assert re.search(rf"^transfer time hidden: median {NUM}%; from step times, \(blocking - ring\) / alone: median "
                     rf"{NUM}% \({NUM}% to {NUM}%\)$", out, re.M), out
    assert re.search(rf"^step time ring / cp=1 at 64 tokens per rank: median {NUM} \(FLOPs ideal {NUM}\); "
                     rf"ring / blocking: median {NUM}$", out, re.M), out
    assert re.search(rf"^attention per training step, CPU ms by rank \(median\): {NUM} {NUM}; busiest / least busy "
                     rf"{NUM} \(block plan's \(query, key\) pairs: 1\.000\)$", out, re.M), out
    # one layer at cp 2: K/V forward (1 hop), K/V again and dK/dV twice (home) backward
    hops = re.findall(r"^ +\d+ +(context_kv|context_grad) ", out, re.M)
    assert hops == ["context_kv", "context_kv", "context_grad", "context_grad"], hops
    events = json.loads(trace.read_text())["traceEvents"]
    assert len(events) == 2 * 2 * len(hops) and all(e["dur"] >= 0 for e in events)
