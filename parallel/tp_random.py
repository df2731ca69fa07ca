"""Megatron's tensor-parallel random streams (Shoeybi et al. 2019, §3): dropout on tensors split over tp.

Dropout on activations replicated over tp uses the default generator, seeded identically on every tp rank;
dropout on sequence-parallel shards draws from a per-rank stream, replayed under activation checkpointing.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _get_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TPRandom:
    """A second random stream, different on every tp rank (Megatron's RNG tracker).

    Dropout on activations replicated over tp uses the default generator,
    seeded identically on every rank of the tp group, so the replicas stay
    identical. Dropout on tensors that are split over tp (sequence-parallel
    activations) runs inside ``fork()``, which swaps in this rank's own stream.
    Under activation checkpointing, ``checkpoint_contexts`` replays the
    stream so recomputation draws the same masks.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.state: Optional[Tensor] = None

    def seed(self, seed: int) -> None:
        outer = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.state = _get_state(self.device)
        _set_state(outer, self.device)

    @contextlib.contextmanager
    def fork(self):
        if self.state is None:
            self.seed(0)
        outer = _get_state(self.device)
        _set_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(outer, self.device)

    def checkpoint_contexts(self):
        """``context_fn`` for torch.utils.checkpoint: recomputation restarts from the forward's stream."""
        snapshot: dict[str, Tensor] = {}
        tracker = self

        @contextlib.contextmanager
        def forward():
            # the state tensor is replaced, never written in place, so holding it is a snapshot (no clone: a
            # clone under --simulate's fake tensors would hold no bytes to restore)
            snapshot["state"] = tracker.state
            yield

        return forward(), _Replay(tracker, snapshot)


class _Replay:
    """Recomputation restarts from the forward's stream; re-enterable, as a split backward (zb1p) recomputes a
    checkpointed layer twice: for the input gradient and again for the weight gradient."""

    def __init__(self, tracker: "TPRandom", snapshot: dict):
        self.tracker, self.snapshot, self.after = tracker, snapshot, None

    def __enter__(self) -> None:
        self.after = self.tracker.state
        self.tracker.state = self.snapshot["state"]

    def __exit__(self, *exc) -> None:
        self.tracker.state = self.after


class ShardedDropout(nn.Module):
    """Dropout whose input is split over tp: masks come from the per-rank stream when split."""

    def __init__(self, p: float, rng: Optional[TPRandom], split: bool):
        super().__init__()
        self.p, self.rng, self.split = p, rng, split

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.split and self.rng is not None:
            with self.rng.fork():
                return F.dropout(x, self.p, True)
        return F.dropout(x, self.p, True)
