"""The rules of ZeRO's keys (``zero.*``): the optimizer's row (``megazero.config.optimizer_rules``), where the
parameters may be offloaded, and what a stage that shards them needs of the pipeline schedule."""
from __future__ import annotations

from megazero.config.optimizer_rules import check_optimizer
from megazero.config.schema import Config
from megazero.errors import invalid


def check_zero(cfg: Config) -> None:
    """Offloading parameters needs them sharded; keeping a layer gathered across zb1p's B and W needs them
    kept after forward. What a stage shards is parallel.zero's StagePolicy (imported only for the keys that
    need it: it brings torch, which loading a config otherwise does without)."""
    src, z = cfg.source, cfg.zero
    check_optimizer(cfg)
    if z.offload_params == "none" and z.reshard_after_forward is not True:
        return
    from megazero.parallel.zero.policy import StagePolicy

    shards_params = StagePolicy.of(z.stage).shard_params
    if z.offload_params != "none" and not shards_params:
        raise invalid(src, "zero.offload_params", z.offload_params, f"needs zero.stage=3 (got {z.stage})")
    if z.offload_params == "nvme" and z.offload_optimizer != "nvme":
        raise invalid(src, "zero.offload_params", "nvme", f"needs zero.offload_optimizer=nvme (got "
                      f"{z.offload_optimizer}): the step updates the shards as it streams their states")
    if shards_params and z.reshard_after_forward is True and cfg.parallel.schedule == "zb1p":
        raise invalid(src, "zero.reshard_after_forward", True,
                      "cannot be true with parallel.schedule=zb1p: a layer stays gathered from its input "
                      "gradient (B) to its weight gradient (W), and later forwards run in between; use auto or "
                      "false (auto is false with a pipeline)")
