"""``pretrain.py --simulate``: every rank class simulated (``megazero.plan.simulate``), extrapolated from
smaller steps where exact (``megazero.plan.extrapolate``), printed and written to log.dir/simulate.json."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from megazero.config.schema import Config
from megazero.errors import UserError
from megazero.plan.extrapolate import simulate_class
from megazero.plan.simulate import (DOES_NOT_FIT, GB, STEPS, format_result, memory_limit, rank_classes,
                                    simulate_rank)
from megazero.plan.stage_plan import make_plan


def plan_stage(cfg: Config, rank: int) -> int:
    """The pipeline stage a rank runs."""
    from megazero.parallel.dims import ParallelDims

    p = cfg.parallel
    return ParallelDims.of(p).coords(rank).pp


def run_simulation(cfg: Config, full: bool = False) -> int:
    """``pretrain.py --simulate`` of a config resolved for the CPU (megazero.train.run.simulate_run): every rank
    class's figures printed and written to log.dir/simulate.json; 0 when all fit in launch.memory_gb,
    ``DOES_NOT_FIT`` otherwise. Extrapolated from smaller steps where that is exact (megazero.plan.extrapolate)
    unless ``full`` (``--simulate full``): every layer and microbatch simulated."""
    plan = make_plan(cfg)
    limit = memory_limit(cfg)
    out = Path(cfg.log.dir) / "simulate.json"
    if out.is_symlink() or (out.exists() and not out.is_file()):  # written in place: never through a link
        raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} holds simulate.json, which is not a plain file; "
                        f"move it away or choose another log.dir")
    p = cfg.parallel
    cp = f" x cp {p.cp} ({p.cp_mode})" if p.cp > 1 else ""
    print(f"simulating {cfg.source}: world {p.tp * p.pp * p.dp * p.cp} = tp {p.tp} x pp {p.pp} x dp {p.dp}{cp}, "
          f"ZeRO stage {cfg.zero.stage}, {p.schedule}, {cfg.microbatches} microbatches, {STEPS} steps per rank, on "
          f"fake tensors and the fake process group" + ("" if full else "; extrapolated from fewer layers, "
                                                    "microbatches, experts and ring steps where exact (--simulate full: every one)"),
          flush=True)
    start = time.perf_counter()
    results = []
    classes = rank_classes(cfg)
    for n, rank in enumerate(classes, 1):
        say = lambda text: print(text, flush=True)  # noqa: E731
        say(f"rank class {n} of {len(classes)}: rank {rank} (pipeline stage {plan_stage(cfg, rank)}), after "
            f"{time.perf_counter() - start:.0f} s")
        r = (simulate_rank(cfg, rank, plan, lambda text: say(f"    rank {rank}: {text}"), sampled_rings=False) if full else
             simulate_class(cfg, rank, plan, say, say))
        r.fits = r.peak_bytes <= limit
        results.append(r)
        print("\n".join(format_result(r, limit)), flush=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": cfg.source, "memory_bytes": limit,
                                   "ranks": [asdict(r) for r in results]}, indent=1))
    except OSError as e:
        raise UserError(f"{cfg.source}: log.dir={cfg.log.dir!r} is invalid; cannot write simulate.json "
                        f"({e.strerror})") from None
    fits = all(r.fits for r in results)
    print(f"simulated {len(results)} rank class(es) in {time.perf_counter() - start:.1f} s; "
          f"{'every one fits' if fits else 'some do not fit'} in {limit / GB:.2f} GB; figures in {out}", flush=True)
    return 0 if fits else DOES_NOT_FIT
