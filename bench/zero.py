"""ZeRO benchmark: megazero's ZeroOptimizer (stages 0 and 3) against torch DDP and torch FSDP2.

Four contenders train the same GPT (megazero's own ``build_gpt``, each on its own
copy built from the same seed) on the same data (random token microbatches from a
fixed seed, each dp rank its own share), with the same loss (per-token loss summed
and divided by the global token count), the same AdamW (lr 1e-3, betas
(0.9, 0.95), eps 1e-8, weight decay 0.1 on >=2-D parameters), gradient clipping at
1.0 and gradient accumulation over m=2 microbatches per rank, fp32:

  megazero ZeRO-0  ZeroOptimizer(stage=0) driven like the trainer (PipelineExecutor, 1f1b, pp=1)
  torch DDP        DistributedDataParallel + torch.optim.AdamW, no_sync() on all but the last microbatch
  megazero ZeRO-3  ZeroOptimizer(stage=3, reshard_after_forward=True)
  torch FSDP2      fully_shard(each block, then the root) + AdamW, set_requires_gradient_sync(False) but last

on N gloo CPU ranks spawned here (1 thread each). Steps alternate between the
contenders (the order rotates each step) so all see the same machine noise; the
table reports median and fastest step times and the ratios ZeRO-0/DDP and
ZeRO-3/FSDP2, the first timed step's losses (which must agree), parameter
differences after that step, and per-rank model-state bytes against
``megazero.plan.model_state_bytes``.

    python bench/zero.py [--dp 2] [--steps 5]

Not a test: nothing here asserts.
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

from megazero import plan  # noqa: E402
from megazero.config import ModelConfig  # noqa: E402
from bench.timing import timed_between_barriers  # noqa: E402
from models.gpt import build_gpt  # noqa: E402
from parallel.pipeline import PipelineExecutor  # noqa: E402
from parallel.schedules import build_schedule  # noqa: E402
from parallel.topology import Grid  # noqa: E402
from parallel.zero import ZeroOptimizer  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

WARMUP, M = 2, 2
LAYERS, HIDDEN, HEADS, SEQ_LEN, VOCAB, MICRO_BATCH = 4, 128, 4, 64, 512, 4
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
DATA_SEED, MODEL_SEED = 1234, 0
NAMES = ("megazero ZeRO-0", "torch DDP", "megazero ZeRO-3", "torch FSDP2")


def _cfg() -> ModelConfig:
    return ModelConfig(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ_LEN, vocab_size=VOCAB)


def _data(step: int, dp_rank: int, dp: int) -> list[torch.Tensor]:
    """This dp rank's M microbatches of the step's global batch (a function of the seed and step only)."""
    gen = torch.Generator().manual_seed(DATA_SEED + step)
    batch = torch.randint(0, VOCAB, (dp, M * MICRO_BATCH, SEQ_LEN + 1), generator=gen)
    return list(batch[dp_rank].split(MICRO_BATCH))


def _megazero(stage: int, grid: Grid, tokens: int):
    model = build_gpt(_cfg(), MODEL_SEED, tp=grid.tp_comm)
    model.train()
    zero = ZeroOptimizer([model], grid, stage, "fp32", LR, WD, reshard_after_forward=True, betas=BETAS, eps=EPS)
    executor = PipelineExecutor([model], grid, (MICRO_BATCH, SEQ_LEN, HIDDEN), torch.float32,
                                torch.device("cpu"), tokens, contextlib.nullcontext)
    actions = build_schedule("1f1b", 1, M)[0]

    def step(mbs) -> float:  # Trainer.train_step without data loading, lr schedule and metrics
        zero.begin_step(len(mbs))
        loss_sum = executor.run(actions, mbs)
        zero.step(LR, max_norm=CLIP)
        grid.dp_comm.all_reduce(loss_sum, tag="loss")
        return loss_sum.item() / tokens

    def params() -> dict:
        if stage == 0:
            return {n: p.detach().clone() for n, p in model.named_parameters()}
        return zero.full_parameters()  # gathers over dp under stage 3

    return step, params, zero


def _adamw(model) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


def _torch(kind: str, grid: Grid, tokens: int):
    model = build_gpt(_cfg(), MODEL_SEED, tp=grid.tp_comm)
    model.train()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=grid.dp_group)

        def sync(last: bool):
            return contextlib.nullcontext() if last else wrapped.no_sync()
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = grid.mesh["dp"]
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)

        def sync(last: bool):
            wrapped.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
    opt = _adamw(model)
    dp = grid.dp

    def step(mbs) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            with sync(i == len(mbs) - 1):
                loss_sum = wrapped(mb[:, :-1], mb[:, 1:]).sum()
                # DDP and FSDP2 average gradients over dp: scale by dp so the result is sum/global tokens
                (loss_sum * (dp / tokens)).backward()
            total += loss_sum.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        dist.all_reduce(total, group=grid.dp_group)
        return total.item() / tokens

    def params() -> dict:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()}

    def state_bytes() -> dict:  # what this rank holds after a step (grads kept until the next zero_grad)
        def nbytes(ts):
            ts = [t.to_local() if hasattr(t, "to_local") else t for t in ts if t is not None]
            return sum(t.numel() * t.element_size() for t in ts)
        states = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
        return {"params": nbytes(model.parameters()), "grads": nbytes(p.grad for p in model.parameters()),
                "optimizer": nbytes(states)}

    return step, params, state_bytes


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _bench_rank(rank: int, world: int, steps: int) -> dict:
    torch.set_num_threads(1)
    grid = Grid.build(tp=1, pp=1, dp=world, device_type="cpu")
    tokens = world * M * MICRO_BATCH * SEQ_LEN  # the global batch's tokens
    zeros, contenders, torch_bytes, errors = {}, {}, {}, {}
    for stage, name in ((0, NAMES[0]), (3, NAMES[2])):
        *contenders[name], zeros[stage] = _megazero(stage, grid, tokens)
    for name, kind in ((NAMES[1], "ddp"), (NAMES[3], "fsdp2")):
        try:  # building is collective: an error is the same on every rank
            *contenders[name], torch_bytes[name] = _torch(kind, grid, tokens)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    order = [n for n in NAMES if n in contenders]
    times, losses = {n: [] for n in order}, {}
    for i in range(WARMUP + steps):
        mbs = _data(i, grid.dp_rank, grid.dp)
        for name in order[i % len(order):] + order[:i % len(order)]:
            out = []
            t = timed_between_barriers(lambda: out.append(contenders[name][0](mbs)))
            if i >= WARMUP:
                times[name].append(t)
                losses.setdefault(name, out[0])
        if i == WARMUP:  # after the first timed step (WARMUP + 1 optimizer steps each); collectives
            p = {n: contenders[n][1]() for n in order}
            pairs = [(NAMES[0], NAMES[1]), (NAMES[2], NAMES[3]), (NAMES[0], NAMES[2])]
            diffs = {f"{a} vs {b}": _max_diff(p[a], p[b]) for a, b in pairs if a in p and b in p}
            diffs["largest |param|"] = max(t.abs().max().item() for t in p[NAMES[0]].values())
            torch_state = {n: f() for n, f in torch_bytes.items()}
    psi = sum(p.numel() for p in build_gpt(_cfg(), MODEL_SEED, device="meta").parameters())
    return {"times": times, "losses": losses, "diffs": diffs, "errors": errors, "psi": psi,
            "buckets": {s: len(z.buckets) for s, z in zeros.items()},
            "bytes": {f"megazero ZeRO-{s}": z.model_state_bytes() for s, z in zeros.items()}, "torch": torch_state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dp, steps = args.dp, args.steps
    assert dp >= 2 and steps >= 1, "need --dp >= 2 and --steps >= 1"

    wall = time.perf_counter()
    results = run_ranks(dp, _bench_rank, steps, timeout=600)
    cores = os.cpu_count() or 1
    r0 = results[0]
    psi = r0["psi"]
    shared = " (time-shared)" if dp >= cores else ""
    print(f"ZeRO benchmark: CPU, gloo, {dp} ranks on {cores} cores{shared}, fp32, 1 thread/rank; "
          f"GPT {LAYERS} layers hidden {HIDDEN} heads {HEADS} seq {SEQ_LEN} vocab {VOCAB} ({psi:,} params); "
          f"{M} microbatches of {MICRO_BATCH}x{SEQ_LEN} tokens per rank per step; "
          f"{steps} timed steps after {WARMUP} warm-up, contenders alternate (order rotates each step)")
    # a step's time is its makespan: the slowest rank between the two barriers
    step_times = {n: [max(ts) for ts in zip(*(r["times"][n] for r in results))] for n in r0["times"]}
    med = {n: statistics.median(ts) for n, ts in step_times.items()}
    fast = {n: min(ts) for n, ts in step_times.items()}
    print(f"{'contender':<17} {'median s':>9} {'fastest s':>10} {'loss (1st timed step)':>22}")
    for n in NAMES:
        if n in med:
            print(f"{n:<17} {med[n]:>9.4f} {fast[n]:>10.4f} {r0['losses'][n]:>22.7f}")
        else:
            print(f"{n:<17} not run: {r0['errors'].get(n)}")
    for a, b in ((NAMES[0], NAMES[1]), (NAMES[2], NAMES[3])):
        if a in med and b in med:
            print(f"ratio {a} / {b}: median {med[a] / med[b]:.2f}, fastest {fast[a] / fast[b]:.2f}")
    ls = list(r0["losses"].values())
    print(f"loss: max |diff| across contenders {max(ls) - min(ls):.1e} (fp32, same weights, data and loss: "
          f"~1e-5 or better expected)")
    print("max |param diff| after the first timed step: " + "; ".join(f"{k} {v:.1e}" for k, v in r0["diffs"].items()))
    print(f"notes: megazero ZeRO-0 all-reduces {r0['buckets'][0]} bucket(s) of <=25 MB once per step; megazero "
          f"ZeRO-3 ({r0['buckets'][3]} buckets: one per layer + root) reduce-scatters every microbatch, FSDP2 "
          f"with set_requires_gradient_sync(False) once per step (holding unsharded grads meanwhile)")
    print(f"  {'per-rank model state, bytes (rank 0)':<35} {'params':>10} {'grads':>10} {'optimizer':>10} "
          f"{'total':>10}  plan.model_state_bytes(psi, stage, dp={dp}, 'fp32')")
    rows = list(r0["bytes"].items()) + list(r0["torch"].items())
    for n, m in rows:
        total = m["params"] + m["grads"] + m["optimizer"]
        stage = int(n[-1]) if n.startswith("megazero") else None
        ref = f"{plan.model_state_bytes(psi, stage, dp, 'fp32')['device_total']:>10,}" if stage is not None else \
            "- (counted: params, .grad, AdamW moments" + ("; not DDP's reducer buckets, +4 B/param)" if "DDP" in n
                                                             else ")")
        print(f"  {n:<35} {m['params']:>10,} {m['grads']:>10,} {m['optimizer']:>10,} {total:>10,}  {ref}")
    print(f"wall time {time.perf_counter() - wall:.1f} s (spawn and import included)")


if __name__ == "__main__":
    main()
