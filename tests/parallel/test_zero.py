"""ZeRO stages 0-3 against dp=1: loss curves, model-state bytes, communication volume, fp16 overflow, offload.

fp32 curves: a ZeRO run sums the same per-microbatch gradients in another
order (bucketed all-reduce or reduce-scatter), so losses agree to ~1e-6;
1e-5 relative is the DESIGN's bound. bf16 curves: parameters and each
microbatch's gradients round to 8 mantissa bits (2^-9 ~ 2e-3 relative per
rounding), and the dp reduction (fp32) sums them in another order, so runs
agree to ~1e-2; we allow 2e-2 relative on the loss.
"""
from __future__ import annotations

import math

import pytest
import torch

from megazero.plan import stage_plan as plan
from megazero.plan.state_bytes import model_state_bytes
from megazero.config.load import load_config
from megazero.config.resolve import resolve
from megazero.train.run import run
from megazero.engine.build import make_scaler
from megazero.engine.step import forward_backward, train_step
from megazero.parallel.topology import Grid
from megazero.parallel.dims import ParallelDims
from tests.dist import run_ranks, start_ranks
from tests.parallel.test_topology import _mesh_groups
from tests.runs import NO_FINAL_SAVE, ROOT, engine_for, executor_for, read_metrics, small_overrides, write_corpus

TINY = str(ROOT / "configs" / "tiny.yaml")
STEPS = 6  # fp32: a wrong sum shows from step 2 on, at 1e-5
BF16_STEPS = 10  # bf16 must also learn (test_bf16_curve_follows_dp1): 10 steps fall by over 0.3
HALF = STEPS // 2  # the resumed runs continue from this step's checkpoint
SAVE_HALF = [f"train.save_every={HALF}"]  # keep_last 2 keeps it next to the final one
BF16 = ["train.precision=bf16", f"train.steps={BF16_STEPS}"]


def _over(text, cache, log_dir, extra=(), steps=STEPS, **values):
    return small_overrides(text, cache, log_dir, steps=steps, **{**NO_FINAL_SAVE, **values}) + list(extra)


DP2 = [(f"dp2_z{s}", [f"zero.stage={s}"] + (SAVE_HALF if s == 2 else [])) for s in range(4)] + \
      [("dp2_z1_offload", ["zero.stage=1", "zero.offload_optimizer=cpu"]),
       ("dp2_z3_offload", ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu"]),
       ("dp2_z3_keep", ["zero.stage=3", "zero.reshard_after_forward=false"]),
       ("dp2_z3_ckpt", ["zero.stage=3", "model.activation_checkpointing=true"]),
       ("dp2_z3_ckpt1", ["zero.stage=3", "model.activation_checkpointing=true", "model.checkpoint_layers=1"]),
       ("dp2_z1_bf16", ["zero.stage=1", *BF16]),
       ("dp2_z3_bf16", ["zero.stage=3", *BF16])]
DP4 = [(f"dp4_z{s}", [f"zero.stage={s}", "train.micro_batch=1"]) for s in range(4)]
# stage 0 at tp2 x pp2 x dp2 (1f1b, sequence parallel) is test_pipeline.py's tp2_pp2_dp2_1f1b_sp
EIGHT = [(f"tp2_pp2_dp2_z{s}", [f"zero.stage={s}", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
          + (SAVE_HALF if s == 3 else [])) for s in (1, 2, 3)]
# Checkpoints are layout-free: a run resumed from another layout's step-HALF checkpoint continues its curve
# (the checkpoints are the ones those runs save on their way to STEPS; no run of its own stops there).
# name: (the run that saved it, the resumed run's settings)
RESUMED = {"dp1_then_dp2_z3": ("dp1", ["zero.stage=3"]),  # a dp=1 stage-0 checkpoint at dp=2 under stage 3
           # and back: a dp=2 stage-2 checkpoint (each rank wrote the half it owns) at dp=1
           "dp2_z2_then_dp1": ("dp2_z2", ["zero.stage=0"]),
           # a tp2 x pp2 x dp2 stage-3 checkpoint (sequence parallel) at one process
           "tp2_pp2_dp2_z3_then_dp1": ("tp2_pp2_dp2_z3", ["zero.stage=0"])}


def _resumed(base, name):
    """(name, settings) of a resumed run: RESUMED's settings and the checkpoint it starts from."""
    saved_by, extra = RESUMED[name]
    return name, extra + [f"train.resume={base / saved_by / 'checkpoints' / f'step_{HALF:08d}'}"]


def _train(rank, world, text, cache, base, layouts):
    for name, extra in layouts:
        run(TINY, _over(text, cache, base / name, extra))
    return True


def _train_dp2(rank, world, text, cache, base, layouts):
    """The dp=2 layouts, then the fp16 overflow check: one spawn of two ranks (each costs ~2 s of imports)."""
    _train(rank, world, text, cache, base, layouts)
    return _overflow(rank, world, text, cache, base)


def _train_eight(rank, world, text, cache, base, layouts):
    """The tp2 x pp2 x dp2 layouts, after the device mesh's groups are checked (test_topology.py's
    _mesh_groups): one spawn of eight ranks."""
    groups = _mesh_groups(rank, world, 2, 2, 2)
    _train(rank, world, text, cache, base, layouts)
    return groups


def _train_dp4(rank, world, text, cache, base, layouts):
    """The dp=4 layouts, then the dp=4 measurements: one spawn of four ranks."""
    _train(rank, world, text, cache, base, layouts)
    return _measurements(rank, world, text, cache, base)


def _engine(text, cache, base, world, extra, **values):
    """(cfg, grid, data, engine) of a one-step run of these settings."""
    cfg = load_config(TINY, _over(text, cache, base / "probe", extra, steps=1, **values))
    resolve(cfg, world, "cpu")
    grid = Grid.build(ParallelDims(tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=cfg.parallel.dp), "cpu")
    return (cfg, grid, *engine_for(cfg, grid, is_builder=grid.rank == 0))


def _one_step(engine, data, cfg, grid):
    """The trainer's step (megazero.engine.step.train_step) on the first global batch; returns its result."""
    mbs = data.train_microbatches(0, grid.dp_rank, grid.dp, cfg.train.micro_batch, cfg.train.global_batch)
    return train_step(engine.zero, engine.executor, engine.schedule, mbs, 1e-3, 1.0, engine.scaler)


def _measurements(rank, world, text, cache, base):
    """At dp=4: model-state bytes against the formula and the dry-run plan; comm volume; stage-3 peak."""
    out = {}
    bigger = {"model.layers": 6}
    for stage in range(4):
        cfg, grid, data, tr = _engine(text, cache, base, world, [f"zero.stage={stage}", "train.precision=bf16",
                                                            "train.micro_batch=2", "train.global_batch=8"],
                                 **bigger)
        psi = sum(p.numel() for _, p in tr.named_params)
        measured = tr.zero.model_state_bytes()
        formula = model_state_bytes(psi, stage, grid.dp, "bf16")
        planned = plan.make_plan(cfg).stages[0].model_state
        grid.counter.reset()
        _one_step(tr, data, cfg, grid)  # m = 1 microbatch per rank
        wire = grid.counter.wire(group="dp", tag="grad") + grid.counter.wire(group="dp", tag="param")
        exported = tr.zero.export_state()  # what this rank holds for a checkpoint
        owned = {n: p.numel() for n, p in tr.named_params if n in exported}
        root = sum(b.numel for b in tr.zero.buckets if b.unit is None)
        layers = sum(b.numel for b in tr.zero.buckets if b.unit is not None)
        out[stage] = {"psi": psi, "measured": measured, "formula": formula, "planned": planned, "wire": wire,
                      "root": root, "layers": layers, "peak_gathered": tr.zero.peak_gathered_bytes,
                      "layer_bytes": max((b.numel for b in tr.zero.buckets if b.unit is not None), default=0) * 2,
                      "param_bytes": psi * 2, "owned": owned,
                      "largest": max(p.numel() for _, p in tr.named_params)}
    return out


def _overflow(rank, world, text, cache, base):
    """fp16: an inf in one rank's gradient skips the step everywhere and changes no parameter."""
    cfg, grid, data, tr = _engine(text, cache, base, world, ["zero.stage=2", "train.precision=fp16"])
    log = []

    def params():
        tr.zero.settle()  # the last step's parameter all-gathers may still be in flight (overlapped)
        return torch.cat([b.full.float().clone() for b in tr.zero.buckets])

    poison = [False]
    # an inf in rank 1's first layer's output: its backward gives that layer's gradients inf/nan there only
    tr.chunks[0].layers["0"].register_forward_hook(lambda m, a, out: out * float("inf") if poison[0] else None)
    for step, poisoned in enumerate([False, True, True, False]):
        poison[0] = poisoned and rank == 1
        before, scale = params(), tr.scaler.scale
        skipped = _one_step(tr, data, cfg, grid).skipped
        log.append({"skipped": skipped, "scale_before": scale, "scale_after": tr.scaler.scale,
                    "changed": not torch.equal(before, params())})
    return log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("zero")
    text, cache = write_corpus(base / "text"), base / "cache"
    run(TINY, _over(text, cache, base / "dp1", SAVE_HALF))  # builds the data every other run reads
    # the other one-process references in a process of their own, beside the two dp ranks
    references = start_ranks(1, _train, text, cache, base, [("dp1_mb1", ["train.micro_batch=1"]),
                                                            ("dp1_bf16", BF16)])
    overflow = run_ranks(2, _train_dp2, text, cache, base, DP2 + [_resumed(base, "dp1_then_dp2_z3")])
    references.results()
    measured = run_ranks(4, _train_dp4, text, cache, base, DP4)
    groups = run_ranks(8, _train_eight, text, cache, base, EIGHT)
    for name in ("dp2_z2_then_dp1", "tp2_pp2_dp2_z3_then_dp1"):
        run(TINY, _over(text, cache, base / name, _resumed(base, name)[1]))
    return base, overflow, measured, groups


def _curve(base, name):
    got = read_metrics(base / name)
    first = HALF + 1 if name in RESUMED else 1  # a resumed run logs the steps it ran
    assert [r["step"] for r in got] == list(range(first, (BF16_STEPS if "bf16" in name else STEPS) + 1))
    return got


@pytest.mark.parametrize("name", [n for n, _ in DP2 + DP4 + EIGHT if "bf16" not in n] + list(RESUMED))
def test_fp32_curve_matches_dp1(runs, name):
    base = runs[0]
    ref = _curve(base, "dp1_mb1" if name.startswith("dp4") else "dp1")
    got = _curve(base, name)
    for a, b in zip(ref[len(ref) - len(got):], got):
        assert a["step"] == b["step"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (name, a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (name, a["step"])


@pytest.mark.parametrize("name", [n for n, _ in DP2 if "bf16" in n])
def test_bf16_curve_follows_dp1(runs, name):
    """Within 2e-2 of the dp=1 bf16 curve, and learning: two runs whose updates never reached the bf16
    parameters would agree on a flat curve. The loss must fall by more than 0.3 in the 10 steps (the fp32
    curve falls 0.39; the 0.5 asked before was for 20 steps, which fall 0.56), over twice the band (~0.12 at
    a loss of 6)."""
    base = runs[0]
    ref, got = _curve(base, "dp1_bf16"), _curve(base, name)
    for a, b in zip(ref, got):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-2), (name, a["step"], a["loss"], b["loss"])
    assert got[-1]["loss"] < got[0]["loss"] - 0.3


@pytest.mark.parametrize("stage", range(4))
def test_model_state_bytes_match_formula_and_dry_run(runs, stage):
    for r in runs[2]:
        m = r[stage]
        for kind in ("params", "grads", "optimizer"):
            assert abs(m["measured"][kind] - m["formula"][kind]) <= 0.05 * m["formula"][kind], (stage, kind, m)
            assert m["planned"][kind] == m["formula"][kind]
        assert m["measured"]["cpu"] == 0


@pytest.mark.parametrize("stage", range(4))
def test_communication_volume(runs, stage):
    """Elements on the wire per rank and step (ring algorithms), m = 1: 2Ψ(dp-1)/dp for stages 0-2;
    stage 3 gathers each layer twice (forward, backward) and the root (embeddings) once, then
    reduce-scatters everything: 3Ψ_layers + 2Ψ_root, times (dp-1)/dp."""
    dp = 4
    for r in runs[2]:
        m = r[stage]
        padded = m["root"] + m["layers"]
        want = 2 * padded * (dp - 1) / dp if stage < 3 else (3 * m["layers"] + 2 * m["root"]) * (dp - 1) / dp
        assert m["wire"] == pytest.approx(want, rel=1e-9), (stage, m["wire"], want)
        ideal = (2 if stage < 3 else 3) * m["psi"] * (dp - 1) / dp
        assert 0.75 * ideal <= m["wire"] <= 1.05 * ideal


@pytest.mark.parametrize("stage", range(4))
def test_checkpoint_state_is_split_over_dp(runs, stage):
    """A save holds each parameter's whole state on one dp rank only: the ranks' shares are disjoint, cover the
    stage, and are balanced to within one parameter (~1/dp of the state each, not all of it on every rank)."""
    shares = [r[stage]["owned"] for r in runs[2]]
    names = [n for share in shares for n in share]
    assert len(names) == len(set(names))
    psi, largest = runs[2][0][stage]["psi"], runs[2][0][stage]["largest"]
    assert sum(sum(share.values()) for share in shares) == psi
    for share in shares:
        assert sum(share.values()) <= psi / len(shares) + largest


def test_stage3_never_gathers_more_than_a_few_layers(runs):
    for r in runs[2]:
        m = r[3]
        # the root (embeddings, final norm) stays gathered for the step; layers come and go two at a time
        assert m["peak_gathered"] <= m["root"] * 2 + 2 * m["layer_bytes"], m
        assert m["peak_gathered"] < 0.6 * m["param_bytes"], m
        # and the measure sees the gathers: forward holds the root and a layer (the largest, at some point)
        assert m["peak_gathered"] >= m["root"] * 2 + m["layer_bytes"], m


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(runs):
    logs = runs[1]
    assert logs[0] == logs[1]  # both ranks took the same decisions
    clean, first, second, after = logs[0]
    assert not clean["skipped"] and clean["changed"]
    assert first["skipped"] and not first["changed"]
    assert first["scale_after"] == first["scale_before"] == 2.0 ** 16  # hysteresis 2: the first one is forgiven
    assert second["skipped"] and not second["changed"] and second["scale_after"] == 2.0 ** 15
    assert not after["skipped"] and after["changed"] and after["scale_after"] == 2.0 ** 15


def test_device_mesh_groups_match_rank_math(runs):
    """Each rank's tp, dp and pp groups of the mesh at tp2 x pp2 x dp2 hold the ranks the rank math says (an
    all-gather of the members and an all-reduce in each group), in the fixture's 8-rank spawn."""
    tp, pp, dp = 2, 2, 2
    for rank, res in enumerate(runs[3]):
        assert res["coords"] == ParallelDims(tp=tp, pp=pp, dp=dp).coords(rank)
        for dim in ("tp", "dp", "pp"):
            expected = next(g for g in ParallelDims(tp=tp, pp=pp, dp=dp).groups(dim) if rank in g)
            assert res[dim] == expected
            assert res[dim + "_sum"] == sum(expected)
        # tp 2 x dp 2 x cp 2: rank = (dp_rank * 2 + cp_rank) * 2 + tp_rank; gradients over dp x cp
        cp = res["cp"]
        assert cp["coords"] == (0, rank // 4, (rank // 2) % 2, rank % 2)
        assert cp["cp_comm"] == [r for r in range(8) if r // 4 == rank // 4 and r % 2 == rank % 2]
        assert cp["dp_comm"] == [r for r in range(8) if r % 4 == rank % 4]
        assert cp["grad_comm"] == [r for r in range(8) if r % 2 == rank % 2]
        assert cp["expert_grad_comm"] == cp["grad_comm"]  # no expert parallelism: the dense group
        # dp 4 (edp 2 x ep 2) x cp 2: rank = dp_rank * 2 + cp_rank, dp_rank = edp_rank * 2 + ep_rank
        ep = res["cp_ep"]
        assert ep["grad_comm"] == list(range(8))
        assert ep["expert_grad_comm"] == [r for r in range(8) if (r // 2) % 2 == (rank // 2) % 2]  # same ep rank
        assert ep["cp_comm"] == [rank - rank % 2, rank - rank % 2 + 1]


def test_offloaded_runs_equal_the_others(runs):
    base = runs[0]
    for off, plain in (("dp2_z1_offload", "dp2_z1"), ("dp2_z3_offload", "dp2_z3")):
        assert [r["loss"] for r in _curve(base, off)] == [r["loss"] for r in _curve(base, plain)]


def test_stage3_creates_the_model_one_bucket_at_a_time():
    """ZeRO-3 builds the model on the meta device and creates the parameters bucket by bucket (DeepSpeed's
    zero.Init): while it creates any parameter, the only parameter storage alive is the bucket being filled, not
    the whole stage. Values are the same as an eagerly built model's."""
    from megazero.models.build import build_gpt
    from megazero.models.init import initial_tp_value
    from megazero.parallel.zero import ZeroOptimizer

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=4"]).model
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=1), "cpu")
    model = build_gpt(cfg, 7, tp=grid.tp_comm, materialise=False)
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    names = {p: n for n, p in params.items()}
    live = []

    def probe(p):
        storages = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes() for q in params.values()
                    if not q.is_meta}
        live.append(sum(storages.values()))
        return initial_tp_value(model, names[p], 7)

    zero = ZeroOptimizer([model], grid, 3, "fp32", 0.1, device=torch.device("cpu"), initial_value=probe)
    assert len(live) == len(params)  # every parameter was created by the optimizer, none before
    biggest = max(b.numel for b in zero.buckets) * 4
    whole = sum(p.numel() for p in params.values()) * 4
    assert max(live) <= biggest < whole / 3, (max(live), biggest, whole)
    eager = dict(build_gpt(cfg, 7, tp=grid.tp_comm).named_parameters())
    for b in zero.buckets:
        zero.gatherer._gather(b)  # the model's own Parameter objects now view the gathered bucket
        for n, p in b.params:
            assert p is params[n] and not p.is_meta and torch.equal(p, eager[n]), n
            assert p.tp_split_dim == eager[n].tp_split_dim  # attributes survive the swap


@pytest.mark.parametrize("stage,microbatches", [(0, 2), (2, 2), (3, 1)])
def test_a_parameter_without_a_gradient_stops_the_step(stage, microbatches):
    """A bucket is reduced when all its parameters' gradients are in: one that never gets a gradient would
    leave its bucket unreduced and the dp ranks drifting apart in silence. The step must refuse instead, and a
    frozen parameter is refused when the optimizer is built. (Stage 3 with a second microbatch fails earlier,
    in that backward: the layer it never saw finish was not gathered again.)"""
    from megazero.models.build import build_gpt
    from megazero.parallel.zero import ZeroOptimizer

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=1"]).model
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=1), "cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step(model, microbatches):
        zero = ZeroOptimizer([model], grid, stage, "fp32", 0.1, device=torch.device("cpu"))
        mbs = [ids] * microbatches
        train_step(zero, *executor_for(model, grid, mbs), mbs, 1e-3, 1.0)

    step(build_gpt(cfg, 0, tp=grid.tp_comm), microbatches)  # every parameter used: steps
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    model.layers["0"].unused = torch.nn.Parameter(torch.zeros(4))
    model.layers["0"].unused.tp_split_dim, model.layers["0"].unused.sequence_parallel = None, False
    with pytest.raises(RuntimeError, match=r"gradient is missing for one of .*layers\.0\.unused"):
        step(model, microbatches)
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    model.layers["0"].mlp.fc1.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen: layers\.0\.mlp\.fc1\.weight"):
        step(model, 1)


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_gradients_accumulate_in_fp32(stage):
    """Under bf16 the microbatches' gradients are summed (and reduced) in fp32 by default, as Megatron-LM
    does: bf16 keeps 8 mantissa bits, so a running bf16 sum of 32 microbatches drifts by ~1e-2 relative.
    Reference: the same per-microbatch bf16 gradients summed in float64. fp32 sums are ~1e-7 relative off
    (bound 1e-5); the bf16 sums (grad_dtype=model) must show the drift (> 1e-3), or the test tells nothing. At seq
32 (CPU bf16 is emulated: the length sets the time, m the drift) they measured 9e-9 and 8.6e-3."""
    from megazero.models.build import build_gpt
    from megazero.parallel.zero import ZeroOptimizer

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=1", "model.seq_len=32"]).model
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=1), "cpu")
    m = 32
    ids = torch.randint(0, cfg.vocab_size, (m, 1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    errors = {}
    for grad_dtype in ("auto", "model"):
        model = build_gpt(cfg, 0, tp=grid.tp_comm)
        ref = {}

        def record(p, name):  # runs before ZeRO's hook takes the gradient away
            ref[name] = ref.get(name, 0) + p.grad.double()

        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: record(p, name))
        zero = ZeroOptimizer([model], grid, stage, "bf16", 0.1, device=torch.device("cpu"),
                             grad_dtype=grad_dtype)
        mbs = list(ids)
        forward_backward(zero, *executor_for(model, grid, mbs), mbs)
        worst = 0.0
        for b in zero.buckets:
            grad = zero.reducer.grad(b)
            assert grad.dtype == (torch.float32 if grad_dtype == "auto" else torch.bfloat16)
            for (name, p), off in zip(b.params, b.offsets):
                want = ref[name].reshape(-1)
                got = grad[off:off + p.numel()].double()
                worst = max(worst, ((got - want).norm() / want.norm()).item())
        errors[grad_dtype] = worst
    assert errors["auto"] <= 1e-5 and errors["model"] > 1e-3, errors


def test_a_skipped_stage3_step_frees_what_it_gathered():
    """An fp16 overflow skips the step; under stage 3 it must still free the gathered root (embeddings, final
    norm), or the next step starts with it held twice over (gathered, and gathered again for forward)."""
    from megazero.models.build import build_gpt
    from megazero.parallel.zero import ZeroOptimizer

    cfg = load_config(TINY, ["parallel.tp=1", "parallel.pp=1", "model.layers=2"]).model
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=1), "cpu")
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    zero = ZeroOptimizer([model], grid, 3, "fp16", 0.1, device=torch.device("cpu"))
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    state = {"poison": False}
    model.layers["1"].register_forward_hook(lambda m, a, out: out * float("inf") if state["poison"] else None)
    driver = executor_for(model, grid, [ids])
    for poison in (False, True):
        state["poison"] = poison
        skipped = train_step(zero, *driver, [ids], 1e-3, 1.0, make_scaler("fp16")).skipped
        assert skipped == poison and zero.gathered_bytes == 0, (poison, zero.gathered_bytes)
