"""Will the run fit? The --dry-run plan's per-rank bytes against the memory this machine has, before anything
is built, so a model too big fails in one line with the knobs that would help, not in the allocator.

The plan of a resolved config (megazero.config.resolve) counts model states and activations
(megazero.plan.stage_plan): a lower bound, since temporaries, communication
buckets and the allocator's slack come on top. So a run it says cannot fit cannot fit; one it passes may still
run out, which the allocator then reports.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch

from megazero.config.rules import validate
from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.plan.stage_plan import make_plan
from megazero.parallel.zero.policy import StagePolicy
from megazero.parallel.zero.registry import OPTIMIZERS

GB = 1e9
# Layers one rank builds in a run: each is a Python module (~40 KB of host memory before any tensor) run in a
# Python loop, which the byte plan does not see. Published models hold < 200 per pipeline stage; a dry run
# plans any count.
MAX_LAYERS_PER_RANK = 4096


def available_bytes(device: torch.device) -> int:
    """Free memory where this rank's tensors live: the GPU's free bytes, or the host's available RAM (shared
    by every process of the node)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needed_bytes(cfg: Config, ranks: range, device_type: str) -> int:
    """Planned bytes of these ranks on one device (a GPU holds one rank; a CPU host all of its node's ranks,
    their offloaded states included)."""
    plan = make_plan(cfg)
    per_stage = cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.tp
    return sum(stage_bytes(cfg, plan.stages[r // per_stage], device_type) for r in ranks)


def stage_bytes(cfg: Config, stage, device_type: str) -> int:
    """One rank of a pipeline stage (a megazero.plan.stage_plan.StagePlan): its model states where they live (a CPU host
    also holds the offloaded ones), ZeRO's gathered and gradient buffers, its activations, and a mixture of
    experts' dispatch buffers beyond what its layers keep."""
    act = stage.act_ckpt if cfg.model.activation_checkpointing else stage.act_full
    state = stage.model_state["device_total"] + (stage.model_state["cpu_total"] if device_type == "cpu" else 0)
    return state + stage.gathered + stage.grad_buffers + act + stage.dispatch


def _variants(cfg: Config) -> list[tuple[str, Config]]:
    """One knob turned at a time toward less memory per rank, at the same world size."""
    out = []
    p, t, z, m = cfg.parallel, cfg.train, cfg.zero, cfg.model

    def variant(label: str, change) -> None:
        c = copy.deepcopy(cfg)
        change(c)
        out.append((label, c))

    if not m.activation_checkpointing:
        variant("model.activation_checkpointing=true", lambda c: setattr(c.model, "activation_checkpointing", True))
    elif m.checkpoint_layers:
        variant("model.checkpoint_layers=0", lambda c: setattr(c.model, "checkpoint_layers", 0))
    if not StagePolicy.of(z.stage).shard_params:  # a higher stage shards more
        variant(f"zero.stage={z.stage + 1}", lambda c: setattr(c.zero, "stage", z.stage + 1))
    experts = m.moe.experts
    if experts and p.dp % (2 * p.ep) == 0 and experts % (2 * p.ep) == 0:  # half the experts' states per rank
        variant(f"parallel.ep={p.ep * 2}", lambda c: setattr(c.parallel, "ep", p.ep * 2))
    if z.offload_optimizer != "nvme" and OPTIMIZERS[cfg.optim.name].streams_from_disk:  # the states off the host
        variant("zero.offload_optimizer=nvme (with zero.nvme_path)",
                lambda c: (setattr(c.zero, "offload_optimizer", "nvme"),
                           setattr(c.zero, "nvme_path", c.zero.nvme_path or "nvme")))
    if t.micro_batch > 1:
        variant(f"train.micro_batch={t.micro_batch // 2}",
                lambda c: setattr(c.train, "micro_batch", t.micro_batch // 2))
    if p.dp % 2 == 0:
        variant(f"parallel.tp={p.tp * 2} (dp {p.dp // 2})", lambda c: (setattr(c.parallel, "tp", p.tp * 2),
                                                                       setattr(c.parallel, "dp", p.dp // 2)))
        variant(f"parallel.pp={p.pp * 2} (dp {p.dp // 2})", lambda c: (setattr(c.parallel, "pp", p.pp * 2),
                                                                       setattr(c.parallel, "dp", p.dp // 2)))
        variant(f"parallel.cp={p.cp * 2} (dp {p.dp // 2})", lambda c: (setattr(c.parallel, "cp", p.cp * 2),
                                                                       setattr(c.parallel, "dp", p.dp // 2)))
    return out


def check_fits(cfg: Config, device: torch.device, rank: int, local_rank: int, local_world: int,
               available: Optional[int] = None) -> None:
    """Refuse, in one line, a run whose planned memory on this device exceeds what is free (or that would build
    more layers on a rank than a run can hold as modules)."""
    p = cfg.parallel
    per_rank = -(-cfg.model.layers // (p.pp * p.virtual_stages)) * p.virtual_stages
    if per_rank > MAX_LAYERS_PER_RANK:
        raise UserError(f"{cfg.source}: model.layers={cfg.model.layers} puts up to {per_rank:,} layers on a rank "
                        f"(parallel.pp={p.pp}); a run builds at most {MAX_LAYERS_PER_RANK} per rank: more "
                        f"pipeline stages, or --dry-run to plan it")
    first = rank - local_rank  # the node's first rank: a CPU host holds all of its node's ranks
    ranks = range(rank, rank + 1) if device.type == "cuda" else range(first, first + local_world)
    need = needed_bytes(cfg, ranks, device.type)
    have = available_bytes(device) if available is None else available
    if need <= have:
        return
    helps = []
    for label, c in _variants(cfg):
        try:
            validate(c)
            if needed_bytes(c, ranks, device.type) <= have:
                helps.append(label)
        except (UserError, ValueError, AssertionError):
            continue
    where = f"{device}" if device.type == "cuda" else f"this host ({len(ranks)} process{'es' * (len(ranks) > 1)})"
    offload = "" if OPTIMIZERS[cfg.optim.name].device_only else ", offload (zero.offload_optimizer=cpu)"
    advice = f"fits with any of: {', '.join(helps)}" if helps else \
        f"no single knob fits; more ranks{offload} or a smaller model"
    raise UserError(f"{cfg.source}: the plan needs at least {need / GB:.2f} GB on {where} but {have / GB:.2f} GB "
                    f"is free (--dry-run shows the plan); {advice}")
