"""Fit the step-time model's constants to published throughput and show how well it predicts (docs/planner.md).

    python bench/planner.py          # fit, print constants, per-row predictions, held-back rows, memory
    python bench/planner.py --check  # no fit: the defaults of megazero.plan.step_time.Constants

The rows (megazero.plan.published) are the issue's nine: Narayanan et al. 2021 Table 1 on A100 (5) and the
Megatron-Core H100 README (4); the other five rows of Narayanan's Table 1 are held back and only predicted.
The fit is a coordinate search over a log grid per constant (numpy only), minimising the largest
|log(predicted / published)| over the named rows, ties broken by the sum of squares. Each row's config and
plan are made once (megazero.plan.step_time accepts the plan), so the fit runs in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megazero.plan.stage_plan import make_plan  # noqa: E402
from megazero.plan.published import MEMORY_MARGIN, cluster_of, predict, row_config, rows  # noqa: E402
from megazero.plan.step_time import Constants  # noqa: E402

# (low, high) of each fitted constant: the physically possible range
BOUNDS = {"e_max": (0.3, 1.0), "x_half": (0.01, 10.0), "hbm_passes": (0.5, 40.0), "comm_eff": (0.2, 1.0),
          "tp_hidden": (0.0, 1.0)}


START = Constants(e_max=0.6, x_half=1.0, hbm_passes=4.0, comm_eff=0.7, tp_hidden=0.75)


def prepared(rows):
    return [(r, *(lambda cfg: (cfg, make_plan(cfg)))(row_config(r)), cluster_of(r.source)) for r in rows]


def residuals(c: Constants, prep) -> np.ndarray:
    return np.array([math.log(predict(r, c, cfg, plan, cluster)[0] / r.tflops) for r, cfg, plan, cluster in prep])


def loss(c: Constants, prep) -> tuple[float, float]:
    res = residuals(c, prep)
    return float(np.max(np.abs(res))), float(np.sum(res ** 2))


def _clip(name: str, v: float) -> float:
    lo, hi = BOUNDS[name]
    return float(min(hi, max(lo, v)))


def fit(prep, start: Constants, samples: int = 1500, steps: int = 2500, seed: int = 0) -> Constants:
    """Random starts over the bounds (log-uniform; uniform for tp_hidden), then a joint random walk from the
    best that keeps only improvements and narrows its steps: the loss (a maximum) has kinks, where moving
    one constant at a time stalls."""
    rng = np.random.default_rng(seed)
    best, best_loss = start, loss(start, prep)
    for _ in range(samples):
        draw = {n: (rng.uniform(lo, hi) if n == "tp_hidden" else math.exp(rng.uniform(math.log(lo), math.log(hi))))
                for n, (lo, hi) in BOUNDS.items()}
        c = dataclasses.replace(best, **draw)
        got = loss(c, prep)
        if got < best_loss:
            best, best_loss = c, got
    for i in range(steps):
        scale = 0.3 * (0.02 / 0.3) ** (i / steps)  # from 30% steps down to 2%
        move = {n: _clip(n, getattr(best, n) + scale * rng.normal()) if n == "tp_hidden"
                else _clip(n, getattr(best, n) * math.exp(scale * rng.normal())) for n in BOUNDS}
        c = dataclasses.replace(best, **move)
        got = loss(c, prep)
        if got < best_loss:
            best, best_loss = c, got
    return best


def table(title: str, rows, c: Constants) -> None:
    print(f"\n{title}")
    print(f"  {'row':10s} {'tp':>3s} {'pp':>3s} {'v':>2s} {'dp':>4s} {'mb':>3s} {'recompute':>9s} "
          f"{'published':>9s} {'predicted':>9s} {'ratio':>6s}  {'step s':>7s}  terms (s): compute elementwise "
          f"recompute tp bubble p2p dp optimizer")
    for r in rows:
        pred, st, cfg = predict(r, c)
        p, m = cfg.parallel, cfg.model
        rc = ("full" if not m.checkpoint_layers else f"{m.checkpoint_layers}/chunk") if m.activation_checkpointing \
            else "none"
        print(f"  {r.name:10s} {p.tp:3d} {p.pp:3d} {p.virtual_stages:2d} {p.dp:4d} {cfg.train.micro_batch:3d} "
              f"{rc:>9s} {r.tflops:9.1f} {pred:9.1f} {pred / r.tflops:6.3f}  {st.total:7.3f}  "
              f"{st.compute:.3f} {st.elementwise:.3f} {st.recompute:.3f} {st.tp_comm:.3f} {st.bubble:.3f} "
              f"{st.p2p:.3f} {st.dp_comm:.3f} {st.optimizer:.4f}")


def memory(c: Constants) -> None:
    print(f"\nMemory of the published layouts by the plan (largest rank; fits when <= {MEMORY_MARGIN:.0%} of the GPU)")
    for r in rows():
        _, st, cfg = predict(r, c)
        gpu = cluster_of(r.source).memory_gb
        ok = st.memory_bytes <= gpu * 1e9 * MEMORY_MARGIN
        print(f"  {r.name:10s} {st.memory_bytes / 1e9:6.1f} GB of {gpu:.0f} GB  {'fits' if ok else 'DOES NOT FIT'}"
              f"{'' if r.named else '  (held back)'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="no fit: report megazero.plan.step_time's defaults")
    ap.add_argument("--no-search", action="store_true", help="skip the planner's search per named model")
    ap.add_argument("--simulate", action="store_true",
                    help="also run each top layout through pretrain.py --simulate (one rank per stage, fake "
                         "tensors; ~10 min for the nine, 7 of them the 1008B model's eight stages)")
    args = ap.parse_args()
    t0 = time.time()
    prep = prepared(rows(named=True))
    c = Constants()
    if not args.check:  # from a fixed, unfitted start, so the printed fit does not depend on the defaults
        c = fit(prep, START)
    worst, sq = loss(c, prep)
    print(("Defaults" if args.check else "Fitted constants") + f" (max |log ratio| {worst:.4f}, "
          f"{math.exp(worst) - 1:+.1%} at worst; sum of squares {sq:.4f}):")
    for f in dataclasses.fields(Constants):
        if f.name in BOUNDS:
            print(f"  {f.name:11s} = {getattr(c, f.name):.4g}")
    table("Named rows (fitted)", rows(named=True), c)
    table("Held-back rows (not fitted)", rows(named=False), c)
    memory(c)
    named_ok = all(abs(math.log(predict(r, c)[0] / r.tflops)) <= math.log(1.1) for r in rows(named=True))
    print(f"\nevery named row within ±10%: {'yes' if named_ok else 'NO'}   ({time.time() - t0:.1f} s)")
    search_ok = True if args.no_search else searches(c, args.simulate)
    return 0 if named_ok and search_ok else 1


def simulate(base, layout, gpus: int, memory_gb: float) -> str:
    """The top layout through ``pretrain.py --simulate``: its own words for each stage's peak, and whether
    every stage fits in the GPU's memory."""
    import subprocess
    import tempfile

    from megazero.plan.cli import write_config

    with tempfile.TemporaryDirectory(prefix="plan-sim-") as tmp:
        path = str(Path(tmp) / "top.yaml")
        write_config(base, layout, gpus, path)
        out = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--config", path, "--simulate",
                              "--set", f"launch.memory_gb={memory_gb}", "--set", f"parallel.world_size={gpus}",
                              "--set", f"log.dir={tmp}/log"], capture_output=True, text=True, cwd=ROOT)
    peaks = [line.split("peak ")[1].split(" GB")[0] for line in out.stdout.splitlines() if line.startswith("rank ")]
    return f"simulated peaks {', '.join(peaks)} GB: " + ("fits" if out.returncode == 0 else f"exit {out.returncode}")


def searches(c: Constants, run_simulation: bool = False) -> bool:
    """The issue's search check: given only each named model, its GPU count, batch and cluster, the planner's
    top layout is predicted at least as fast as the published layout, and fits by the dry-run plan."""
    from megazero.plan.search import search

    print("\nSearch: the planner's top layout per named model (its GPUs, batch and cluster only) against the "
          "published layout, both predicted by the fitted model")
    print(f"  {'row':10s} {'published layout':34s} {'step s':>8s}  {'top layout':44s} {'step s':>8s} "
          f"{'GB':>6s} {'ratio':>6s}  search s")
    ok = True
    for row in rows(named=True):
        t0 = time.time()
        published = predict(row, c)[1]
        base = row_config(row)
        row_c = dataclasses.replace(c, materialised_scores=row.source == "narayanan")
        found = search(base, cluster_of(row.source), row.gpus, {}, row_c)
        top = found.ranked[0]
        fits = top.memory_gb <= cluster_of(row.source).memory_gb * MEMORY_MARGIN
        good = fits and top.step_s <= published.total * (1 + 1e-9)
        ok &= good
        pub = f"tp{row.tp} pp{row.pp} v{row.virtual} mb{base.train.micro_batch}"
        print(f"  {row.name:10s} {pub:34s} {published.total:8.3f}  {top.layout.label():44s} {top.step_s:8.3f} "
              f"{top.memory_gb:6.1f} {top.step_s / published.total:6.3f}  {time.time() - t0:6.1f}"
              + ("" if good else "  <-- slower than published or over memory"), flush=True)
        if run_simulation:
            said = simulate(base, top.layout, row.gpus, cluster_of(row.source).memory_gb)
            ok &= said.endswith("fits")
            print(f"  {'':10s} {said}", flush=True)
    print(f"top layout at least as fast as the published one, and fitting, for every named model: "
          f"{'yes' if ok else 'NO'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
