"""Pipeline benchmark: megazero's schedules, p2p overlap and cost-balanced stages, and torch's Schedule1F1B.

Every contender runs the same GPT stages (``build_gpt`` modules; one set per layer split), the same
microbatches and the same loss (per-token loss summed and divided by the step's token count) on pp gloo
CPU ranks spawned here, one thread each. Within a round the contenders alternate step by step, so all see
the same machine noise; each round takes ``--steps`` timed steps per contender after warm-up, and the
table quotes the median over the rounds of each round's median. A step's time is the slowest rank's,
between barriers.

For each megazero contender it reports, per stage, the compute time of a step (the executor's trace: F, B
and W spans), the idle share of the step (1 - compute / step), and the idle share the schedule simulates
(``parallel.schedule_analysis.simulate``) with that stage's measured F, B and W costs, and the ratio of
step times against 1F1B at the even split with p2p waited in place.

    python bench/pipeline.py [--pp 2] [--layers 8] [--microbatches 4] [--steps 20] [--rounds 2]

Not a test: nothing here asserts, except that every contender sees the same first loss.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.timing import timed_between_barriers  # noqa: E402
from megazero.config.schema import ModelConfig  # noqa: E402
from megazero.config.resolve import resolve_arch  # noqa: E402
from megazero.costs import pipeline_costs  # noqa: E402
from megazero.engine.build import make_executor, make_schedules  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402
from megazero.parallel.balance import balance_layers  # noqa: E402
from megazero.parallel.pipeline import partition_layers  # noqa: E402
from megazero.parallel.schedule_analysis import simulate  # noqa: E402
from megazero.parallel.schedules import build_schedule  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

WARMUP = 2
DATA_SEED, MODEL_SEED = 1234, 0
# (name, schedule, virtual stages, split, overlap_p2p); the first is the reference of the ratios
CONTENDERS = [
    ("1f1b even, waited", "1f1b", 1, "even", False),
    ("1f1b even, overlap", "1f1b", 1, "even", True),
    ("zb1p even, waited", "zb1p", 1, "even", False),
    ("zb1p even, overlap", "zb1p", 1, "even", True),
    ("1f1b auto, overlap", "1f1b", 1, "auto", True),
    ("zb1p auto, overlap", "zb1p", 1, "auto", True),
    ("interleaved v2 even, overlap", "interleaved", 2, "even", True),
]


def model_cfg(args) -> ModelConfig:
    cfg = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq,
                      vocab_size=args.vocab)
    resolve_arch(cfg)
    return cfg


def splits(cfg: ModelConfig, pp: int, v: int) -> dict[str, list[int]]:
    """Layer counts per virtual stage: even (earlier stages take the remainder) and cost-balanced."""
    even = [len(r) for r in partition_layers(cfg.layers, pp * v)]
    return {"even": even, "auto": balance_layers(cfg.layers, pp, pipeline_costs(cfg, 1, "fp32", "cpu"), v)}


def _bench_rank(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    pp, m = args.pp, args.microbatches
    cfg = model_cfg(args)
    grid = Grid.build(tp=1, pp=pp, dp=1, device_type="cpu")
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(DATA_SEED)
    batch = torch.randint(0, cfg.vocab_size, (m * args.micro_batch, cfg.seq_len + 1), generator=gen)
    microbatches = list(batch.split(args.micro_batch))
    tokens = m * args.micro_batch * cfg.seq_len

    chunks_of: dict[tuple, list] = {}  # (split name, v) -> this rank's model chunks

    def chunks(split: str, v: int) -> list:
        if (split, v) not in chunks_of:
            ranges = partition_layers(cfg.layers, pp * v, splits(cfg, pp, v)[split])
            chunks_of[(split, v)] = [build_gpt(cfg, MODEL_SEED, device=device, layer_ids=ranges[c * pp + rank],
                                               first_stage=c * pp + rank == 0,
                                               last_stage=c * pp + rank == pp * v - 1) for c in range(v)]
        return chunks_of[(split, v)]

    runs = []
    for name, schedule, v, split, overlap in CONTENDERS:
        cs = chunks(split, v)
        executor = make_executor(cs, grid, device, args.micro_batch, cfg.seq_len, cfg.hidden, "fp32", tokens,
                                 overlap_p2p=overlap)
        actions = make_schedules(schedule, grid, m, v, overlap_p2p=overlap)[0]
        runs.append({"name": name, "chunks": cs, "executor": executor, "actions": actions, "loss": None})

    def step(r: dict) -> None:
        for c in r["chunks"]:
            c.zero_grad(set_to_none=True)
        r["loss"] = (r["executor"].run(r["actions"], microbatches) / tokens).item()

    th_step, peer_error, th = None, None, {"loss": None}
    try:  # torch.distributed.pipelining's Schedule1F1B on the even split's stage
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = chunks("even", 1)[0]
        pipe_stage = PipelineStage(stage, rank, pp, device, group=grid.pp_group)

        def loss_fn(token_loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
            return token_loss.sum() / tokens  # the loss is already per token: no scale_grads

        schedule = Schedule1F1B(pipe_stage, m, loss_fn=loss_fn, scale_grads=False)
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

        def th_step() -> None:
            stage.zero_grad(set_to_none=True)
            losses: list = []
            if rank == 0:
                schedule.step(inputs, return_outputs=False)
            elif rank == pp - 1:
                schedule.step(targets=targets, target=targets, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            if rank == pp - 1:
                th["loss"] = sum(x.detach() for x in losses).item()
    except Exception as e:  # report, and still measure megazero
        peer_error = f"{type(e).__name__}: {e}"

    times = {r["name"]: [] for r in runs}
    times["torch Schedule1F1B even"] = []
    per_stage = {r["name"]: {"compute": [], "F": [], "B": [], "W": []} for r in runs}
    first_loss = {}
    for rnd in range(args.rounds):
        round_times = {k: [] for k in times}
        for i in range(WARMUP + args.steps):
            for r in runs:
                t = timed_between_barriers(lambda: step(r))
                if i < WARMUP:
                    continue
                round_times[r["name"]].append(t)
                spans = [(e["name"], e["dur"] / 1e6) for e in r["executor"].chrome_trace(rank)
                         if e["cat"] == "compute"]
                ps = per_stage[r["name"]]
                ps["compute"].append(sum(d for _, d in spans))
                for kind in "FBW":
                    ps[kind] += [d for label, d in spans if label.startswith(kind)]
                if rnd == 0 and i == WARMUP:
                    first_loss[r["name"]] = r["loss"]
            if th_step is not None:
                try:
                    t = timed_between_barriers(th_step)
                except Exception as e:
                    peer_error, th_step = f"{type(e).__name__}: {e}", None
                    continue
                if i >= WARMUP:
                    round_times["torch Schedule1F1B even"].append(t)
                    if rnd == 0 and i == WARMUP:
                        first_loss["torch Schedule1F1B even"] = th["loss"]
        for k, ts in round_times.items():
            times[k].append(ts)
    summary = {name: {"compute": statistics.median(ps["compute"]),
                      **{k: (statistics.mean(ps[k]) if ps[k] else 0.0) for k in "FBW"}}
               for name, ps in per_stage.items()}
    return {"rank": rank, "times": times, "stage": summary, "first_loss": first_loss, "peer_error": peer_error,
            "params": {name: sum(p.numel() for c in r["chunks"] for p in c.parameters())
                       for name, r in ((r["name"], r) for r in runs)}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args(argv)
    pp, m = args.pp, args.microbatches
    assert pp >= 2 and m % pp == 0 and args.layers >= 2 * pp, "need pp >= 2, m a multiple of pp, layers >= 2pp"
    wall = time.perf_counter()
    results = sorted(run_ranks(pp, _bench_rank, args, timeout=3600), key=lambda r: r["rank"])
    cfg = model_cfg(args)
    cores = os.cpu_count() or 1
    print(f"pipeline benchmark: pp={pp}, m={m} microbatches of {args.micro_batch}x{args.seq} tokens, GPT "
          f"{args.layers} layers hidden {args.hidden} heads {args.heads} vocab {args.vocab}, fp32, CPU gloo, "
          f"{cores} cores for {pp} ranks (1 thread each); {args.rounds} rounds of {args.steps} timed steps after "
          f"{WARMUP} warm-up, contenders alternating step by step")
    print(f"splits: even {splits(cfg, pp, 1)['even']}, auto {splits(cfg, pp, 1)['auto']} "
          f"(parallel.pp_layers: auto; interleaved: {splits(cfg, pp, 2)['even']})")

    def median_of_rounds(name: str) -> tuple[float, list[float]]:
        rounds = [statistics.median(max(ts) for ts in zip(*(r["times"][name][k] for r in results)))
                  for k in range(args.rounds)]
        return statistics.median(rounds), rounds

    ref, _ = median_of_rounds(CONTENDERS[0][0])
    print(f"\n| contender | step s (median) | rounds | vs {CONTENDERS[0][0]} | per stage: compute ms, idle "
          f"measured / simulated | busiest / least compute |")
    print("|---|---|---|---|---|---|")
    for name, schedule, v, split, overlap in CONTENDERS:
        med, rounds = median_of_rounds(name)
        cells = []
        for r in results:
            s = r["stage"][name]
            b = s["B"] if schedule == "zb1p" else s["B"] + s["W"]
            sim = simulate(build_schedule(schedule, pp, m, v), pp, s["F"] * v, b * v, s["W"] * v)
            cells.append(f"{1e3 * s['compute']:.1f}, {1 - s['compute'] / med:.3f} / "
                         f"{sim['idle_fraction'][r['rank']]:.3f}")
        computes = [r["stage"][name]["compute"] for r in results]
        print(f"| {name} | {med:.4f} | {' '.join(f'{x:.4f}' for x in rounds)} | {med / ref:.3f} | "
              f"{'; '.join(cells)} | {max(computes) / min(computes):.2f} |")
    err = next((r["peer_error"] for r in results if r["peer_error"]), None)
    if err is None and results[0]["times"]["torch Schedule1F1B even"][0]:
        med, rounds = median_of_rounds("torch Schedule1F1B even")
        print(f"| torch Schedule1F1B even | {med:.4f} | {' '.join(f'{x:.4f}' for x in rounds)} | "
              f"{med / ref:.3f} | | |")
    else:
        print(f"torch Schedule1F1B: not run ({err})")
    last = results[-1]["first_loss"]
    print(f"\nfirst timed step's loss: " + ", ".join(f"{k} {v:.6f}" for k, v in last.items()))
    print("F/B/W ms per microbatch (mean), stage by stage: " + "; ".join(
        f"{name}: " + " | ".join(f"{1e3 * r['stage'][name]['F']:.1f}/{1e3 * r['stage'][name]['B']:.1f}/"
                                 f"{1e3 * r['stage'][name]['W']:.1f}" for r in results)
        for name, *_ in CONTENDERS))
    print("idle measured = 1 - (time in F/B/W spans) / (median step); simulated: the schedule run with the "
          "stage's own measured F, B, W costs on every stage (no imbalance, free p2p). 1f1b's B is the whole "
          "backward.")
    print(f"wall time {time.perf_counter() - wall:.1f} s (spawn and import included)")


if __name__ == "__main__":
    main()
