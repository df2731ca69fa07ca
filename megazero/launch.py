"""Process-group start-up from whatever started us: torchrun, Slurm's srun, or a plain `python`.

torch.distributed is the engine; this file only reads the environment the
launcher left, picks NCCL+CUDA when there are GPUs and gloo+CPU otherwise,
and seeds.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megazero.errors import UserError


@dataclass
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | single


_MAX_PORT = 65535
_MAX_WORLD = 1 << 20  # a million ranks: beyond any cluster, below anything that overflows


def _env_int(env: dict, name: str, low: int, high: int, default: int | None = None) -> int:
    """An integer the launcher set, checked: a garbled variable is one line naming it, not a traceback."""
    raw = env.get(name)
    if raw is None:
        assert default is not None, name
        return default
    text = str(raw).strip()
    value = int(text) if text.lstrip("+-").isdigit() and len(text) < 20 else None
    if value is None or not low <= value <= high:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise UserError(f"environment variable {name}={shown!r} is invalid; expected an integer in [{low}, {high}] "
                        f"(set by torchrun or srun)")
    return value


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login1") as host names."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(\[([^\]]*)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(3)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) - int(lo) > _MAX_WORLD:
                raise UserError(f"environment variable SLURM_JOB_NODELIST={nodelist[:60]!r} is invalid; expected "
                                f"Slurm's host list, e.g. gpu[01-04,07],login1")
            if hi:
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + part)
    return hosts


def process_info(env: dict | None = None) -> ProcessInfo:
    """Rank and world size from torchrun's or Slurm's variables; world size 1 when neither is set."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _env_int(env, "WORLD_SIZE", 1, _MAX_WORLD)
        return ProcessInfo(_env_int(env, "RANK", 0, world - 1), world, _env_int(env, "LOCAL_RANK", 0, world - 1, 0),
                           env.get("MASTER_ADDR", "127.0.0.1"), _env_int(env, "MASTER_PORT", 1, _MAX_PORT, 29500),
                           "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _env_int(env, "SLURM_NTASKS", 1, _MAX_WORLD)
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
        job = _env_int(env, "SLURM_JOB_ID", 0, 2 ** 63 - 1, 0)
        port = _env_int(env, "MASTER_PORT", 1, _MAX_PORT, 20000 + job % 10000)
        return ProcessInfo(_env_int(env, "SLURM_PROCID", 0, world - 1), world,
                           _env_int(env, "SLURM_LOCALID", 0, world - 1, 0),
                           env.get("MASTER_ADDR", nodes[0] if nodes else "127.0.0.1"), port, "slurm")
    return ProcessInfo(0, 1, 0, "127.0.0.1", 29500, "single")


def local_world_size(env: dict | None = None) -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node), 1 when unset."""
    env = dict(os.environ) if env is None else env
    if "LOCAL_WORLD_SIZE" in env:
        return _env_int(env, "LOCAL_WORLD_SIZE", 1, _MAX_WORLD)
    return 1


def pick_device(requested: str, local_rank: int, local_world: int = 1) -> torch.device:
    """auto: one GPU per local rank when there are enough of them, else the CPU (gloo)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and gpus < local_world):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"launch.device={requested!r} but no CUDA device is visible; valid here: auto | cpu")
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); a single visible GPU is fine when the launcher
    # bound one to each task (srun --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES per task)
    if gpus < local_world and (gpus > 1 or "CUDA_VISIBLE_DEVICES" not in os.environ):
        raise UserError(f"launch.device={requested!r} with {local_world} processes on this node but {gpus} GPUs "
                        f"visible: one process per GPU (torchrun --nproc-per-node {gpus}); valid here: auto | cpu")
    # one visible GPU: this process's own when the launcher binds a GPU per task (srun --gpus-per-task=1)
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    return device


def init_distributed(info: ProcessInfo, device: torch.device, timeout_minutes: float = 30.0,
                     trace_dir: Optional[str] = None) -> bool:
    """Join the default process group; False when none was needed (world size 1) or one already exists.

    ``timeout_minutes`` bounds every collective (launch.timeout_minutes): a rank that stops taking part ends
    the job then, instead of leaving the others waiting for ever. On NCCL, torch's flight recorder keeps the
    last collectives and dumps them on a timeout into ``trace_dir`` (``nccl_trace_rank_<r>``, beside
    megazero.hang's records); what the environment sets already stays."""
    if info.world_size == 1 or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and trace_dir is not None:
        os.makedirs(trace_dir, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # newer and older torch
            os.environ.setdefault(name, os.path.join(trace_dir, "nccl_trace_rank_"))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(minutes=timeout_minutes)
    # Under torchrun the agent hosts the store and keeps it across restarts (--max-restarts): without a prefix of
    # its own, a restarted worker reads the addresses the previous attempt's workers left there and connects to
    # processes that are gone. Each attempt gets its own key space (its restart count, the same on every worker).
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                          is_master=info.rank == 0 and not agent_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"megazero/attempt_{attempt}", store),
                            rank=info.rank, world_size=info.world_size, timeout=timeout, **kwargs)
    return True


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
