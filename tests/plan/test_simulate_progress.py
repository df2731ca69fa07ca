"""A long simulation is seen working: progress lines from inside each simulated step (the issue's 138 s of
silence at cp 1024), through simulate_class's per-simulation lines."""
from __future__ import annotations


def _cfg():
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve

    return resolve(load_config(None, ["model.layers=2", "model.hidden=32", "model.heads=2", "model.seq_len=16",
                                      "model.vocab_size=128", "train.micro_batch=1", "train.global_batch=7",
                                      "parallel.dp=1"]), 1, "cpu")


def test_each_simulation_reports_its_steps_as_they_go(monkeypatch):
    """With no wait between lines every forward and backward is reported, under the simulation that runs it:
    3 simulations (3, 4 and 5 microbatches) of 2 steps (the first over one microbatch, simulate.first_step),
    the counts rising to the step's microbatches."""
    import megazero.plan.tracker as tracker
    from megazero.plan.extrapolate import simulate_class
    from megazero.plan.stage_plan import make_plan

    monkeypatch.setattr(tracker, "PROGRESS_S", 0.0)
    cfg = _cfg()
    lines: list[str] = []
    simulate_class(cfg, 0, make_plan(cfg), lines.append, lines.append)
    heads = [i for i, line in enumerate(lines) if line.startswith("  rank 0: simulation ")]
    assert len(heads) == 3, lines
    for n, (i, j) in enumerate(zip(heads, heads[1:] + [len(lines)])):
        m, got = 3 + n, [line for line in lines[i + 1:j] if " done, after " in line]
        assert all(" begun), after " in line for line in lines[i + 1:j] if line not in got), lines[i + 1:j]
        assert len(got) == 2 + 2 * m and all(line.startswith("    rank 0: step ") for line in got), (m, got)
        assert got[1].startswith("    rank 0: step 1: 1 forwards and 1 backwards of 1 done, after"), got
        assert got[-1].startswith(f"    rank 0: step 2: {m} forwards and {m} backwards of {m} done, after"), got


def test_progress_waits_between_lines():
    """At the default wait a step of a few milliseconds says nothing."""
    from megazero.plan.simulate import simulate_rank
    from megazero.plan.stage_plan import make_plan

    cfg = _cfg()
    lines: list[str] = []
    simulate_rank(cfg, 0, make_plan(cfg), lines.append)
    assert lines == []


def test_a_long_forward_is_reported_while_it_runs(monkeypatch):
    """A forward of many ops (one of cp 1024's ring layers runs minutes) says where it is every TICK_OPS ops,
    before its own end is reported: here every op, each line naming the moment; so does the build before."""
    import megazero.plan.tracker as tracker
    from megazero.plan.simulate import simulate_rank
    from megazero.plan.stage_plan import make_plan

    monkeypatch.setattr(tracker, "PROGRESS_S", 0.0)
    monkeypatch.setattr(tracker, "TICK_OPS", 1)
    cfg = _cfg()
    lines: list[str] = []
    simulate_rank(cfg, 0, make_plan(cfg), lines.append)
    building = [line for line in lines if line.startswith("building the stage, after ")]
    assert building and lines[:len(building)] == building, lines[:3]  # the build's ops, before the steps
    lines = lines[len(building):]
    first_done = next(i for i, line in enumerate(lines) if " done, after " in line)
    assert first_done > 0 and lines[0].startswith(
        "at step 1, forwards: forward of microbatch 0, 1 microbatches in flight (1 forwards and 0 backwards of 1 "
        "begun), after "), lines[:3]
