"""A run end to end: config -> launch -> grid -> trainer (DESIGN: one run, as data flows)."""
from __future__ import annotations

import os

from megazero.config import load_config


def run(config_path: str, overrides: list[str]) -> list[dict]:
    """Train as the config says; static config errors surface before torch is even imported."""
    cfg = load_config(config_path, overrides)
    import torch

    from megazero import launch
    from megazero.config import resolve_world
    from parallel.topology import Grid

    info = launch.process_info()
    resolve_world(cfg, info.world_size)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = launch.pick_device(cfg.launch.device, info.local_rank, local_world)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
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
