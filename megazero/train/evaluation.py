"""Evaluation: the validation loss of each data source, over the forward-only schedule."""
from __future__ import annotations

import math

import torch

from megazero.config.schema import Config
from megazero.engine.build import Engine
from megazero.parallel.host import host_values
from megazero.parallel.topology import Grid


@torch.no_grad()
def evaluate(engine: Engine, data, cfg: Config, grid: Grid, device: torch.device) -> dict:
    """val_loss (the token-weighted mean over sources), val_ppl and, with several sources, val_loss/<name>;
    on the last pipeline stage (elsewhere: {})."""
    for m in engine.chunks:
        m.eval()
    # one source: its validation batches; several: each source's own, eval_batches of them each
    names = data.source_names  # a source too small to hold validation samples is only trained on
    sources = [None] if len(names) == 1 else [k for k in range(len(names)) if data.samples.val_sizes[k]]
    totals = torch.zeros(len(sources), device=device)
    engine.zero.gather_root()
    for i, source in enumerate(sources):
        for b in range(cfg.train.eval_batches):
            microbatches = data.val_microbatches(b, grid.dp_rank, grid.dp, cfg.train.micro_batch,
                                                 cfg.train.global_batch, source)
            totals[i] += engine.executor.run(engine.eval_schedule, microbatches, forward_only=True)
    engine.zero.release()
    grid.grad_comm.all_reduce(totals, tag="loss")
    if not grid.is_last_stage:
        return {}
    tokens = engine.tokens_per_step * cfg.train.eval_batches  # per source
    per_source = [v / tokens for v in host_values(totals)]
    val = sum(v * tokens for v in per_source) / (tokens * len(sources))  # token-weighted mean over sources
    record = {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
    if len(sources) > 1:
        record.update({f"val_loss/{names[k]}": v for k, v in zip(sources, per_source)})
    return record
