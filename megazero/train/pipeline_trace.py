"""The Chrome-trace/Perfetto file of a step: every rank's pipeline timeline in one file (pid = rank)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megazero.disk import replace_text, write_refusal
from megazero.errors import UserError
from megazero.parallel.pipeline import PipelineExecutor
from megazero.parallel.topology import Grid


def write_pipeline_trace(executor: PipelineExecutor, grid: Grid, log_dir: str, trace: list, origin: object) -> None:
    """Gather every rank's events of one executor run (``trace``, ``origin``: as the executor recorded them)
    and write log_dir/pipeline_trace.json on rank 0. Collective: every rank calls it."""
    events = executor.chrome_trace(grid.rank, trace, origin)
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, events)
        events = [e for rank_events in gathered for e in rank_events]
    if grid.rank == 0:
        path = Path(log_dir) / "pipeline_trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        names = [{"name": "process_name", "ph": "M", "pid": r,
                  "args": {"name": f"rank {r} (pp {r // (grid.dp * grid.cp * grid.tp)})"}}
                 for r in range(grid.world_size)]
        text = json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"})
        try:
            replace_text(path, text)
        except OSError as e:  # a full disk: one line, and no cut-short file left
            reason = write_refusal(e, path, path.parent, len(text.encode())) or f"cannot write it ({e})"
            raise UserError(f"log.pipeline_trace {path}: {reason}") from None
