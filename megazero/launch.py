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


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login1") as host names."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(\[([^\]]*)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(3)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + part)
    return hosts


def process_info(env: dict | None = None) -> ProcessInfo:
    """Rank and world size from torchrun's or Slurm's variables; world size 1 when neither is set."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                           env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", 0)) % 10000))
        return ProcessInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                           env.get("MASTER_ADDR", nodes[0] if nodes else "127.0.0.1"), port, "slurm")
    return ProcessInfo(0, 1, 0, "127.0.0.1", 29500, "single")


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


def init_distributed(info: ProcessInfo, device: torch.device) -> bool:
    """Join the default process group; False when none was needed (world size 1) or one already exists."""
    if info.world_size == 1 or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                            rank=info.rank, world_size=info.world_size,
                            timeout=timedelta(minutes=30), **kwargs)
    return True


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
