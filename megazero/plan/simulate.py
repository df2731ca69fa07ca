"""Run one rank's real training step at full size without the hardware (``pretrain.py --simulate``).

The rank builds its grid, model chunks, ZeRO optimizer and pipeline schedule and runs two training steps,
every collective and the optimizer step included, in this one CPU process: the tensors are torch's fake
tensors (``FakeTensorMode``: shapes and dtypes, no memory), the process group is torch's fake one (backend
"fake": every collective returns at once) and the batches are token ids of the right shape. Everything
else is the code a real run runs (``Trainer.train_step``), measured by the tracker a real run can use
(``megazero.plan.tracker``), so the figures are the code's, not a formula's — which is how this sees what the
``--dry-run`` formulas miss.

Ranks that hold the same run the same: every rank of a pipeline stage (tp shards are even, dp replicas
are copies), and under interleaving each stage's rank holds its own set of chunks. So one rank per stage is
simulated, each a "memory class" (``launch.rank=r`` picks one rank instead).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.plan.tracker import CATEGORIES, MemoryTracker, watching

GB = 1e9
DOES_NOT_FIT = 3  # exit code when a rank class does not fit in launch.memory_gb
STEPS = 2  # the second step has what the first builds lazily (moments, the post-step gather)


class TokenIds:
    """The batches of a simulated (or measured) step: token ids of the right shape, all 0."""

    eos_id = -1  # no end-of-text token: the simulated step runs its attention without document masks

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def train_microbatches(self, consumed_samples: int, dp_rank: int, dp: int, micro_batch: int,
                           global_batch: int) -> list[torch.Tensor]:
        return [torch.zeros((micro_batch, self.seq_len + 1), dtype=torch.long)
                for _ in range(global_batch // (micro_batch * dp))]


@dataclass
class RankResult:
    """One rank class's figures (what simulate.json holds per class)."""

    rank: int
    pp_rank: int
    peak_bytes: int
    bytes: dict  # by category, at the peak
    moment: str
    host_bytes: int  # offloaded states: host memory, apart from the peak
    state_bytes: dict  # params/grads/optimizer/host kept across steps (the ZeRO formulas' figures)
    comm_bytes: dict  # bytes this rank sends per step, by group
    plan_bytes: dict  # the --dry-run figure for each category and the total
    seconds: float
    build_peak_bytes: int = 0  # while building (stages 0-2 materialise the model in fp32 before ZeRO takes it)
    fits: Optional[bool] = None
    extrapolated: str = ""  # how the figures were extrapolated from smaller steps (megazero.plan.extrapolate)


def measure(cfg: Config, grid, device: torch.device, tracker: MemoryTracker, steps: int = STEPS,
            progress: Optional[Callable[[str], None]] = None) -> dict:
    """Build this rank's trainer and run ``steps`` training steps under ``tracker``; returns the comm bytes
    of the last step by group. The same function measures a real run (tests) and a simulated one.
    The steps before the last are ``first_step``'s, over the fewest microbatches; ``progress`` hears a line now
    and then while it works (``tracker.watching``)."""
    from megazero.train.trainer import Trainer

    with tracker:
        if progress is not None:  # a stage of thousands of layers or ranks takes a while to build too
            tracker.tick = _building(progress)
        trainer = Trainer(cfg, grid, device, data=TokenIds(cfg.model.seq_len))
        tracker.tick = None
        tracker.name_state(trainer.zero)
        # the steps' peak: the build's transients are not training memory, and on a CPU run offloaded states
        # are named host memory only now (on a GPU they are host tensors from the start)
        tracker.restart_peak("after the build")
        with watching(tracker, trainer.executor, trainer.zero, progress):
            for n in range(steps):
                grid.counter.reset()
                if n < steps - 1:
                    first_step(trainer)
                else:
                    trainer.train_step()
    return grid.counter.sent_bytes()


def _building(progress: Callable[[str], None]) -> Callable[[], None]:
    """A tracker tick that says the build is still going, every ``tracker.PROGRESS_S`` at most."""
    from megazero.plan import tracker

    begun = said = time.perf_counter()

    def tick() -> None:
        nonlocal said
        now = time.perf_counter()
        if now - said >= tracker.PROGRESS_S:
            said = now
            progress(f"building the stage, after {now - begun:.0f} s")
    return tick


def first_step(trainer) -> None:
    """A step over the fewest microbatches the schedule takes (1; pp interleaved): what a first step makes
    for the next (the optimizer's moments, the gradient buffers, the post-step gather's staging) does not
    depend on the microbatches, and the next step holds all of it beside the same activations, so its peak
    is the run's. A simulated microbatch costs its ops (seconds at full size): this halves the steps' cost."""
    from megazero.engine.build import make_schedules
    from megazero.engine.step import train_step
    from megazero.train.lr_schedule import lr_at

    grid, t, p = trainer.grid, trainer.cfg.train, trainer.cfg.parallel
    m = p.pp if p.schedule == "interleaved" else 1
    schedule, _ = make_schedules(p.schedule, grid, m, p.virtual_stages, p.overlap_p2p)
    microbatches = trainer.data.train_microbatches(0, grid.dp_rank, grid.dp, t.micro_batch,
                                                   m * t.micro_batch * grid.dp)
    for chunk in trainer.chunks:
        chunk.train()
    lr = lr_at(trainer.zero.step_count, t.lr, t.min_lr, t.warmup_steps, t.steps)
    result = train_step(trainer.zero, trainer.executor, schedule, microbatches, lr, t.grad_clip, trainer.scaler)
    trainer.routers = result.routers  # held into the next step, as Trainer.train_step holds them


def simulate_rank(cfg: Config, rank: int, plan, progress: Optional[Callable[[str], None]] = None,
                  sampled_rings: bool = True) -> RankResult:
    """One rank of the config's world, on fake tensors and the fake process group; ``progress`` hears how far
    its steps are now and then (``measure``). ``sampled_rings``: a context-parallel ring runs one step of each
    kind, counted for the steps alike (``parallel.context.ring_plan``; ``--simulate full``: every step)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megazero.parallel.dims import ParallelDims
    from megazero.parallel.topology import Grid

    p = cfg.parallel
    start = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=p.tp * p.pp * p.dp * p.cp, store=FakeStore())
    try:
        grid = Grid.build(ParallelDims.of(p), "cpu")  # outside the fake mode: the mesh reads its ranks
        grid.cp_comm.sampled_rings = sampled_rings
        tracker = MemoryTracker()
        with FakeTensorMode(allow_non_fake_inputs=True):
            comm = measure(cfg, grid, torch.device("cpu"), tracker, progress=progress)
    finally:
        dist.destroy_process_group()
    pp_rank = ParallelDims.of(p).coords(rank).pp
    r = tracker.report()
    return RankResult(rank, pp_rank, r.peak_bytes, r.bytes, r.moment, r.host_peak_bytes, r.state_bytes,
                      comm, planned(cfg, plan.stages[pp_rank]), time.perf_counter() - start, r.build_peak_bytes)


def planned(cfg: Config, stage) -> dict:
    """The --dry-run plan's device bytes of one stage, by the tracker's categories."""
    z = cfg.zero
    ms = stage.model_state
    act = stage.act_ckpt if cfg.model.activation_checkpointing else stage.act_full
    out = {"params": (0 if z.offload_params != "none" else ms["params"]) + stage.gathered,
           "grads": ms["grads"] + stage.grad_buffers,
           "optimizer": 0 if z.offload_optimizer in ("cpu", "nvme") else ms["optimizer"], "activations": act}
    out["total"] = ms["device_total"] + act + stage.gathered + stage.grad_buffers
    out["host"] = ms["cpu_total"]
    return out


def cpu_kernels(cfg: Config) -> None:
    """The simulation runs the CPU code path: a request for a Triton kernel becomes one for the kernel that
    keeps the same tensors (torch SDPA's flash path keeps q, k, v, the output and the log-sum-exp as the
    Triton kernel does; torch's fused AdamW updates in place like the Triton one, without its 1 B/element
    decay mask). Called on the config as loaded, before it is resolved for the CPU."""
    for key in ("attention", "adam"):
        if getattr(cfg.kernels, key) == "triton":
            setattr(cfg.kernels, key, "torch" if key == "attention" else "fused")
            print(f"simulating kernels.{key}=triton with the CPU's {getattr(cfg.kernels, key)} implementation",
                  flush=True)


def rank_classes(cfg: Config) -> list[int]:
    """One rank per memory class: the first rank (dp 0, tp 0) of every pipeline stage, or launch.rank."""
    from megazero.parallel.dims import ParallelDims

    p = cfg.parallel
    world = p.tp * p.pp * p.dp * p.cp
    if cfg.launch.rank >= 0:
        if cfg.launch.rank >= world:
            raise UserError(f"{cfg.source}: launch.rank={cfg.launch.rank} is invalid; the world has ranks 0 to "
                            f"{world - 1}")
        return [cfg.launch.rank]
    return [ParallelDims.of(p).rank(s) for s in range(p.pp)]


def memory_limit(cfg: Config) -> float:
    """launch.memory_gb in bytes, or the memory of this machine's device (its RAM without a GPU)."""
    if cfg.launch.memory_gb > 0:
        return cfg.launch.memory_gb * GB
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    from megazero.plan.fits import available_bytes

    return float(available_bytes(torch.device("cpu")))


def format_result(r: RankResult, limit: float) -> list[str]:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "-"

    head = (f"rank {r.rank} (pipeline stage {r.pp_rank}): peak {r.peak_bytes / GB:.2f} GB of "
            f"{limit / GB:.2f} GB: {'fits' if r.fits else 'DOES NOT FIT'} (simulated in {r.seconds:.1f} s)")
    lines = [head, f"  peak at {r.moment}"] + ([f"  {r.extrapolated}"] if r.extrapolated else [])
    rows = [f"    {'':<12} {'simulated GB':>12} {'plan GB':>8} {'sim/plan':>8}"]
    for k in CATEGORIES + ("total",):
        got = r.peak_bytes if k == "total" else r.bytes[k]
        plan = r.plan_bytes.get(k)
        rows.append(f"    {k:<12} {got / GB:>12.3f} " + (f"{plan / GB:>8.3f} {ratio(got, plan):>8}"
                                                           if plan is not None else f"{'-':>8} {'-':>8}"))
    if r.host_bytes or r.plan_bytes["host"]:
        rows.append(f"    {'host (offl.)':<12} {r.host_bytes / GB:>12.3f} {r.plan_bytes['host'] / GB:>8.3f} "
                    f"{ratio(r.host_bytes, r.plan_bytes['host']):>8}")
    comm = ", ".join(f"{g} {b / GB:.3f}" for g, b in sorted(r.comm_bytes.items())) or "none"
    return lines + rows + [f"  sent per step (GB, ring algorithms): {comm}",
                           f"  while building: peak {r.build_peak_bytes / GB:.2f} GB (before training; stages 0-2 "
                           f"materialise the model in fp32 before ZeRO takes it; on a CPU run offloaded states "
                           f"count here)"]


def layer_activation_bytes(cfg: Config, tp_rank: int = 0) -> int:
    """Bytes one transformer layer keeps for backward per microbatch, measured by the tracker on fake tensors:
    the activations a forward of two layers leaves alive, less those of one layer (the difference is exactly
    one layer's saved tensors, its input included, as in Korthikanti et al. 2022, §4). The layout, precision,
    dropout and checkpointing are the config's; the tp group is the fake one."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megazero.models.build import build_gpt
    from megazero.models.llama import kv_replicas_needed
    from megazero.parallel.dims import ParallelDims
    from megazero.parallel.topology import Grid
    from megazero.parallel.zero import DTYPES

    p, m, t = cfg.parallel, cfg.model, cfg.train
    dist.init_process_group("fake", rank=tp_rank, world_size=p.tp, store=FakeStore())
    try:
        grid = Grid.build(ParallelDims(tp=p.tp, pp=1, dp=1), "cpu")
        kv_replicas = grid.tp_replica_comm(kv_replicas_needed(m, p.tp))
        held = []
        with FakeTensorMode(allow_non_fake_inputs=True):
            for layers in (1, 2):
                model = build_gpt(m, t.seed, tp=grid.tp_comm, layer_ids=range(layers), first_stage=False,
                                  last_stage=False, sequence_parallel=p.sequence_parallel,
                                  attention_impl=cfg.kernels.attention, kv_replicas=kv_replicas)
                for q in model.parameters():  # as ZeRO holds them (Module.to cannot swap fake parameters)
                    q.data = q.data.to(DTYPES[t.precision])
                model.train()
                seq = m.seq_len // (p.tp if model.sequence_parallel else 1)
                x = torch.zeros(t.micro_batch, seq, m.hidden, dtype=DTYPES[t.precision], requires_grad=True)
                tracker = MemoryTracker()
                tracker.name(list(model.parameters()), "params")  # made before the tracker: named, not new
                with tracker, tracker.acting("activations"):
                    out = model(x)
                    held.append(tracker.current["activations"])
                del out
    finally:
        dist.destroy_process_group()
    return held[1] - held[0]
