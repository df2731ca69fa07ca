"""Stragglers: on each logged step every rank's compute time is gathered, and the slowest named.

A rank's compute time is its step less its waits on communication (``parallel.step_clock``), averaged over the
steps since the last log. A slow rank makes its peers wait, so their step times equal its own; their compute
times do not. One all-gather of one number per rank, on logged steps only (Megatron-LM's straggler detector
reports per-rank times the same way). A rank above ``train.straggler_ratio`` x the median for
``train.straggler_logs`` logs in a row is named in a warning line.
"""
from __future__ import annotations

import statistics
from typing import Optional

import torch

from megazero.parallel.comm import Comm


class StragglerWatch:
    def __init__(self, world: Comm, ratio: float, logs: int, device: torch.device):
        self.world, self.ratio, self.logs, self.device = world, ratio, logs, device
        self.suspect: Optional[int] = None  # the rank above the ratio at the last logs, and for how many
        self.in_a_row = 0

    def observe(self, compute_s: float) -> tuple[dict, Optional[str]]:
        """Every rank's compute seconds per step (this rank's ``compute_s``) compared: the record's figures, and
        the warning line when a rank has stayed above the ratio for ``logs`` logs (None otherwise). A
        collective over every rank."""
        if self.world.size == 1:  # the same figures at any layout; nothing to gather
            values = [compute_s]
        else:
            times = self.world.all_gather(torch.tensor([compute_s], dtype=torch.float64, device=self.device), 0)
            values = times.tolist()
        median = statistics.median(values)
        slowest = max(range(len(values)), key=values.__getitem__)
        ratio = values[slowest] / median if median > 0 else 1.0
        record = {"straggler/slowest_rank": slowest, "straggler/ratio": ratio, "straggler/median_s": median}
        if ratio > self.ratio:
            self.in_a_row = self.in_a_row + 1 if slowest == self.suspect else 1
            self.suspect = slowest
        else:
            self.suspect, self.in_a_row = None, 0
        if self.in_a_row != self.logs:  # named once per streak, when it reaches the count
            return record, None
        record["straggler/named"] = slowest
        return record, (f"warning: rank {slowest} is a straggler: its compute time per step ({values[slowest]:.4g} "
                        f"s) has been {ratio:.2f}x the ranks' median ({median:.4g} s) for {self.logs} logs in a "
                        f"row (train.straggler_ratio={self.ratio:g})")
