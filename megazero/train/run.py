"""A run end to end: config -> resolve -> launch -> grid -> trainer (DESIGN: one run, as data flows).

The entry points — a run, ``--dry-run`` and ``--simulate`` — are where the config is resolved
(megazero.config.resolve), once; everything they hand it to reads the resolved values and resolves nothing.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
import signal
from datetime import timedelta
from pathlib import Path
import sys
from typing import TYPE_CHECKING, Optional

from megazero.config.load import load_config
from megazero.config.resolve import planned_world_size, precision_for, resolve
from megazero.config.schema import AUTO
from megazero.errors import UserError

if TYPE_CHECKING:
    from megazero.plan.stage_plan import Plan

DRY_RUN_FOOTER = "dry run: nothing was allocated; no process group was started"


def run(config_path: str, overrides: list[str]) -> list[dict]:
    """Train as the config says; static config errors surface before torch is even imported."""
    cfg = load_config(config_path, overrides)
    from megazero import launch
    from megazero.plan.fits import check_fits
    from megazero.train.run_dir import plan_start
    from megazero.train.run_lock import lock_run
    from megazero.train.signals import StopSignals, StoppedEarly
    from megazero.parallel.topology import Grid
    from megazero.parallel.dims import ParallelDims

    info = launch.process_info()
    local_world = launch.local_world_size()
    device = launch.pick_device(cfg.launch.device, info.local_rank, local_world)
    asked_precision = cfg.train.precision
    resolve(cfg, info.world_size, device.type)  # before any process group: a refusal is a config error
    if asked_precision == AUTO and info.rank == 0:
        print(f"train.precision=auto: {cfg.train.precision} ({precision_for(device.type)[1]})", flush=True)
    if cfg.train.fp8 != "none" and cfg.model.moe.experts and info.rank == 0:
        print(f"train.fp8={cfg.train.fp8}: the routed experts' grouped matmuls stay in {cfg.train.precision} "
              "(torch._scaled_grouped_mm runs on CUDA only, where none of it has been tested)", flush=True)
    try:  # where checkpoints and logs go: a path that cannot be written is an input error, found now
        (Path(cfg.log.dir) / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} is invalid; cannot create it ({e.strerror})") \
            from None
    for name in ("metrics.jsonl", "metrics.jsonl.tmp"):  # the writing rank replaces them: files, or nothing
        p = Path(cfg.log.dir) / name
        if p.exists() and not p.is_file():
            raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} holds {name}, which is not a file; move it away "
                            f"or choose another log.dir")
    check_fits(cfg, device, info.rank, info.local_rank, local_world)
    check_init_from(cfg)
    # until the loop begins a stop signal ends the run at once: nothing to save yet
    with _cpu_threads(cfg, device, local_world), StopSignals() as stop:
        created, grid, lock = False, None, None
        try:
            created = launch.init_distributed(info, device, cfg.launch.timeout_minutes,
                                              str(Path(cfg.log.dir) / "hang"))
            grid = Grid.build(ParallelDims.of(cfg.parallel), device.type,
                              timeout=timedelta(minutes=cfg.launch.timeout_minutes))
            lock = lock_run(cfg, grid)  # one run per log.dir: refused on every rank before the folder is used
            if grid.rank == 0:  # an earlier attempt's hang records kept aside: this run's are its own
                from megazero import hang

                hang.set_aside(cfg.log.dir)
            start = plan_start(cfg)  # continue, start afresh or refuse: decided from the folder, before any build
            launch.seed_everything(cfg.train.seed)
            from megazero.train.trainer import Trainer

            trainer = Trainer(cfg, grid, device, is_builder=info.local_rank == 0, stop=stop)
            if cfg.zero.offload_optimizer == "nvme" and grid.rank == 0:
                from megazero.parallel.zero.nvme_adamw import describe

                disks = [part.layout.param_disk for part in trainer.zero.parts if part.layout.param_disk is not None]
                print(describe([part.optim for part in trainer.zero.parts], sum(d.disk_bytes() for d in disks)),
                      flush=True)
            try:
                return trainer.fit(start)
            finally:  # zero.offload_optimizer=nvme: the states' scratch files are removed, whatever ended the run
                trainer.zero.close()
        except Exception as e:
            if stop.stopped_early:  # what failed after an early stop (a collective whose peer left) failed of it
                raise StoppedEarly(stop.received) from None
            if isinstance(e, UserError):  # maybe found by this rank alone (a damaged weight of its pipeline stage)
                from megazero.train.peer_errors import leave_for_rank_0

                leave_for_rank_0(e, info.rank)
                raise
            if isinstance(e, RuntimeError):  # the process-group start-up too: a peer that never comes is a timeout
                raise _as_run_error(e, cfg, grid, info.rank) from None
            raise
        finally:
            if lock is not None:
                lock.release()
            if created:
                launch.shutdown()


@contextmanager
def _cpu_threads(cfg, device, local_world: int):
    """Where the CPU computes (the model, or the offloaded AdamW), launch.cpu_threads intra-op threads per rank:
    by default a fair share of the node's cores, not torchrun's OMP_NUM_THREADS=1. The caller's count comes back
    when the run ends (a run started in-process leaves the process as it found it)."""
    import torch

    before = torch.get_num_threads()
    if device.type == "cpu" or {cfg.zero.offload_optimizer, cfg.zero.offload_params} & {"cpu", "nvme"}:
        torch.set_num_threads(cfg.launch.cpu_threads or max(1, (os.cpu_count() or 1) // local_world))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_run_error(e: RuntimeError, cfg, grid, rank: int) -> Exception:
    """The failures a long run meets that are not bugs, as one line: memory that ran out, an input error a peer
    met (it exited, so this rank's collective with it failed), or a collective that timed out or lost its peer
    (some rank stopped taking part); anything else stays itself."""
    import torch

    from megazero.errors import CollectiveTimeout
    from megazero.train.peer_errors import peer_error

    text = str(e).lower()
    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
    if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text:
        return UserError(f"{cfg.source}: out of memory on rank {rank} ({first}); --dry-run shows the plan, and "
                         f"activation checkpointing, a higher zero.stage, a smaller train.micro_batch or more tp/pp "
                         f"reduce it")
    peer = peer_error()
    if peer is not None:
        return peer
    if "timed out" in text or "timeout" in text or "connection closed by peer" in text \
            or "connection reset by peer" in text:
        last = (grid.counter.last if grid is not None else None) or "the process-group start-up"
        timeout = CollectiveTimeout(f"rank {rank}: collective {last} did not complete: {first} (another rank "
                                    f"stopped taking part or exited; launch.timeout_minutes="
                                    f"{cfg.launch.timeout_minutes:g})")
        if grid is not None and grid.world_size > 1:  # who waits on whom: every rank's record, one summary
            gone = "timed out" not in text and "timeout" not in text  # a peer's connection closed: it exited
            timeout.summary = _hang_summary(cfg, grid, rank, str(timeout), gone)
        return timeout
    return e


def _hang_summary(cfg, grid, rank: int, error: str, gone: bool) -> Optional[list[str]]:
    """This rank's record in log.dir/hang, then the summary if this rank is the one to print it
    (``megazero.hang``); a folder that cannot be written leaves only the one line. The grace for the others'
    records: a timeout's peers time out within about a step of each other (a quarter of the timeout, 5-20 s);
    after a peer exited (``gone``) those that talk to it learn at once, and a restart should not wait (2 s)."""
    from megazero import hang

    grace = 2.0 if gone else min(20.0, max(5.0, cfg.launch.timeout_minutes * 60 / 4))
    try:
        hang.write_record(cfg.log.dir, rank, grid.world_size, grid.counter.ops, error)
        return hang.report(cfg.log.dir, rank, grid.world_size, grace)
    except OSError:
        return None


def cli(config_path: str, overrides: list[str], dry: bool, simulate: bool | str = False) -> int:
    """pretrain.py's body: run (or plan, or simulate) and turn every way a run ends into one line and an exit
    code (megazero.errors lists them; a simulation exits 3 when a rank does not fit). ``simulate``: True (or
    "auto") extrapolates from smaller steps where exact, "full" simulates every layer and microbatch."""
    from megazero.errors import CollectiveTimeout, RunStopped
    from megazero.train.signals import Interrupted, exit_code

    try:
        if simulate:
            return simulate_run(config_path, overrides, full=simulate == "full")
        (dry_run if dry else run)(config_path, overrides)
    except UserError as e:
        _report(f"error: {e}", every_node=True)
        return 2
    except CollectiveTimeout as e:  # the rank that saw it says so: the one that stopped may be rank 0
        _report(f"error: {e}", every_rank=True)
        for line in getattr(e, "summary", None) or []:  # on the one rank that claimed the summary
            print(line, file=sys.stderr, flush=True)
        return e.exit_code
    except RunStopped as e:
        _report(f"error: {e}" if e.is_error else f"stopped: {e}", stdout=not e.is_error)
        return e.exit_code
    except Interrupted as e:
        _report(f"error: {e}")
        return exit_code(e.signum)
    except KeyboardInterrupt:  # Ctrl-C before the run watched for it (start-up) or after
        _report("error: interrupted (SIGINT) outside the training loop; nothing was saved")
        return exit_code(signal.SIGINT)
    return 0


def _report(line: str, every_node: bool = False, every_rank: bool = False, stdout: bool = False) -> None:
    """Print on rank 0; with every_node also on each other node's first process (an input only that node lacks,
    tagged with rank and host); with every_rank on any rank."""
    import socket

    def env_int(*names: str) -> int:
        for n in names:
            v = os.environ.get(n, "")
            if v.strip().isdigit():
                return int(v)
        return 0

    # a file name may hold a newline or a terminal escape: shown escaped, the report stays one line
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    rank, local_rank = env_int("RANK", "SLURM_PROCID"), env_int("LOCAL_RANK", "SLURM_LOCALID")
    stream = sys.stdout if stdout else sys.stderr
    if rank == 0 or every_rank:
        print(line, file=stream, flush=True)
    elif every_node and local_rank == 0:
        head, _, rest = line.partition(": ")
        print(f"{head} (rank {rank}, {socket.gethostname()}): {rest}", file=stream, flush=True)


def check_init_from(cfg) -> None:
    """A ``train.init_from`` folder that is not the configured model, or holds tensors it does not use (unless
    ``train.init_unused: drop``), is a config error, found before any process group: its config.json and tensor
    headers are read, no weights."""
    if cfg.train.init_from:
        from megazero.interop.hf_import import open_hf_model

        open_hf_model(cfg.train.init_from, cfg.model, cfg.train.init_unused)


def dry_run(config_path: str, overrides: list[str]) -> Plan:
    """Validate and resolve as a run does, then print each rank role's plan (rank 0 prints).

    The world size is parallel.world_size when set, else tp*pp*dp when dp is
    explicit, else the launcher's. The config is resolved for the device the run
    is planned on (launch.device; auto plans a GPU run) without that device being
    here: a login node plans a GPU run. Models are built on the meta device only:
    no process group, no parameter memory, no tokenizer or corpus.
    """
    cfg = load_config(config_path, overrides)
    from megazero.costs import compute_device
    from megazero.launch import process_info
    from megazero.plan.stage_plan import make_plan
    from megazero.plan.table import format_plan

    info = process_info()
    try:
        resolve(cfg, planned_world_size(cfg, info.world_size), compute_device(cfg.launch.device), planned=True)
    except UserError as e:
        if cfg.parallel.world_size > 0:
            raise
        raise UserError(f"{e}; to plan another size use --set parallel.world_size=N") from None
    check_init_from(cfg)
    plan = make_plan(cfg)
    if info.rank == 0:
        print(format_plan(plan), flush=True)
        print(DRY_RUN_FOOTER, flush=True)
    return plan


def simulate_run(config_path: str, overrides: list[str], full: bool = False) -> int:
    """``pretrain.py --simulate``: the config resolved for this CPU (a simulation runs the CPU code path, Triton
    kernels replaced by their CPU counterparts) and the world it plans, then megazero.plan.simulate."""
    cfg = load_config(config_path, overrides)
    from megazero.plan.simulate import cpu_kernels
    from megazero.plan.simulate_run import run_simulation

    cpu_kernels(cfg)
    resolve(cfg, planned_world_size(cfg, 1), "cpu")
    return run_simulation(cfg, full)
