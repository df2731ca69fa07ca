"""A run end to end: config -> launch -> grid -> trainer (DESIGN: one run, as data flows)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kernels import resolve_kernels
from megazero.config import load_config
from megazero.errors import UserError

if TYPE_CHECKING:
    from megazero.plan import Plan

DRY_RUN_FOOTER = "dry run: nothing was allocated; no process group was started"


def run(config_path: str, overrides: list[str]) -> list[dict]:
    """Train as the config says; static config errors surface before torch is even imported."""
    cfg = load_config(config_path, overrides)
    import torch

    from megazero import launch
    from megazero.config import resolve_world
    from parallel.topology import Grid

    info = launch.process_info()
    resolve_world(cfg, info.world_size)
    try:  # where checkpoints and logs go: a path that cannot be written is an input error, found now
        (Path(cfg.log.dir) / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} is invalid; cannot create it ({e.strerror})") \
            from None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = launch.pick_device(cfg.launch.device, info.local_rank, local_world)
    if device.type == "cpu" or "cpu" in (cfg.zero.offload_optimizer, cfg.zero.offload_params):
        # the CPU computes (the model, or the offloaded AdamW): a fair share of the node's cores each, not
        # torchrun's OMP_NUM_THREADS=1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # before any process group: a refusal is a config error
    resolve_kernels(cfg.kernels, device.type, cfg.model.head_dim)
    created = launch.init_distributed(info, device)
    try:
        grid = Grid.build(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, device.type)
        launch.seed_everything(cfg.train.seed)
        from megazero.trainer import Trainer

        trainer = Trainer(cfg, grid, device, is_builder=info.local_rank == 0)
        return trainer.fit()
    finally:
        if created:
            launch.shutdown()


def dry_run(config_path: str, overrides: list[str]) -> Plan:
    """Validate as a run does, then print each rank role's plan (rank 0 prints).

    The world size is parallel.world_size when set, else tp*pp*dp when dp is
    explicit, else the launcher's. Models are built on the meta device only:
    no process group, no parameter memory, no tokenizer or corpus.
    """
    cfg = load_config(config_path, overrides)
    from megazero.config import resolve_world
    from megazero.launch import process_info
    from megazero.plan import format_plan, make_plan, planned_world_size

    info = process_info()
    try:
        resolve_world(cfg, planned_world_size(cfg, info.world_size))
    except UserError as e:
        if cfg.parallel.world_size > 0:
            raise
        raise UserError(f"{e}; to plan another size use --set parallel.world_size=N") from None
    plan = make_plan(cfg)
    if info.rank == 0:
        print(format_plan(plan), flush=True)
        print(DRY_RUN_FOOTER, flush=True)
    return plan
