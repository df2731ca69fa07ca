"""The data on every rank, and each step's random streams: both the same whatever the layout."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from megazero.config.schema import Config
from megazero.data import GPTData, build_data
from megazero.errors import UserError
from megazero.train.signals import StoppedEarly
from megazero.parallel.topology import Grid


def step_seed(seed: int, step: int, *coords: int) -> int:
    """The RNG seed of one step at one place of the grid: dropout masks are a function of
    (seed, step, coordinates), so a resumed run draws exactly the masks the uninterrupted run would have."""
    key = ":".join(str(v) for v in (seed, step, *coords)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def seed_step(seed: int, step: int, grid: Grid, chunks: list[nn.Module]) -> None:
    """Dropout streams of a step: one shared by the tp group, one per tp rank (per model chunk)."""
    torch.manual_seed(step_seed(seed, step, grid.pp_rank, grid.dp_rank))
    for c, m in enumerate(chunks):
        m.rng.seed(step_seed(seed, step, grid.pp_rank, grid.dp_rank, grid.tp_rank, c))


def load_data_everywhere(cfg: Config, grid: Grid, is_builder: bool) -> GPTData:
    """Build the dataset on one rank per node, let the others load it; an input error, or a stop signal while a
    builder works (the others wait for it in a collective, where a signal cannot reach them), stops every rank."""
    m, t = cfg.model, cfg.train

    def noop() -> None:
        pass

    data, error, stopped = None, None, 0
    if is_builder:
        try:
            data = build_data(cfg.data, m.vocab_size, m.seq_len, t.seed, is_builder=True, barrier=noop,
                              train_samples=t.steps * t.global_batch)
        except UserError as e:
            error = str(e)
        except StoppedEarly as e:
            stopped = e.signum
    if dist.is_initialized():
        outcomes: list = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (error, stopped))
        error = next((e for e, _ in outcomes if e), None)
        stopped = max(s for _, s in outcomes)
    if stopped:
        raise StoppedEarly(stopped)
    if error:
        raise UserError(error)
    if data is None:
        data = build_data(cfg.data, m.vocab_size, m.seq_len, t.seed, is_builder=False, barrier=noop)
    return data
