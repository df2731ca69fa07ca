"""pretrain.py --simulate: a real run's memory, measured by the same tracker, agrees with the simulation; the
simulation sees gradient memory that grows with the microbatch count, gives the ZeRO formulas' model states
and Korthikanti et al.'s per-layer activations; the command line reports, writes simulate.json and exits 3
when a rank does not fit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]

# a small model with the run's defaults (bf16, flash-path attention): 4 layers so pp=2 with v=2 has 1 per chunk
SMALL = ["model.layers=4", "model.hidden=64", "model.heads=4", "model.seq_len=128", "model.vocab_size=512",
         "train.micro_batch=2", "train.global_batch=16", "train.precision=bf16", "zero.bucket_mb=0.05"]

# world 4 each, so one spawn measures all of them: dp > 2 at stages 2 (offloaded too) and 3, stage 1 under tp
# (with sequence parallelism) and pp, both pipeline schedules, activation checkpointing and offload (stage 0:
# the one-process run below; its formula at dp 4 in test_model_state_bytes_match_the_zero_formulas)
LAYOUTS = {
    "dp4_stage2": ["parallel.dp=4", "zero.stage=2"],
    "dp4_stage3": ["parallel.dp=4", "zero.stage=3"],
    "tp2_sp_dp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2", "zero.stage=1"],
    "pp2_1f1b_dp2": ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.dp=2", "zero.stage=2"],
    "pp2_interleaved_tp2": ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                            "parallel.tp=2", "zero.stage=1"],
    "pp2_ckpt1_dp2_stage3": ["parallel.pp=2", "parallel.dp=2", "model.activation_checkpointing=true",
                             "model.checkpoint_layers=1", "zero.stage=3"],  # partial: 1 of each stage's 2
    "tp2_sp_ckpt_dropout": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2",
                            "model.activation_checkpointing=true", "model.dropout=0.1", "zero.stage=2"],
    "dp4_offload": ["parallel.dp=4", "zero.stage=2", "zero.offload_optimizer=cpu"],
    # Llama: 2 k/v heads on 4 tp ranks (each replicated twice), the untied head, SwiGLU
    "llama_tp4_sp": ["model.arch=llama", "model.kv_heads=2", "parallel.tp=4", "parallel.sequence_parallel=true",
                     "zero.stage=1"],
}


def _config(overrides: list[str], world: int):
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve

    return resolve(load_config(None, SMALL + overrides), world, "cpu")


def _measure_real(rank: int, world: int, layouts: dict) -> dict:
    """Each layout on real gloo ranks and real tensors, measured as the simulator measures."""
    import torch

    from megazero.plan.tracker import MemoryTracker
    from megazero.plan.simulate import measure
    from megazero.parallel.topology import Grid
    from megazero.parallel.dims import ParallelDims

    out = {}
    for name, overrides in layouts.items():
        cfg = _config(overrides, world)
        p = cfg.parallel
        grid = Grid.build(ParallelDims(tp=p.tp, pp=p.pp, dp=p.dp), "cpu")
        tracker = MemoryTracker()
        measure(cfg, grid, torch.device("cpu"), tracker)
        r = tracker.report()
        out[name] = (grid.pp_rank, r.peak_bytes, r.bytes, r.host_peak_bytes)
    return out


def _simulate(overrides: list[str], world: int, rank: int):
    from megazero.plan.stage_plan import make_plan
    from megazero.plan.simulate import simulate_rank

    cfg = _config(overrides, world)
    return simulate_rank(cfg, rank, make_plan(cfg))


def test_real_runs_agree_with_the_simulation():
    """Every rank's measured peak is within 5% of its stage's simulated peak (the issue's bound). The code path
    is the same; what differs is how long gloo keeps a reduction's buffer: its Work holds the input until
    the Work is destroyed (by gloo's worker thread, a moment after wait() returns) and the fake group's at
    once, so a real run may hold a bucket or two more. At seq 32 that measured up to 5.7% of this small
    model's peak; at seq 128 (activations 4x, the buckets unchanged) at most 1.0% over several runs."""
    from megazero.plan.simulate import rank_classes

    real = run_ranks(4, _measure_real, LAYOUTS, timeout=600)
    failures = []
    for name, overrides in LAYOUTS.items():
        classes = rank_classes(_config(overrides, 4))
        simulated = {}
        for rank in classes:
            r = _simulate(overrides, 4, rank)
            simulated[r.pp_rank] = r
        for rank, measured in enumerate(real):
            pp_rank, peak, by_kind, host = measured[name]
            sim = simulated[pp_rank]
            if abs(peak - sim.peak_bytes) > 0.05 * sim.peak_bytes or abs(host - sim.host_bytes) > 0.05 * max(
                    sim.host_bytes, 1):
                failures.append(f"{name} rank {rank}: real {peak} {by_kind} host {host}; simulated "
                                f"{sim.peak_bytes} {sim.bytes} host {sim.host_bytes}")
    assert not failures, "\n".join(failures)
    # the offloaded layout keeps its optimizer states on the host, the others keep none there
    assert real[0]["dp4_offload"][3] > 0 and real[0]["dp4_stage2"][3] == 0


def test_single_process_run_agrees_with_the_simulation():
    """World 1 without any process group (the plain `python pretrain.py` run) against its simulation."""
    import torch

    from megazero.plan.tracker import MemoryTracker
    from megazero.plan.simulate import measure
    from megazero.parallel.topology import Grid

    cfg = _config(["parallel.dp=1"], 1)
    tracker = MemoryTracker()
    measure(cfg, Grid.single(), torch.device("cpu"), tracker)
    sim = _simulate(["parallel.dp=1"], 1, 0)
    assert abs(tracker.report().peak_bytes - sim.peak_bytes) <= 0.05 * sim.peak_bytes, (tracker.report(), sim)


def test_stage2_gradient_memory_does_not_grow_with_microbatches():
    """At m = 32 ZeRO-2 holds the gradients of m = 1: the shard plus a bounded number of bucket reductions in
    flight (exactly the same bytes). The peak may grow only by the step's token ids, which the data loader
    hands over for the whole step (m x micro_batch x (seq + 1) int64s)."""
    sets = ["parallel.dp=4", "zero.stage=2", "train.micro_batch=1", "model.layers=1"]
    one = _simulate(sets + ["train.global_batch=4"], 4, 0)
    many = _simulate(sets + ["train.global_batch=128"], 4, 0)  # m = 32: a buffer kept per microbatch shows 32 times
    assert many.bytes["grads"] == one.bytes["grads"], (one.bytes, many.bytes)
    assert many.peak_bytes - one.peak_bytes <= 32 * 1 * (128 + 1) * 8, (one.peak_bytes, many.peak_bytes)  # seq 128


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_match_the_zero_formulas(stage):
    """(2+2+K)Ψ, (2+2+K/N)Ψ, (2+(2+K)/N)Ψ and (2+2+K)Ψ/N in megazero's dtypes (bf16 parameters, fp32
    gradients, K = 12) for the stage's own Ψ, within one bucket of padding per buffer (each is padded to a
    multiple of dp)."""
    from megazero.plan.stage_plan import make_plan
    from megazero.plan.state_bytes import model_state_bytes

    sets = ["parallel.dp=4", f"zero.stage={stage}"]
    cfg = _config(sets, 4)
    psi = make_plan(cfg).stages[0].params
    want = model_state_bytes(psi, stage, 4, "bf16")
    got = _simulate(sets, 4, 0).state_bytes
    buckets = -(-psi * 4 // int(cfg.zero.bucket_mb * 2 ** 20)) + 1  # buckets are cut in fp32 gradient bytes
    slack = buckets * 4 * 12  # per bucket at most dp-1 padding elements, in the widest state (fp32 master+moments)
    for kind in ("params", "grads", "optimizer"):
        assert abs(got[kind] - want[kind]) <= slack, (kind, got, want, slack)
    assert got["host"] == 0


@pytest.mark.parametrize("dropout, checkpointing, per_sbh_t", [
    (0.1, False, 34),  # Korthikanti et al. 2022, Table 2 with sequence parallelism, flash attention (no 5as/h)
    (0.0, False, 32),  # less the two sbh dropout masks (attention output, MLP output)
    (0.1, True, 2),  # full recomputation: the layer's input only
])
def test_layer_activations_match_korthikanti(dropout, checkpointing, per_sbh_t):
    """bf16, tp = 4 with sequence parallelism: within 10% of the paper's per-layer bytes (the issue's bound;
    measured 36, 32 and 2 sbh/t: the CPU's dropout keeps a 16-bit noise tensor where CUDA keeps a bool mask,
    2 x sbh/t more)."""
    from megazero.plan.simulate import layer_activation_bytes

    s, b, h, t = 256, 2, 512, 4
    cfg = _config([f"model.seq_len={s}", f"train.micro_batch={b}", f"model.hidden={h}", "model.heads=8",
                   f"parallel.tp={t}", "parallel.sequence_parallel=true", f"model.dropout={dropout}",
                   f"model.activation_checkpointing={str(checkpointing).lower()}", "train.global_batch=8"], 4)
    got = layer_activation_bytes(cfg)
    want = per_sbh_t * s * b * h / t
    assert abs(got - want) <= 0.10 * want, (got / (s * b * h / t), per_sbh_t)


def test_llama_layer_activations_match_the_plan():
    """A Llama layer (GQA with k/v a quarter of q, SwiGLU at ffn 3.5h, RMSNorm) at tp 4 with sequence
    parallelism, no dropout: within 1% of megazero.plan.activations' count (measured 11.02 against 11.00 sbh·/t here: the
    plan's two dropout masks, absent at dropout 0, about offset the per-token 1/rms and the attention's
    log-sum-exp it leaves out; a count of storages on fake tensors, deterministic). 1% separates the count from
    its likely slips: k/v counted as split over all 4 ranks rather than replicated on 2 (2.3% lower) or a 4h
    MLP (9% higher)."""
    from megazero.plan.activations import activation_bytes_per_layer
    from megazero.plan.simulate import layer_activation_bytes

    s, b, h, t = 256, 2, 512, 4
    cfg = _config([f"model.seq_len={s}", f"train.micro_batch={b}", f"model.hidden={h}", "model.heads=8",
                   "model.kv_heads=2", "model.ffn_hidden=1792", "model.arch=llama", f"parallel.tp={t}",
                   "parallel.sequence_parallel=true", "train.global_batch=8"], 4)
    got = layer_activation_bytes(cfg)
    want = activation_bytes_per_layer(s, b, h, 8, t, True, ffn=1792, kv_heads=2, swiglu=True)
    assert abs(got - want) <= 0.01 * want, (got / (s * b * h), want / (s * b * h))


def _cli(tmp_path, *sets: str, capsys=None):
    """``pretrain.py --simulate``'s exit code, stdout and stderr: as a process, or (``capsys``) its main called in
    this one, which saves an interpreter's start where the process itself is not what is checked."""
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--simulate", "--set", f"log.dir={tmp_path}"] + [
        a for s in sets for a in ("--set", s)]
    if capsys is not None:
        from tests.hostile import call, pretrain_main

        code, out, err = call(pretrain_main, args, capsys)
        return subprocess.CompletedProcess(args, code, out, err)
    return subprocess.run([sys.executable, str(ROOT / "pretrain.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_cli_reports_each_stage_writes_json_and_exits_3_when_it_does_not_fit(tmp_path, capsys):
    ok = _cli(tmp_path, "parallel.world_size=8", "launch.memory_gb=80")  # the command itself, as a user runs it
    assert ok.returncode == 0, ok.stderr
    assert "rank 0 (pipeline stage 0)" in ok.stdout and "rank 4 (pipeline stage 1)" in ok.stdout
    assert "peak at step" in ok.stdout and "microbatches in flight" in ok.stdout
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 4] and [r["pp_rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        assert set(r) >= {"rank", "pp_rank", "peak_bytes", "bytes", "comm_bytes", "plan_bytes"}
        assert r["peak_bytes"] == sum(r["bytes"].values()) > 0
        assert r["comm_bytes"]["tp"] > 0 and r["comm_bytes"]["pp"] > 0 and r["comm_bytes"]["dp"] > 0
    tight = _cli(tmp_path, "parallel.world_size=8", "launch.memory_gb=0.001", "launch.rank=4", capsys=capsys)
    assert tight.returncode == 3, tight.stderr
    assert "DOES NOT FIT" in tight.stdout and "rank 4 (pipeline stage 1)" in tight.stdout
    assert "rank 0 " not in tight.stdout
    bad = _cli(tmp_path, "parallel.world_size=8", "launch.rank=8", capsys=capsys)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "launch.rank=8" in bad.stderr and "0 to 7" in bad.stderr
    (tmp_path / "simulate.json").unlink()  # a link there is refused before anything runs; its target untouched
    (tmp_path / "simulate.json").symlink_to(tmp_path / "elsewhere.json")
    linked = _cli(tmp_path, "parallel.world_size=8", capsys=capsys)
    assert linked.returncode == 2 and "simulate.json" in linked.stderr and not (tmp_path / "elsewhere.json").exists()


def test_offloaded_optimizer_states_are_host_memory_not_device_peak():
    """With zero.offload_optimizer=cpu the masters and moments are host memory: none in the device peak, all in
    host_bytes (the optimizer's device bytes of the same run without offload, exactly: same buckets)."""
    sets = ["parallel.dp=4", "zero.stage=2", "zero.bucket_mb=0.1", "model.hidden=256", "model.seq_len=8",
            "train.micro_batch=1", "train.global_batch=4"]  # states large beside the step's activations
    on = _simulate(sets, 4, 0)
    off = _simulate(sets + ["zero.offload_optimizer=cpu"], 4, 0)
    assert off.bytes["optimizer"] == 0 and off.host_bytes == on.bytes["optimizer"] > 0, (on.bytes, off)
    assert off.peak_bytes <= on.peak_bytes - on.bytes["optimizer"], (on.peak_bytes, off.peak_bytes, off.moment)
