"""The layout search (python -m megazero.plan) on the tiny config, and the cluster files it reads: every
layout it returns passes the config rules a run applies and fits the plan's memory, --layout pins knobs, the
ranking is fastest first, the pruned search finds what an exhaustive one finds, and bad input is one line."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.plan import cli as planner_cli, layouts as planner_layouts, search as planner
from megazero.plan.cluster import CLUSTER_DIR, load_cluster
from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.errors import UserError
from megazero.plan.fits import stage_bytes
from megazero.plan.stage_plan import make_plan
from megazero.plan.memo import PlanMemo
from megazero.plan.step_time import step_time

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
GPUS = 8


@pytest.fixture(scope="module")
def base():
    return load_config(TINY)


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory, base):
    """An H100 cluster whose memory fits about half of tiny's layouts without recomputation."""
    h100 = load_cluster("h100-80g")
    over, memo = [], PlanMemo()
    for lay in planner_layouts.candidates(base, GPUS, {"recompute": "none"}):
        try:
            cfg = planner.configure(base, lay, GPUS, memo)
        except UserError:
            continue
        over.append(step_time(cfg, h100, plan=make_plan(cfg, memo)).memory_bytes)
    budget = sorted(over)[len(over) // 2]
    path = tmp_path_factory.mktemp("clusters") / "small.yaml"
    text = (CLUSTER_DIR / "h100-80g.yaml").read_text()
    path.write_text(text.replace("memory_gb: 80", f"memory_gb: {budget / planner.MEMORY_MARGIN / 1e9:.9f}"))
    return load_cluster(path)


def overrides(lay: planner_layouts.Layout) -> list[str]:
    """The layout as pretrain.py --set arguments."""
    rec = [] if lay.recompute == "none" else ["model.activation_checkpointing=true", "model.checkpoint_layers="
                                              + ("0" if lay.recompute == "full" else lay.recompute)]
    return [f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.dp={lay.dp}",
            f"parallel.virtual_stages={lay.virtual_stages}", f"parallel.schedule={lay.schedule}",
            f"parallel.sequence_parallel={'true' if lay.tp > 1 else 'false'}", "parallel.pp_layers=auto",
            f"zero.stage={lay.zero_stage}", f"train.micro_batch={lay.micro_batch}"] + rec


def plan_bytes(lay: planner_layouts.Layout) -> int:
    """The --dry-run plan's largest rank, for the layout loaded as a run loads it."""
    cfg = resolve(load_config(TINY, overrides(lay)), GPUS, "cuda", planned=True)
    return max(stage_bytes(cfg, s, "cuda") for s in make_plan(cfg).stages)


def test_every_candidate_multiplies_to_the_gpus_and_every_result_passes_the_rules(base, small_cluster):
    layouts = list(planner_layouts.candidates(base, GPUS, {}))
    assert layouts and all(lay.tp * lay.pp * lay.dp == GPUS for lay in layouts)
    assert {lay.schedule for lay in layouts} >= {"1f1b", "zb1p", "interleaved"}
    found = planner.search(base, small_cluster, GPUS, {})
    assert {r.layout.recompute for r in found.ranked} > {"none"}  # recomputation was needed somewhere
    for r in found.ranked:  # loaded with --set as pretrain.py would: no UserError
        resolve(load_config(TINY, overrides(r.layout)), GPUS, "cuda", planned=True)


def test_layout_fixes_the_knobs_it_names(base):
    h100 = load_cluster("h100-80g")
    fixed = planner_layouts.parse_layout("tp=2,schedule=zb1p,recompute=1,zero_stage=3")
    assert fixed == {"tp": 2, "schedule": "zb1p", "recompute": "1", "zero_stage": 3}
    found = planner.search(base, h100, GPUS, fixed)
    assert found.ranked
    for r in found.ranked:
        assert (r.layout.tp, r.layout.schedule, r.layout.recompute, r.layout.zero_stage) == (2, "zb1p", "1", 3)
    assert len({(r.layout.pp, r.layout.micro_batch) for r in found.ranked}) > 1  # the rest is searched


def test_memory_filter_drops_layouts_over_the_plan(base, small_cluster):
    budget = small_cluster.memory_gb * 1e9 * planner.MEMORY_MARGIN
    found = planner.search(base, small_cluster, GPUS, {"recompute": "none"})
    kept = {r.layout for r in found.ranked}
    over = [lay for lay in planner_layouts.candidates(base, GPUS, {"recompute": "none"}) if lay not in kept]
    checked = 0
    for lay in over[:: max(1, len(over) // 12)]:
        try:
            need = plan_bytes(lay)
        except UserError:
            continue
        assert need > budget, lay
        checked += 1
    assert checked >= 3
    for r in found.ranked[::5]:
        assert plan_bytes(r.layout) == pytest.approx(r.memory_gb * 1e9) and r.memory_gb * 1e9 <= budget


def test_pruned_search_finds_the_fewest_recomputed_layers_an_exhaustive_one_finds(base, small_cluster):
    """Every layout at every recompute level, costed: per layout, the least level that fits is the search's."""
    budget = small_cluster.memory_gb * 1e9 * planner.MEMORY_MARGIN
    found = planner.search(base, small_cluster, GPUS, {})
    got = {dataclasses.replace(r.layout, recompute="none"): r.layout.recompute for r in found.ranked}
    assert len(got) == len(found.ranked)
    want, memo = {}, PlanMemo()  # every level costed, without the search's pruning (the memo only remembers)
    for lay in planner_layouts.candidates(base, GPUS, {"recompute": "none"}):
        per_chunk = math.ceil(base.model.layers / (lay.pp * lay.virtual_stages))
        for rec in ["none"] + [str(k) for k in range(1, per_chunk)] + ["full"]:
            try:
                cfg = planner.configure(base, dataclasses.replace(lay, recompute=rec), GPUS, memo)
            except UserError:
                break
            if step_time(cfg, small_cluster, plan=make_plan(cfg, memo)).memory_bytes <= budget:
                want[lay] = rec
                break
    assert got == want


def test_the_top_layout_is_predicted_fastest(base):
    found = planner.search(base, load_cluster("h100-80g"), GPUS, {})
    times = [r.step_s for r in found.ranked]
    assert len(times) > 10 and times[0] == min(times) and times == sorted(times)
    top = found.ranked[0]
    flops = make_plan(planner.configure(base, top.layout, GPUS)).flops_per_step
    assert top.tflops_per_gpu == pytest.approx(flops / (top.step_s * GPUS) / 1e12)
    assert top.mfu == pytest.approx(top.tflops_per_gpu / 989)


def test_json_lists_the_ranked_layouts_with_typed_keys(capsys):
    assert planner_cli.main(["--config", TINY, "--cluster", "h100-80g", "--gpus", "8", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3
    types = {"tp": int, "pp": int, "dp": int, "virtual_stages": int, "schedule": str, "zero_stage": int,
             "micro_batch": int, "recompute": str, "ep": int, "cp": int, "cp_mode": str, "memory_gb": float,
             "step_s": float, "tflops_per_gpu": float, "mfu": float}
    for row in rows:
        assert set(row) == set(types) and all(type(row[k]) is t for k, t in types.items())
        assert row["tp"] * row["pp"] * row["dp"] * row["cp"] == 8
    assert rows[0]["step_s"] <= rows[1]["step_s"] <= rows[2]["step_s"]


def test_write_saves_a_config_with_the_top_layout(tmp_path, capsys):
    out = tmp_path / "laid_out.yaml"
    argv = ["--config", TINY, "--cluster", "h100-80g", "--gpus", "8", "--json", "--top", "1",
            "--set", "train.global_batch=32", "--layout", "pp=2", "--write", str(out)]
    assert planner_cli.main(argv) == 0
    top = json.loads(capsys.readouterr().out)[0]
    cfg = resolve(load_config(out), 8, "cuda", planned=True)
    assert cfg.train.global_batch == 32 and cfg.model.hidden == 192 and cfg.log.dir == "runs/laid_out"
    assert dataclasses.asdict(planner_cli.own_layout(cfg, 8)) == {k: top[k] for k in planner_layouts.KNOBS}


def test_write_never_replaces_an_existing_file(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    out.write_text("# the user's own config\n")
    argv = ["--config", TINY, "--cluster", "h100-80g", "--gpus", "8", "--top", "1",
            "--set", "train.global_batch=32", "--layout", "pp=2", "--write", str(out)]
    assert planner_cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"--write {out}: already exists" in err[0], err
    assert out.read_text() == "# the user's own config\n"


@pytest.mark.parametrize("argv, says", [
    (["--layout", "tq=2"], "--layout 'tq=2' is invalid"),
    (["--layout", "tp=two"], "--layout tp='two' is invalid"),
    (["--layout", "recompute=most"], "recompute='most' is invalid"),
    (["--layout", "zero_stage=4"], "zero_stage='4' is invalid"),
    (["--layout", "schedule=fast"], "schedule='fast' is invalid"),
    (["--cluster", "no-such-cluster"], "--cluster no-such-cluster: no such file"),
    (["--gpus", "0"], "--gpus 0 is invalid"),
    (["--gpus", "7"], "no layout of 7 GPUs"),
    (["--layout", "tp=4"], "passes the config rules (e.g."),
    (["--gpus", "1", "--set", "model.hidden=24576", "--set", "model.heads=96"], "no layout fits 1 x h100-80g"),
])
def test_bad_input_is_one_line(capsys, argv, says):
    args = {"--config": TINY, "--cluster": "h100-80g", "--gpus": "8"}
    args.update({k: v for k, v in zip(argv[::2], argv[1::2]) if k != "--set"})
    sets = [x for i in range(0, len(argv), 2) if argv[i] == "--set" for x in argv[i:i + 2]]
    assert planner_cli.main([x for kv in args.items() for x in kv] + sets) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err and "Traceback" not in err


def test_cli_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "megazero.plan", "--config", TINY, "--cluster", "h100-80g",
                        "--gpus", "8", "--layout", "pp=three"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: --layout pp='three' is invalid; valid: an integer >= 1"]


# --- cluster files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, memory, peak", [("a100-80g", 80, 312), ("h100-80g", 80, 989)])
def test_shipped_clusters_load(name, memory, peak):
    c = load_cluster(name)
    assert (c.name, c.memory_gb, c.peak_tflops, c.gpus_per_node) == (name, memory, peak, 8)
    assert c.link(True)[0] < c.link(False)[0]  # InfiniBand per GPU is slower than NVLink
    assert load_cluster(CLUSTER_DIR / f"{name}.yaml") == c


@pytest.mark.parametrize("edit, says", [
    (lambda t: t + "nvlink_gbps: 900\n", "nvlink_gbps=900 is invalid; unknown key"),
    (lambda t: t.replace("inter_node_gbps: 50", "inter_node_gbps: -50"), "inter_node_gbps=-50 is invalid"),
    (lambda t: t.replace("hbm_gbps: 3350", ""), "hbm_gbps is missing"),
    (lambda t: t.replace("gpus_per_node: 8", "gpus_per_node: 8.5"), "expected an integer from 1 to 4096"),
])
def test_bad_cluster_file_is_one_line(tmp_path, capsys, edit, says):
    path = tmp_path / "bad.yaml"
    path.write_text(edit((CLUSTER_DIR / "h100-80g.yaml").read_text()))
    with pytest.raises(UserError, match=says.replace("(", r"\(")) as e:
        load_cluster(path)
    assert "\n" not in str(e.value)
    assert planner_cli.main(["--config", TINY, "--cluster", str(path), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
