"""The --dry-run planner: ZeRO and activation formulas against hand-computed values, meta-built
parameter counts against the closed-form count, and the CLI on the 13B config."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.costs import model_flops_per_token
from megazero.plan.activations import activation_bytes_per_layer, activation_peak, peak_microbatches, pipeline_bubble
from megazero.plan.stage_plan import make_plan
from megazero.plan.state_bytes import model_state_bytes
from megazero.models.build import count_parameters
from megazero.parallel.schedule_analysis import simulate
from megazero.parallel.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[2]
GPT13B = ROOT / "configs" / "gpt13b.yaml"


# --- ZeRO model state (Rajbhandari et al. SC'20, Figure 1) ---------------------------------------


@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_model_state_matches_zero_paper_figure_1(stage, paper_gb):
    psi, nd, k = 7_500_000_000, 64, 12  # Figure 1: Ψ = 7.5B, N_d = 64, mixed-precision Adam K = 12
    expected = {  # (2 + 2 + K)Ψ family: fp16 params, fp16 grads, K bytes of optimizer state
        0: 2 * psi + 2 * psi + k * psi,
        1: 2 * psi + 2 * psi + k * psi // nd,
        2: 2 * psi + (2 + k) * psi // nd,
        3: (2 + 2 + k) * psi // nd,
    }[stage]
    got = model_state_bytes(psi, stage, nd, "fp16")  # the paper's fp16 gradients (bf16: grad_dtype=model)
    assert got == model_state_bytes(psi, stage, nd, "bf16", grad_dtype="model")
    assert got["device_total"] == expected and got["cpu_total"] == 0
    assert got["params"] + got["grads"] + got["optimizer"] == expected
    assert round(got["device_total"] / 1e9, 1) == paper_gb


def test_bf16_gradients_are_fp32_by_default():
    """Megatron-LM's bf16 accounting: 2 B params + 4 B fp32 gradients + 12 B optimizer = 18 B per parameter,
    with the gradients partitioned from stage 2 on."""
    psi, dp = 1200, 4
    assert model_state_bytes(psi, 0, dp, "bf16")["device_total"] == 18 * psi
    assert model_state_bytes(psi, 2, dp, "bf16")["grads"] == 4 * psi // dp
    assert model_state_bytes(psi, 0, dp, "bf16", grad_dtype="model")["grads"] == 2 * psi
    assert model_state_bytes(psi, 0, dp, "fp16")["grads"] == 2 * psi  # fp16 stays fp16 unless asked
    assert model_state_bytes(psi, 0, dp, "fp16", grad_dtype="fp32")["grads"] == 4 * psi


def test_model_state_kinds_per_stage_fp32_and_padding():
    psi, dp = 1000, 8
    # fp32: 4 B params, 4 B grads, 8 B Adam moments, no master copy
    assert model_state_bytes(psi, 0, dp, "fp32") == {
        "params": 4000, "grads": 4000, "optimizer": 8000, "device_total": 16000, "cpu_total": 0, "nvme_total": 0}
    assert model_state_bytes(psi, 1, dp, "fp32")["optimizer"] == 1000
    assert model_state_bytes(psi, 2, dp, "fp32")["grads"] == 500
    assert model_state_bytes(psi, 3, dp, "fp32")["params"] == 500
    assert model_state_bytes(psi, 2, dp, "fp32")["params"] == 4000
    # 10 parameters over 3 ranks: each shard is padded to 4 elements
    assert model_state_bytes(10, 3, 3, "fp16") == {
        "params": 8, "grads": 8, "optimizer": 48, "device_total": 64, "cpu_total": 0, "nvme_total": 0}


def test_model_state_offload_moves_bytes_to_cpu():
    psi, dp = 1200, 4  # bf16: 2 B, K = 12
    opt = model_state_bytes(psi, 2, dp, "bf16", offload_optimizer="cpu")
    assert opt["cpu_total"] == 12 * 300 + 4 * 300 and opt["device_total"] == 2 * 1200 + 4 * 300  # fp32 grad shard
    both = model_state_bytes(psi, 3, dp, "bf16", offload_optimizer="cpu", offload_params="cpu")
    assert both["device_total"] == 4 * 300 and both["cpu_total"] == 12 * 300 + 4 * 300 + 2 * 300
    with pytest.raises(ValueError):
        model_state_bytes(psi, 2, dp, "bf16", offload_params="cpu")
    # on a disk: the states there, the host holds the buffers that stream them and the gradients' landing buffer
    disk = model_state_bytes(psi, 2, dp, "bf16", offload_optimizer="nvme", nvme_buffer_bytes=2000)
    assert disk["nvme_total"] == 12 * 300 and disk["cpu_total"] == 2000 + 4 * 300
    assert disk["device_total"] == opt["device_total"]
    # buffers larger than the states are cut to the states' size (parallel.zero.nvme_adamw)
    assert model_state_bytes(psi, 2, dp, "bf16", offload_optimizer="nvme",
                             nvme_buffer_bytes=5000)["cpu_total"] == 12 * 300 + 4 * 300


# --- activations (Korthikanti et al. 2022, §4) ---------------------------------------------------


def test_activation_formula_hand_values():
    s, b, h, a, t = 2048, 1, 5120, 40, 4
    sbh = s * b * h  # 10,485,760
    scores = 5 * a * s // (h * t)  # 5as/(ht) = 20
    # paper's formulas, with materialised scores (flash=False)
    assert activation_bytes_per_layer(s, b, h, a, 1, flash=False) == sbh * (34 + 5 * a * s // h)
    assert activation_bytes_per_layer(s, b, h, a, t, flash=False) == sbh * (10 + 6 + scores) == 377_487_360
    assert activation_bytes_per_layer(s, b, h, a, t, True, flash=False) == sbh * 34 // 4 + sbh * scores
    # flash attention: no s x s term
    assert activation_bytes_per_layer(s, b, h, a, t) == 16 * sbh == 167_772_160
    assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True) == 89_128_960  # 8.5 sbh
    # full recomputation: only the layer input, 2sbh (split over t with sequence parallelism)
    assert activation_bytes_per_layer(s, b, h, a, t, recompute=True) == 2 * sbh == 20_971_520
    assert activation_bytes_per_layer(s, b, h, a, t, True, recompute=True) == 2 * sbh // t
    # fp32 activations are twice the 16-bit figure
    assert activation_bytes_per_layer(s, b, h, a, t, precision="fp32") == 32 * sbh


def test_sequence_parallel_divides_the_replicated_part_by_t():
    s, b, h, a = 512, 2, 1024, 16
    for t in (1, 2, 4, 8):
        tp_only = activation_bytes_per_layer(s, b, h, a, t, False, flash=False)
        tp_sp = activation_bytes_per_layer(s, b, h, a, t, True, flash=False)
        scores = 5 * a * s * s * b / t  # the same in both: heads are split over t
        assert tp_only - scores == pytest.approx(s * b * h * (10 + 24 / t))
        assert tp_sp - scores == pytest.approx(s * b * h * 34 / t)  # the 10sbh left over is split too
        assert tp_sp <= tp_only and (t > 1) == (tp_sp < tp_only)


@pytest.mark.parametrize("name, pp, m, v", [("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("gpipe", 3, 5, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3), ("zb1p", 4, 8, 1),
                                            ("zb1p", 8, 16, 1), ("zb1p", 4, 2, 1)])
def test_microbatches_in_flight_match_the_schedule(name, pp, m, v):
    sched = build_schedule(name, pp, m, v)
    peaks = simulate(sched, pp)["peak_in_flight"]
    for r in range(pp):
        _, count = activation_peak(sched[r], [1] * v)
        assert count == peaks[r]
        if name == "1f1b":
            assert count == min(pp - r, m)
        if name == "gpipe":
            assert count == m
        if name == "zb1p":  # held from F to W: the deferred weight gradients keep later ranks' microbatches
            assert count == min(pp, m)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb1p", 1), ("interleaved", 2), ("interleaved", 3)])
def test_the_shortened_schedule_has_every_rank_s_activation_peak(name, v):
    """The plan walks the schedule of peak_microbatches(m) microbatches for m's activation peak: the same on
    every rank, for chunks of unequal sizes (the head's logits on the last), from where it first shortens to
    three steady-state periods past it, and far beyond."""
    per = [7, 11, 13][:v]
    for pp in range(2 if name == "interleaved" else 1, 7):
        step = pp if name == "interleaved" else 1
        shortest = peak_microbatches(name, pp, 10 ** 9, v)
        assert shortest % step == 0 and shortest != (pp if name == "interleaved" else -1)
        short = build_schedule(name, pp, shortest, v)
        for m in list(range(shortest + step, shortest + 3 * pp * v + step, step)) + [shortest * 25]:
            assert peak_microbatches(name, pp, m, v) == shortest
            full = build_schedule(name, pp, m, v)
            assert [activation_peak(a, per) for a in full] == [activation_peak(a, per) for a in short], (pp, m)
    assert peak_microbatches("gpipe", 4, 1000) == 1000  # GPipe holds every microbatch: nothing shortens it
    assert peak_microbatches("1f1b", 4, 3) == 3


def test_pipeline_bubble():
    assert pipeline_bubble("1f1b", 2, 128) == pytest.approx(1 / 129)
    assert pipeline_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert pipeline_bubble("1f1b", 1, 8) == 0
    for pp, m in ((2, 4), (4, 8), (8, 8)):  # zb1p: the simulated idle share with equal F, B and W costs
        sim = simulate(build_schedule("zb1p", pp, m), pp, 1.0, 1.0, 1.0)
        assert pipeline_bubble("zb1p", pp, m) == pytest.approx(max(sim["idle_fraction"]))


# --- parameters per stage, built on meta ---------------------------------------------------------


def small_cfg(tp: int, pp: int, v: int, sp: bool = False):
    sets = ["model.layers=8", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab_size=500",
            f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.virtual_stages={v}", "parallel.dp=2",
            f"parallel.schedule={'interleaved' if v > 1 else '1f1b'}", f"parallel.sequence_parallel={sp}",
            "train.global_batch=32", "train.micro_batch=2"]
    return resolve(load_config(None, sets), tp * pp * 2, "cuda", planned=True)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_stage_parameters_sum_to_the_model(tp, pp, v):
    cfg = small_cfg(tp, pp, v, sp=tp > 1)
    plan = make_plan(cfg)
    m = cfg.model
    # unique parameters: tp shards add up over the tp ranks, replicated ones count once
    unique = sum(tp * (s.params - s.replicated) + s.replicated for s in plan.stages)
    tied_copy = m.padded_vocab * m.hidden if pp * v > 1 else 0
    assert unique - tied_copy == count_parameters(m) == plan.total_params
    assert len(plan.stages) == pp and all(len(s.ranks) == tp * 2 for s in plan.stages)
    assert sorted(r for s in plan.stages for r in s.ranks) == list(range(tp * pp * 2))


def test_stage_parameters_by_hand():
    cfg = small_cfg(1, 2, 1)
    h, V, s = 64, 512, 32
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)  # 12h² + 13h
    first, last = make_plan(cfg).stages
    assert first.params == V * h + s * h + 4 * block
    assert last.params == 4 * block + 2 * h + V * h  # final norm and the tied embedding copy


def test_stage_flops_add_up_to_the_model():
    cfg = small_cfg(2, 4, 2)
    plan = make_plan(cfg)
    total = model_flops_per_token(cfg.model) * cfg.train.global_batch * cfg.model.seq_len
    assert plan.flops_per_step == pytest.approx(total)
    assert sum(s.flops for s in plan.stages) * 2 * 2 == pytest.approx(total)  # x tp x dp ranks per stage


# --- the CLI ---------------------------------------------------------------------------------------


def dry_run_cli(*sets: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, str(ROOT / "pretrain.py"), "--config", str(GPT13B), "--dry-run"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc, time.perf_counter() - t0


@pytest.fixture(scope="module")
def gpt13b_64():
    """(process, seconds) of the 40-layer gpt13b dry run at 64 ranks, then of the same at 10^9 layers, back to
    back (a machine's load changes slowly against a few seconds): the tests that read them share them."""
    return dry_run_cli("parallel.world_size=64"), dry_run_cli("parallel.world_size=64", "model.layers=1000000000")


def test_cli_dry_run_gpt13b_on_64_ranks(gpt13b_64):
    proc, seconds = gpt13b_64[0]
    assert proc.returncode == 0, proc.stderr
    assert seconds < 30
    out = proc.stdout
    assert "world 64 = tp 4 x pp 2 x dp 8" in out and "zero stage 0" in out and "bf16" in out
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^\d+\s+\d+-\d+\s", ln)]
    assert [r[0] for r in rows] == ["0", "1"]  # one row per pipeline stage
    assert rows[0][2] == "0-31" and rows[1][2] == "32-63"
    for r in rows:  # stage, layers, ranks, "(8 dp x 4 tp)", params/rank, params, grads, optimizer, device
        psi = int(r[8].replace(",", ""))  # ZeRO stage 0, bf16: 2 + 4 (fp32 grads) + 12 bytes per parameter held
        assert float(r[9]) == pytest.approx(2 * psi / 1e9, abs=0.006)
        assert float(r[10]) == pytest.approx(4 * psi / 1e9, abs=0.006)
        assert float(r[12]) == pytest.approx(18 * psi / 1e9, abs=0.006)
    total = int(re.search(r"parameters \(whole model\)\s+([\d,]+)", out).group(1).replace(",", ""))
    assert 12.8e9 <= total <= 13.2e9
    assert out.strip().splitlines()[-1] == "dry run: nothing was allocated; no process group was started"


def test_cli_dry_run_world_size_mismatch_is_one_line():
    proc, _ = dry_run_cli("parallel.world_size=60")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "world size 60" in lines[0] and lines[0].startswith("error:")


def test_dry_run_in_process_starts_nothing_and_reads_no_data(monkeypatch, capsys):
    import torch.distributed as dist

    from megazero.train.run import dry_run

    for name in [n for n in sys.modules if n == "megazero.data" or n.startswith("megazero.data.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "megazero.data", None)  # any import of the data package now fails

    def refuse(*args, **kwargs):
        raise AssertionError("init_process_group called by a dry run")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    plan = dry_run(str(GPT13B), ["parallel.dp=auto", "parallel.world_size=128"])
    assert plan.cfg.parallel.dp == 16 and plan.world_size == 128 and plan.microbatches == 64
    assert not dist.is_initialized()
    assert "world 128 = tp 4 x pp 2 x dp 16" in capsys.readouterr().out


def test_stage3_plan_counts_the_gathered_parameters():
    """ZeRO-3 holds whole parameters during a step: the root (embeddings, final norm) and two layers when
    layers are freed after forward (pp = 1's default), the whole stage when they are kept (pp > 1's default)."""
    from megazero.plan.params import chunk_parameters

    sets = ["zero.stage=3", "train.precision=bf16", "model.layers=8", "parallel.tp=1",
            "train.global_batch=8", "train.micro_batch=1", "parallel.sequence_parallel=false"]
    tiny = ROOT / "configs" / "tiny.yaml"

    def stage0(extra, world):
        cfg = load_config(tiny, sets + extra)
        resolve(cfg, world, "cuda", planned=True)
        return cfg, make_plan(cfg).stages[0]

    one_cfg, one = stage0(["parallel.pp=1"], 2)
    two_cfg, two = stage0(["parallel.pp=2"], 4)
    assert one_cfg.zero.reshard_after_forward is True and two_cfg.zero.reshard_after_forward is False
    assert two.gathered == two.params * 2  # the whole stage, bf16
    root = chunk_parameters(one_cfg, range(0), True, True)[0]
    assert one.gathered == (root + 2 * (one.params - root) // 8) * 2 < one.params * 2
    _, kept = stage0(["parallel.pp=1", "zero.reshard_after_forward=false"], 2)
    assert kept.gathered == kept.params * 2
    _, stage2 = stage0(["parallel.pp=1", "zero.stage=2"], 2)
    assert stage2.gathered == 0


def test_dry_run_of_a_billion_layers_answers_in_seconds(gpt13b_64):
    """Planning builds one layer of each kind on meta and multiplies, so 10^9 layers plan like 40 (a stage's
    parameters are the ends plus n times one layer: checked against building the chunk whole below)."""
    (forty, forty_seconds), (proc, seconds) = gpt13b_64
    assert proc.returncode == 0, proc.stderr
    assert forty.returncode == 0, forty.stderr
    # most of either is starting Python and importing torch (1.5-4 s by machine): a plan linear in the layers
    # would take hours at 10^9, so 1.5x (and 1 s) of the 40-layer plan's time is room for a busy machine only
    assert seconds < 1.5 * forty_seconds + 1.0, (seconds, forty_seconds)
    assert "0-499999999" in proc.stdout and "500000000-999999999" in proc.stdout


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (6, False)])
def test_chunk_parameters_multiply_one_layer_exactly(tp, sp):
    from megazero.plan.params import ParamCounts, _built_parameters, chunk_parameters

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}", "model.vocab_pad_multiple=384",
                                                       "model.layers=6"])
    for layers, first, last in ((range(0, 3), True, False), (range(3, 6), False, True), (range(0, 6), True, True),
                                (range(2, 4), False, False)):
        assert chunk_parameters(cfg, layers, first, last) == _built_parameters(cfg, layers, first, last)[:2]
        assert ParamCounts.of(cfg).chunk_counts(layers, first, last) == _built_parameters(cfg, layers, first, last)


@pytest.mark.parametrize("moe", [["model.moe.experts=4"], ["model.moe.experts=8", "model.moe.dense_layers=2"],
                                 ["model.moe.experts=4", "model.moe.every=2", "model.moe.shared_experts=1"],
                                 ["model.moe.experts=4", "model.moe.dense_layers=1", "model.moe.every=3"]])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (1, 4)])
def test_mixture_of_experts_chunks_count_each_layer_kind_exactly(moe, tp, ep):
    """Dense and mixture-of-experts layers mixed in any pattern: a chunk is its ends plus each kind's layers
    times one of that kind, on one tp and ep rank (E/ep experts), the experts' parameters apart."""
    from megazero.plan.params import ParamCounts, _built_parameters

    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml", moe + [f"parallel.tp={tp}", f"parallel.ep={ep}",
                                                                    "parallel.pp=1", "model.layers=7",
                                                                    "model.moe.expert_hidden=64"])
    counts = ParamCounts.of(cfg)
    for layers, first, last in ((range(0, 3), True, False), (range(3, 7), False, True), (range(0, 7), True, True),
                                (range(1, 6), False, False), (range(2, 3), False, False)):
        assert counts.chunk_counts(layers, first, last) == _built_parameters(cfg, layers, first, last), layers
    experts = _built_parameters(cfg, range(0, 7), True, True)[2]  # E/ep experts of three 64 x 192 matrices a layer
    assert experts == cfg.model.moe.experts // ep * 3 * 64 * 192 * sum(cfg.model.moe.is_moe_layer(i) for i in range(7))


def test_partial_checkpointing_plans_between_none_and_all():
    """model.checkpoint_layers=k: k layers per chunk keep only their input, the rest their full activations."""
    from megazero.plan.activations import activation_bytes_per_layer

    sets = ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false", "model.layers=4",
            "model.activation_checkpointing=true", "train.global_batch=2", "train.micro_batch=2"]
    tiny = ROOT / "configs" / "tiny.yaml"
    stage = {}
    for k in (0, 1, 4):
        cfg = load_config(tiny, sets + [f"model.checkpoint_layers={k}"])
        resolve(cfg, 1, "cuda", planned=True)
        stage[k] = make_plan(cfg).stages[0]
    m, t = cfg.model, cfg.train

    def layer(recompute):
        return activation_bytes_per_layer(m.seq_len, t.micro_batch, m.hidden, m.heads, 1, False, recompute,
                                          flash=True, precision=t.precision)

    assert stage[0].act_ckpt == stage[4].act_ckpt  # k >= the chunk's layers is all of them
    # 3 layers keep their full activations instead of their input, and no layer is recomputed while they are
    # held (they are freed first in backward), so the one-layer recompute term of full checkpointing goes
    assert stage[1].act_ckpt - stage[0].act_ckpt == 3 * (layer(False) - layer(True)) - layer(False)
    assert stage[0].act_ckpt < stage[1].act_ckpt < stage[1].act_full
