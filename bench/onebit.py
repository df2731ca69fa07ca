"""1-bit Adam's and 0/1 Adam's training step against AdamW's at dp ranks (gloo, torchrun): the whole step (forward, backward,
the gradient reduction or the compressed momentum, the update), configs/tiny.yaml in fp32 at ZeRO 0, where
1-bit Adam sends 1/31 of AdamW's bytes past its warm-up (tests/parallel/test_onebit_adam.py counts them).

Each run takes ``--steps`` steps (the warm-up ends at step 5; 0/1 Adam's variance freezes there, and its
synchronisation interval doubles every 5 steps up to 4); a step's time is its logged tokens/s inverted, and a
run's figure the median over the steps after ``--skip``. The optimizers run in turns, ``--repeats`` times; the
medians of the runs are printed with their ratios to AdamW's.

    python bench/onebit.py [--dp 2] [--steps 40] [--skip 15] [--repeats 3] [--optimizers adamw,onebit_adam]

On CPU gloo the bytes are cheap and the compression's own work (signs, packing, two chunk norms a bucket) is
not: the figure says what the compression costs where the network is not the bottleneck. Not a test.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

FREEZE = 5


def step_seconds(folder: Path, dp: int, optimizer: str, steps: int, skip: int, cache: Path) -> float:
    """The median step time of one run after ``skip`` steps."""
    sets = ["parallel.tp=1", "parallel.pp=1", f"parallel.dp={dp}", "parallel.sequence_parallel=false",
            "train.precision=fp32", "zero.stage=0", f"train.steps={steps}", "train.eval_every=0",
            "train.save_every=0", "log.tensorboard=false", "log.every=1", f"log.dir={folder}",
            f"data.cache_dir={cache}", f"optim.name={optimizer}", "train.lr=2.0e-3"]
    if optimizer == "onebit_adam":
        sets.append(f"optim.onebit_adam.freeze_step={FREEZE}")
    if optimizer == "zero_one_adam":
        sets += [f"optim.zero_one_adam.var_freeze_step={FREEZE}", f"optim.zero_one_adam.local_step_scaler={FREEZE}",
                 "optim.zero_one_adam.local_step_clipper=4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp),
           os.path.join(ROOT, "pretrain.py"), "--config", os.path.join(ROOT, "configs", "tiny.yaml")]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{optimizer} at dp {dp} failed: {done.stderr[-2000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    tokens = 16 * 128  # tiny.yaml's global batch of 16 sequences of 128
    return statistics.median(tokens / r["tokens_per_s"] for r in records if "loss" in r and r["step"] > skip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--optimizers", default="adamw,onebit_adam", help="adamw first: the others' ratios are to it")
    args = ap.parse_args()
    assert args.skip >= FREEZE and args.steps - args.skip >= 20, "at least 20 timed steps past the warm-up"
    base = Path(tempfile.mkdtemp(prefix="onebit-"))
    times: dict[str, list[float]] = {name: [] for name in args.optimizers.split(",")}
    assert next(iter(times)) == "adamw", "AdamW first: the ratios are to it"
    for repeat in range(args.repeats):
        for optimizer in times:
            times[optimizer].append(step_seconds(base / f"{optimizer}_{repeat}", args.dp, optimizer, args.steps,
                                                 args.skip, base / "cache"))
    print(f"### {', '.join(list(times)[1:])} against AdamW, configs/tiny.yaml, dp {args.dp} (gloo), fp32, ZeRO 0, "
          f"median of steps {args.skip + 1}-{args.steps}, {args.repeats} runs each")
    print("", "| optimizer | ms/step (runs) | median |", "|---|---|---:|", sep="\n")
    for optimizer, ts in times.items():
        print(f"| {optimizer} | {', '.join(f'{t * 1e3:.0f}' for t in ts)} | {statistics.median(ts) * 1e3:.0f} |")
    print("")
    for optimizer, ts in list(times.items())[1:]:
        print(f"- {optimizer} / adamw step time: {statistics.median(ts) / statistics.median(times['adamw']):.3f}")


if __name__ == "__main__":
    main()
