"""Convergence of the optimizers on the tiny model: AdamW, Muon and LAMB, each at a few learning rates, the same
data, seed and steps; the final losses at each one's best learning rate.

configs/tiny.yaml (4 layers, hidden 192, seq 128, the built-in corpus) on one process in fp32, ``--steps``
steps (300) of 16 sequences, warm-up 20 and cosine decay to a tenth. Muon's AdamW part (embeddings, head,
vectors) runs at AdamW's best learning rate of the same sweep. The figure per run is the validation loss at
the last step (``--eval-batches`` batches of the held-out split) and the mean training loss of the last 20
steps.

    python bench/convergence.py [--steps 300] [--optimizers adamw,muon[,lamb,onebit_adam,zero_one_adam,onebit_lamb]]
                                [--lrs "muon=0.005,0.01"] [--adamw-lr LR] [--out DIR] [--dp N] [--freeze-step K]

At dp > 1 each run also gives the bytes the busiest rank sent over the 100 steps after the warm-up (the comm
counter's, ``comm/sent_gb`` in metrics.jsonl; the warm-up is 1-bit Adam's and LAMB's freeze_step, 0/1 Adam's
var_freeze_step, and the same steps for the others; 0/1 Adam's local-step interval doubles every tenth of the run).
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
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

LRS = {"adamw": (1e-3, 2e-3, 4e-3), "muon": (5e-3, 1e-2, 2e-2), "lamb": (5e-3, 1e-2, 2e-2),
       "onebit_adam": (1e-3, 2e-3, 4e-3), "zero_one_adam": (1e-3, 2e-3, 4e-3), "onebit_lamb": (5e-3, 1e-2, 2e-2)}
WINDOW = 100  # the steps after the warm-up whose bytes are compared


def train(folder: Path, cache: Path, optimizer: str, lr: float, steps: int, eval_batches: int,
          adamw_lr: float = 0.0, dp: int = 1, freeze_step: int = 0, local: tuple[int, int, int, str] = (0, 16, 0, "steps")) -> dict:
    """One run; its final validation loss, last-20-step mean training loss and seconds. ``dp`` > 1: that many
    gloo ranks under torchrun (1-bit Adam's compression needs them; AdamW, Muon and LAMB train the same model at
    any dp)."""
    from megazero.train.run import run

    overrides = ["parallel.tp=1", "parallel.pp=1", f"parallel.dp={dp}", "parallel.sequence_parallel=false",
                 "train.precision=fp32", "zero.stage=0", f"train.steps={steps}", f"train.lr={lr}",
                 f"train.min_lr={lr / 10}", f"train.eval_every={steps}", f"train.eval_batches={eval_batches}",
                 "train.save_every=0", "log.tensorboard=false", "log.every=1", f"log.dir={folder}",
                 f"data.cache_dir={cache}", f"optim.name={optimizer}"]
    if optimizer == "muon" and adamw_lr:
        overrides.append(f"optim.muon.adamw_lr={adamw_lr}")
    freeze = freeze_step or steps // 5
    if optimizer in ("onebit_adam", "onebit_lamb"):
        overrides.append(f"optim.{optimizer}.freeze_step={freeze}")
    if optimizer == "zero_one_adam":  # local steps from the freeze, the interval doubling every tenth of the run
        overrides += [f"optim.zero_one_adam.var_freeze_step={freeze}",
                      f"optim.zero_one_adam.local_step_scaler={local[0] or max(1, steps // 10)}",
                      f"optim.zero_one_adam.local_step_clipper={local[1]}",
                      f"optim.zero_one_adam.local_step_policy={local[3]}"]
        overrides += [f"optim.zero_one_adam.var_update_scaler={local[2]}"] if local[2] else []
    start = time.perf_counter()
    if dp == 1:
        with contextlib.redirect_stdout(io.StringIO()):
            records = run(os.path.join(ROOT, "configs", "tiny.yaml"), overrides)
    else:
        records = _ranks_run(overrides, dp, folder)
    train_losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    sent = {r["step"]: r["comm/sent_gb"] for r in records if "comm/sent_gb" in r}
    window = sent.get(freeze + WINDOW, float("nan")) - sent.get(freeze, float("nan"))
    after = sent.get(steps, float("nan")) - sent.get(freeze, float("nan"))
    return {"val": val[-1] if val else float("nan"), "train": statistics.mean(train_losses[-20:]),
            "seconds": time.perf_counter() - start, "sent_gb": window, "sent_after_gb": after}


def _ranks_run(overrides: list[str], dp: int, folder: Path) -> list[dict]:
    """The run on ``dp`` processes (torchrun, gloo); its metrics.jsonl records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp),
           os.path.join(ROOT, "pretrain.py"), "--config", os.path.join(ROOT, "configs", "tiny.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"the dp {dp} run failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--out", default="", help="folder for the runs (default: a temporary one)")
    ap.add_argument("--lrs", default="", help="learning rates to run instead, e.g. muon=0.005,0.01")
    ap.add_argument("--adamw-lr", type=float, default=0.0,
                    help="Muon's AdamW part when adamw is not in the run (default: adamw's best of the run)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks for every run (torchrun, gloo)")
    ap.add_argument("--freeze-step", type=int, default=0,
                    help="1-bit and 0/1 Adam's warm-up (default: a fifth of the steps)")
    ap.add_argument("--local-step-scaler", type=int, default=0,
                    help="0/1 Adam's steps per doubling of the local-step interval (default: a tenth of the steps)")
    ap.add_argument("--local-step-clipper", type=int, default=16, help="0/1 Adam's longest interval (H)")
    ap.add_argument("--local-step-policy", default="steps", choices=("steps", "lr"),
                    help="0/1 Adam's T_u: the interval doubled by steps, or by the learning rate's decay")
    ap.add_argument("--var-update-scaler", type=int, default=0,
                    help="0/1 Adam's variance updates per doubling of their interval (default: the section's, 16)")
    args = ap.parse_args()
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="convergence-"))
    cache = base / "cache"
    results: dict[str, dict[float, dict]] = {}
    where = "one process" if args.dp == 1 else f"dp {args.dp} (gloo)"
    print(f"### Convergence, configs/tiny.yaml, {where}, fp32, {args.steps} steps of 16 x 128 tokens", flush=True)
    first = (args.freeze_step or args.steps // 5) + 1
    print("", f"| optimizer | lr | val loss | train loss (last 20) | s | MB sent, steps {first}-{first + WINDOW - 1} "
          f"| MB sent, steps {first}-{args.steps} |", "|---|---:|---:|---:|---:|---:|---:|", sep="\n", flush=True)
    lrs = dict(LRS)
    for item in filter(None, args.lrs.split(";")):
        name, values = item.split("=")
        lrs[name] = tuple(float(v) for v in values.split(","))
    for optimizer in args.optimizers.split(","):
        adamw_best = min(results["adamw"], key=lambda lr: results["adamw"][lr]["val"]) if "adamw" in results \
            else args.adamw_lr
        results[optimizer] = {}
        for lr in lrs[optimizer]:
            r = train(base / f"{optimizer}_{lr:g}", cache, optimizer, lr, args.steps, args.eval_batches, adamw_best,
                      args.dp, args.freeze_step, (args.local_step_scaler, args.local_step_clipper,
                                                                   args.var_update_scaler, args.local_step_policy))
            results[optimizer][lr] = r
            print(f"| {optimizer} | {lr:g} | {r['val']:.4f} | {r['train']:.4f} | {r['seconds']:.0f} | "
                  f"{r['sent_gb'] * 1e3:.1f} | {r['sent_after_gb'] * 1e3:.1f} |", flush=True)
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
