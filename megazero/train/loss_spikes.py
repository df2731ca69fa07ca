"""Loss spikes (``train.on_spike``): a step's loss far above the recent ones stops the run, or rolls it back.

A spike is a loss more than ``train.spike_z`` standard deviations above the mean of the last
``train.spike_window`` finite losses (none is judged until the window is full; a spike does not enter it).
``rollback`` follows PaLM (Chowdhery et al. 2022, section 5.1): restart from a checkpoint from before the spike
and skip the data batches that led into it. Here: the newest checkpoint at or before step spike - window, every
global batch after it through the spike skipped (the run's sample offset moves past them, so a resume skips them
too), at most ``train.max_rollbacks`` times in a run. The loss judged is the global batch's, agreed by every
rank in the step's own all-reduce (``megazero.engine.step``): every rank decides alike, at any layout.
The window, the rollbacks made and the batches skipped live in each checkpoint's meta.json: a resumed run judges
the next steps as the uninterrupted one would.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megazero.checkpoint.store import checkpoint_run_id, list_checkpoints
from megazero.errors import LossSpikeStop


@dataclass
class Spike:
    step: int
    loss: float
    z: float  # standard deviations above the window's mean
    mean: float
    std: float

    def describe(self, window: int) -> str:
        return (f"step {self.step}: loss {self.loss:.4f} is {self.z:.1f} standard deviations above the last "
                f"{window} steps' mean {self.mean:.4f} (std {self.std:.4f})")


class SpikeWatch:
    """The window of recent losses, and what a spike does (``train.on_spike``: none | stop | rollback)."""

    def __init__(self, policy: str, window: int, z: float, max_rollbacks: int):
        self.policy, self.z, self.max_rollbacks = policy, z, max_rollbacks
        self.losses: deque = deque(maxlen=window)
        self.rollbacks = 0  # made in this run, resumes included
        self.skipped_batches = 0  # global batches skipped by them

    @property
    def active(self) -> bool:
        return self.policy != "none"

    def check(self, step: int, loss: float) -> Optional[Spike]:
        """The spike this step's loss is, or None (and the loss joins the window). Non-finite losses are
        ``train.on_nonfinite``'s: not judged, not kept."""
        if not math.isfinite(loss):
            return None
        n = len(self.losses)
        if n == self.losses.maxlen:
            mean = math.fsum(self.losses) / n
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.losses) / (n - 1))
            z = (loss - mean) / std if std > 0 else (math.inf if loss > mean else 0.0)
            if z > self.z:
                return Spike(step, loss, z, mean, std)
        self.losses.append(loss)
        return None

    def stop_or_target(self, spike: Spike, ckpt_root: Path, run_id: str) -> Path:
        """The checkpoint to roll back to, or the one-line stop (exit 3) when the policy, the rollbacks left or
        the checkpoints kept allow none. Nothing is saved either way: the spike's update is in the state."""
        said = spike.describe(self.losses.maxlen)
        if self.policy == "stop":
            raise LossSpikeStop(f"{said} (train.spike_z={self.z:g}); stopped before saving "
                                f"(train.on_spike=rollback would roll back and skip the batches)")
        if self.rollbacks >= self.max_rollbacks:
            raise LossSpikeStop(f"{said}; train.max_rollbacks={self.max_rollbacks} rollbacks already made, so "
                                f"the run stops before saving")
        limit = spike.step - self.losses.maxlen
        target = rollback_target(ckpt_root, run_id, limit)
        if target is None:
            raise LossSpikeStop(f"{said}; no checkpoint of this run at or before step {limit} (the spike's window) "
                                f"is left to roll back to in {ckpt_root}; stopped before saving")
        return target

    def decide(self, spike: Spike, ckpt_root: Path, run_id: str, rank: int) -> Path:
        """``stop_or_target`` as rank 0 finds it, for every rank alike (a collective under torch.distributed):
        no rank waits in a broadcast the others skipped because its listing of the folder differed."""
        decided: list = [None]
        if rank == 0:
            try:
                decided[0] = self.stop_or_target(spike, ckpt_root, run_id)
            except LossSpikeStop as e:
                decided[0] = e
        if dist.is_initialized():
            dist.broadcast_object_list(decided, src=0)
        if isinstance(decided[0], LossSpikeStop):
            raise decided[0]
        return decided[0]

    def rolled_back(self, spike: Spike, to_step: int) -> str:
        """Count a rollback from the spike to checkpoint ``to_step``; the line that reports it."""
        self.rollbacks += 1
        skipped = spike.step - to_step
        self.skipped_batches += skipped
        return (f"{spike.describe(self.losses.maxlen)}; rolled back to step {to_step} and skipped the global "
                f"batches of steps {to_step + 1}-{spike.step} ({skipped}; rollback {self.rollbacks} of "
                f"train.max_rollbacks={self.max_rollbacks})")

    # ----- in each checkpoint's meta.json -----------------------------------------------------
    def meta(self) -> dict:
        return {"loss_window": list(self.losses), "rollbacks": self.rollbacks,
                "skipped_batches": self.skipped_batches}

    def restore(self, meta: dict) -> None:
        """From a checkpoint's meta (checked by ``megazero.checkpoint.meta``); an older one holds none."""
        self.losses.clear()
        self.losses.extend(meta.get("loss_window", [])[-self.losses.maxlen:])
        self.rollbacks = meta.get("rollbacks", 0)
        self.skipped_batches = meta.get("skipped_batches", 0)


def rollback_target(ckpt_root: Path, run_id: str, limit: int) -> Optional[Path]:
    """The newest checkpoint at or before step ``limit`` on the line that led here: this run's (``run_id``),
    and none that a later save of a lower step abandoned (a rollback's, or a resume's from an older one):
    walking back from the checkpoint written last, each kept one is of a lower step than all kept after it."""
    line, lowest = [], None
    for path in reversed(list_checkpoints(ckpt_root)):  # newest written first
        if checkpoint_run_id(path) != run_id:
            continue
        step = int(path.name[5:13])  # step_ + 8 digits (+ .tmp suffixes): list_checkpoints' names
        if lowest is None or step < lowest:
            line.append((step, path))
            lowest = step
    return max(((s, p) for s, p in line if s <= limit), default=(None, None))[1]
