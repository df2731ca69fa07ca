"""Convergence of the optimizers on the tiny model: AdamW, Muon and LAMB, each at a few learning rates, the same
data, seed and steps; the final losses at each one's best learning rate.

configs/tiny.yaml (4 layers, hidden 192, seq 128, the built-in corpus) on one process in fp32, ``--steps``
steps (300) of 16 sequences, warm-up 20 and cosine decay to a tenth. Muon's AdamW part (embeddings, head,
vectors) runs at AdamW's best learning rate of the same sweep. The figure per run is the validation loss at
the last step (``--eval-batches`` batches of the held-out split) and the mean training loss of the last 20
steps.

    python bench/convergence.py [--steps 300] [--optimizers adamw,muon[,lamb]] [--lrs "muon=0.005,0.01"]
                                [--adamw-lr LR] [--out DIR]

Prints a markdown table per optimizer and learning rate, then each optimizer's best, and Muon's and LAMB's
best against AdamW's. Not a test: nothing here asserts.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

LRS = {"adamw": (1e-3, 2e-3, 4e-3), "muon": (5e-3, 1e-2, 2e-2), "lamb": (5e-3, 1e-2, 2e-2)}


def train(folder: Path, cache: Path, optimizer: str, lr: float, steps: int, eval_batches: int,
          adamw_lr: float = 0.0) -> dict:
    """One run; its final validation loss, last-20-step mean training loss and seconds."""
    from megazero.train.run import run

    overrides = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false",
                 "train.precision=fp32", "zero.stage=0", f"train.steps={steps}", f"train.lr={lr}",
                 f"train.min_lr={lr / 10}", f"train.eval_every={steps}", f"train.eval_batches={eval_batches}",
                 "train.save_every=0", "log.tensorboard=false", "log.every=1", f"log.dir={folder}",
                 f"data.cache_dir={cache}", f"optim.name={optimizer}"]
    if optimizer == "muon" and adamw_lr:
        overrides.append(f"optim.adamw_lr={adamw_lr}")
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        records = run(os.path.join(ROOT, "configs", "tiny.yaml"), overrides)
    train_losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"val": val[-1] if val else float("nan"), "train": statistics.mean(train_losses[-20:]),
            "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--out", default="", help="folder for the runs (default: a temporary one)")
    ap.add_argument("--lrs", default="", help="learning rates to run instead, e.g. muon=0.005,0.01")
    ap.add_argument("--adamw-lr", type=float, default=0.0,
                    help="Muon's AdamW part when adamw is not in the run (default: adamw's best of the run)")
    args = ap.parse_args()
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="convergence-"))
    cache = base / "cache"
    results: dict[str, dict[float, dict]] = {}
    print(f"### Convergence, configs/tiny.yaml, one process, fp32, {args.steps} steps of 16 x 128 tokens", flush=True)
    print("", "| optimizer | lr | val loss | train loss (last 20) | s |", "|---|---:|---:|---:|---:|",
          sep="\n", flush=True)
    lrs = dict(LRS)
    for item in filter(None, args.lrs.split(";")):
        name, values = item.split("=")
        lrs[name] = tuple(float(v) for v in values.split(","))
    for optimizer in args.optimizers.split(","):
        adamw_best = min(results["adamw"], key=lambda lr: results["adamw"][lr]["val"]) if "adamw" in results \
            else args.adamw_lr
        results[optimizer] = {}
        for lr in lrs[optimizer]:
            r = train(base / f"{optimizer}_{lr:g}", cache, optimizer, lr, args.steps, args.eval_batches, adamw_best)
            results[optimizer][lr] = r
            print(f"| {optimizer} | {lr:g} | {r['val']:.4f} | {r['train']:.4f} | {r['seconds']:.0f} |", flush=True)
    print("")
    best = {o: min(rs.items(), key=lambda kv: kv[1]["val"]) for o, rs in results.items()}
    for o, (lr, r) in best.items():
        print(f"- {o}: best lr {lr:g}, val loss {r['val']:.4f}, train loss {r['train']:.4f}", flush=True)
    if "adamw" in best:
        ref = best["adamw"][1]["val"]
        for o, (_, r) in best.items():
            if o != "adamw":
                print(f"- {o} / adamw, best val loss: {r['val'] / ref:.4f} ({(r['val'] - ref) / ref:+.2%})", flush=True)


if __name__ == "__main__":
    main()
