"""The rules an optimizer's registry row declares (``parallel.zero.registry``): where its states may live (the
device, the host, a local disk), the ZeRO stages it runs at, the keys of its section that name a step of the run."""
from __future__ import annotations

from megazero.config.schema import Config
from megazero.errors import invalid
from megazero.parallel.zero.registry import OPTIMIZERS


def check_optimizer(cfg: Config) -> None:
    """What the optimizer's registry row declares: where its states may live, the ZeRO stages it runs at, the keys
    of its section that name a step of the run."""
    src, z, name = cfg.source, cfg.zero, cfg.optim.name
    row = OPTIMIZERS[name]
    if row.device_only and z.offload_optimizer in ("cpu", "nvme"):
        raise invalid(src, "zero.offload_optimizer", z.offload_optimizer, f"is not supported with optim.name={name} "
                      f"({row.device_only}); use none, or optim.name=adamw")
    if z.offload_optimizer == "nvme":
        streaming = [n for n, r in OPTIMIZERS.items() if r.streams_from_disk]
        if not row.streams_from_disk:
            raise invalid(src, "zero.offload_optimizer", "nvme", f"is not supported with optim.name={name} (its "
                          f"update does not stream its states from a disk; those that do: {', '.join(streaming)}); "
                          "use cpu or none")
        if not z.nvme_path:
            raise invalid(src, "zero.nvme_path", z.nvme_path, "must name a folder on a local disk with "
                          "zero.offload_optimizer=nvme")
    if row.whole_grads:
        from megazero.parallel.zero.policy import StagePolicy

        if StagePolicy.of(z.stage).shard_grads:
            raise invalid(src, "zero.stage", z.stage, f"is not supported with optim.name={name}: "
                          f"{row.whole_grads}; use 0 or 1")
    if row.needs_group and cfg.parallel.dp * cfg.parallel.cp == 1:
        raise invalid(src, "parallel.dp", cfg.parallel.dp, f"must be > 1 with optim.name={name}: {row.needs_group}")
    section = getattr(cfg.optim, name)
    for key, why in row.before_last_step:
        if getattr(section, key) >= cfg.train.steps:
            raise invalid(src, f"optim.{name}.{key}", getattr(section, key),
                          f"must be < train.steps={cfg.train.steps}: it {why}")
