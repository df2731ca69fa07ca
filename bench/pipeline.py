"""Pipeline benchmark: megazero's 1F1B executor against torch.distributed.pipelining's Schedule1F1B.

Both run the same GPT stages (megazero's own ``build_gpt`` modules, the very
same objects), the same microbatches and the same loss (per-token loss summed
and divided by the step's token count), on N gloo CPU ranks spawned here.
Steps alternate between the two so both see the same machine noise; the
table reports medians and the ratio between them, and megazero's measured
idle fraction per stage (from the executor's trace) next to the 1F1B ideal
(p-1)/(m+p-1) and the unit-cost simulation of ``parallel.schedules``.

    python bench/pipeline.py [--pp 2] [--microbatches 8] [--steps 5]

Not a test: nothing here asserts, except that the two runs see the same loss.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.config import ModelConfig  # noqa: E402
from bench.timing import timed_between_barriers  # noqa: E402
from models.gpt import build_gpt  # noqa: E402
from parallel.pipeline import PipelineExecutor, partition_layers  # noqa: E402
from parallel.schedules import build_schedule, simulate  # noqa: E402
from parallel.topology import Grid  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

WARMUP = 2
MICRO_BATCH, SEQ_LEN, HIDDEN, HEADS, VOCAB = 2, 64, 128, 4, 512
DATA_SEED, MODEL_SEED = 1234, 0


def _model_cfg(pp: int) -> ModelConfig:
    return ModelConfig(layers=2 * pp, hidden=HIDDEN, heads=HEADS, seq_len=SEQ_LEN, vocab_size=VOCAB)


def _bench_rank(rank: int, world: int, pp: int, m: int, steps: int) -> dict:
    torch.set_num_threads(1)
    cfg = _model_cfg(pp)
    grid = Grid.build(tp=1, pp=pp, dp=1, device_type="cpu")
    device = torch.device("cpu")
    first, last = grid.is_first_stage, grid.is_last_stage
    stage = build_gpt(cfg, MODEL_SEED, device=device, tp=grid.tp_comm,
                      layer_ids=partition_layers(cfg.layers, pp)[grid.pp_rank],
                      first_stage=first, last_stage=last)
    stage.train()

    gen = torch.Generator().manual_seed(DATA_SEED)
    batch = torch.randint(0, VOCAB, (m * MICRO_BATCH, SEQ_LEN + 1), generator=gen)
    microbatches = list(batch.split(MICRO_BATCH))
    tokens = m * MICRO_BATCH * SEQ_LEN

    # --- megazero: one executor, the 1F1B schedule's actions for this rank ---------------------
    executor = PipelineExecutor([stage], grid, (MICRO_BATCH, SEQ_LEN, HIDDEN), torch.float32, device,
                                tokens, contextlib.nullcontext)
    actions = build_schedule("1f1b", pp, m)[grid.pp_rank]
    mz = {"loss": None}

    def mz_step() -> None:
        stage.zero_grad(set_to_none=True)
        loss_sum = executor.run(actions, microbatches)
        mz["loss"] = (loss_sum / tokens).item()

    # --- torch.distributed.pipelining: the same module in a PipelineStage ----------------------
    peer_error = None
    th = {"loss": None}
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        pipe_stage = PipelineStage(stage, grid.pp_rank, pp, device, group=grid.pp_group)

        # The last stage's module returns per-token losses given ``targets`` (a model kwarg, split into
        # microbatches like the inputs); loss_fn only reduces them. scale_grads=False because the loss
        # is already divided by the step's token count (the default would also divide grads by m).
        def loss_fn(token_loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
            return token_loss.sum() / tokens

        schedule = Schedule1F1B(pipe_stage, m, loss_fn=loss_fn, scale_grads=False)
        inputs = batch[:, :-1].contiguous()
        targets = batch[:, 1:].contiguous()

        def th_step() -> None:
            stage.zero_grad(set_to_none=True)
            losses: list = []
            if first:
                schedule.step(inputs, return_outputs=False)
            elif last:
                schedule.step(targets=targets, target=targets, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            if last:
                th["loss"] = sum(x.detach() for x in losses).item()
    except Exception as e:  # report, and still measure megazero
        peer_error = f"{type(e).__name__}: {e}"
        th_step = None

    def grads() -> dict:
        return {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}

    for _ in range(WARMUP):
        timed_between_barriers(mz_step)
        if th_step is not None:
            try:
                timed_between_barriers(th_step)
            except Exception as e:
                peer_error, th_step = f"{type(e).__name__}: {e}", None
                dist.barrier()

    mz_times, th_times, compute, comm, f_times, b_times = [], [], [], [], [], []
    first_losses, grad_diff = {}, None
    for i in range(steps):
        mz_times.append(timed_between_barriers(mz_step))
        events = executor.chrome_trace(rank)  # durations in microseconds, host clock or CUDA events alike
        spans = [(e["name"], e["dur"] / 1e6) for e in events if e["cat"] == "compute"]
        compute.append(sum(d for _, d in spans))
        comm.append(sum(e["dur"] / 1e6 for e in events if e["cat"] == "comm"))
        f_times += [d for label, d in spans if label.startswith("F")]
        b_times += [d for label, d in spans if label.startswith("B")]
        if i == 0:
            first_losses["megazero"] = mz["loss"]
            mz_grads = grads()
        if th_step is not None:
            th_times.append(timed_between_barriers(th_step))
            if i == 0:
                first_losses["torch"] = th["loss"]
                th_grads = grads()
                grad_diff = max(((mz_grads[n] - g).abs().max() / mz_grads[n].abs().max().clamp_min(1e-30)).item()
                                for n, g in th_grads.items())
                assert th_grads.keys() == mz_grads.keys(), (th_grads.keys(), mz_grads.keys())

    idle = [1 - c / t for c, t in zip(compute, mz_times)]
    in_p2p = [c / t for c, t in zip(comm, mz_times)]
    return {"rank": rank, "pp_rank": grid.pp_rank, "mz_times": mz_times, "th_times": th_times,
            "idle": statistics.median(idle), "p2p": statistics.median(in_p2p), "f_ms": 1e3 * statistics.mean(f_times),
            "b_ms": 1e3 * statistics.mean(b_times), "losses": first_losses, "grad_diff": grad_diff,
            "peer_error": peer_error, "params": sum(p.numel() for p in stage.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    pp, m, steps = args.pp, args.microbatches, args.steps
    assert pp >= 2 and m >= 1 and steps >= 1, "need --pp >= 2, --microbatches >= 1, --steps >= 1"

    wall = time.perf_counter()
    results = run_ranks(pp, _bench_rank, pp, m, steps, timeout=600)
    cores = os.cpu_count() or 1

    cfg = _model_cfg(pp)
    sim = simulate(build_schedule("1f1b", pp, m), pp)
    ideal = (pp - 1) / (m + pp - 1)
    share = f"{cores} cores shared by {pp} ranks" + (" -> ranks time-share cores, idle and step time include "
                                                      "waiting for a core" if pp > cores else "")
    print(f"pipeline benchmark: pp={pp}, m={m} microbatches of {MICRO_BATCH}x{SEQ_LEN} tokens, "
          f"GPT {cfg.layers} layers ({cfg.layers // pp}/stage) hidden {HIDDEN} heads {HEADS} vocab {VOCAB}, "
          f"{steps} timed steps after {WARMUP} warm-up, fp32 (CPU, gloo, {share}, 1 thread/rank)")
    print(f"{'stage':<6} {'idle measured':<14} {'idle ideal (p-1)/(m+p-1)':<25} {'idle simulated':<15} "
          f"{'of which in p2p':<16} {'F ms/mb':<8} {'B ms/mb':<8} params")
    for r in sorted(results, key=lambda r: r["pp_rank"]):
        s = r["pp_rank"]
        print(f"{s:<6} {r['idle']:<14.3f} {ideal:<25.3f} {sim['idle_fraction'][s]:<15.3f} "
              f"{r['p2p']:<16.3f} {r['f_ms']:<8.2f} {r['b_ms']:<8.2f} {r['params']}")

    # a step's time is its makespan: the slowest rank between the two barriers
    mz_steps = [max(ts) for ts in zip(*(r["mz_times"] for r in results))]
    mz = statistics.median(mz_steps)
    last = next(r for r in results if r["pp_rank"] == pp - 1)
    err = next((r["peer_error"] for r in results if r["peer_error"]), None)
    if err is None and all(r["th_times"] for r in results):
        th_steps = [max(ts) for ts in zip(*(r["th_times"] for r in results))]
        th = statistics.median(th_steps)
        print(f"step time (median): megazero 1F1B {mz:.3f} s | torch.distributed.pipelining Schedule1F1B "
              f"{th:.3f} s | ratio megazero/torch {mz / th:.2f}")
        print(f"step time (fastest): megazero 1F1B {min(mz_steps):.3f} s | torch {min(th_steps):.3f} s | "
              f"ratio {min(mz_steps) / min(th_steps):.2f}   (steps alternate megazero/torch; a noisy machine "
              f"moves the median more than the minimum)")
        print(f"loss (first timed step): megazero {last['losses']['megazero']:.6f}  "
              f"torch {last['losses']['torch']:.6f}  (|diff| "
              f"{abs(last['losses']['megazero'] - last['losses']['torch']):.1e}); "
              f"max rel grad diff over stages {max(r['grad_diff'] for r in results):.1e}")
    else:
        print(f"step time (median): megazero 1F1B {mz:.3f} s | torch.distributed.pipelining Schedule1F1B: "
              f"not run ({err})")
        print(f"loss (first timed step): megazero {last['losses']['megazero']:.6f}")
    print("idle = 1 - (time in F/B actions) / (step time between barriers); it counts p2p waits (bubble, "
          "stage imbalance, transfers), Python between actions and, when ranks share cores, waiting for one. "
          "F/B: mean ms per microbatch.")
    print(f"wall time {time.perf_counter() - wall:.1f} s (spawn and import included)")


if __name__ == "__main__":
    main()
