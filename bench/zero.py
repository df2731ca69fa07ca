"""ZeRO benchmark: megazero's ZeroOptimizer (stages 0, 1 and 3) against torch DDP and torch FSDP2.

The contenders train the same GPT (megazero's own ``build_gpt``, each on its own copy built from the same
seed) on the same data (random token microbatches from a fixed seed, each dp rank its own share), with
the same loss (per-token loss summed and divided by the global token count), the same AdamW (lr 1e-3,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on >=2-D parameters), gradient clipping at 1.0 and
gradient accumulation over m=2 microbatches per rank, fp32:

  megazero ZeRO-0    ZeroOptimizer at stage 0 (megazero.engine.build) through megazero.engine.step.train_step
  torch DDP          DistributedDataParallel + torch.optim.AdamW(fused=True), no_sync() but the last microbatch
  megazero ZeRO-3    ZeroOptimizer at stage 3, reshard_after_forward=True
  torch FSDP2        fully_shard(each block, then the root) + AdamW (fused, else foreach), gradient sync last
  megazero ZeRO-1    ZeroOptimizer at stage 1, parameter all-gathers overlapped with the next forward
  ZeRO-1 no overlap  the same, all-gathers waited at the end of the step

on N gloo CPU ranks spawned here (1 thread each). Steps alternate between the contenders (the order
rotates each step) so all see the same machine noise. ``--repeats`` rounds of ``--steps`` timed steps
(after warm-up) each; a step's time is the slowest rank's between two barriers; the table gives each
round's median and the median of the rounds' medians, and the ratios ZeRO-0/DDP, ZeRO-3/FSDP2 and
ZeRO-1 overlapped/not. The first timed step's losses must agree (same weights, data and loss).

    python bench/zero.py [--dp 2] [--steps 20] [--repeats 3] [--smoke]

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

from megazero.plan import stage_plan as plan  # noqa: E402
from megazero.config.schema import ModelConfig, ZeroConfig  # noqa: E402
from megazero.engine.build import make_executor, make_schedules, make_zero  # noqa: E402
from bench.timing import timed_between_barriers  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402
from megazero.engine.step import train_step  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

WARMUP, M = 2, 2
SIZES = {"full": (8, 384, 6, 64, 4096, 2), "smoke": (2, 32, 2, 16, 128, 2)}  # layers hidden heads seq vocab mb
LAYERS, HIDDEN, HEADS, SEQ_LEN, VOCAB, MICRO_BATCH = SIZES["full"]
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
DATA_SEED, MODEL_SEED = 1234, 0
NAMES = ("megazero ZeRO-0", "torch DDP", "megazero ZeRO-3", "torch FSDP2", "megazero ZeRO-1",
         "ZeRO-1 no overlap")
STAGES = {NAMES[0]: (0, True), NAMES[2]: (3, True), NAMES[4]: (1, True), NAMES[5]: (1, False)}
RATIOS = ((NAMES[0], NAMES[1]), (NAMES[2], NAMES[3]), (NAMES[4], NAMES[5]))


def _cfg() -> ModelConfig:
    return ModelConfig(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ_LEN, vocab_size=VOCAB)


def _use(size: str) -> None:
    global LAYERS, HIDDEN, HEADS, SEQ_LEN, VOCAB, MICRO_BATCH
    LAYERS, HIDDEN, HEADS, SEQ_LEN, VOCAB, MICRO_BATCH = SIZES[size]


def _data(step: int, dp_rank: int, dp: int) -> list[torch.Tensor]:
    """This dp rank's M microbatches of the step's global batch (a function of the seed and step only)."""
    gen = torch.Generator().manual_seed(DATA_SEED + step)
    batch = torch.randint(0, VOCAB, (dp, M * MICRO_BATCH, SEQ_LEN + 1), generator=gen)
    return list(batch[dp_rank].split(MICRO_BATCH))


def _megazero(stage: int, overlap: bool, grid: Grid, tokens: int):
    model = build_gpt(_cfg(), MODEL_SEED, tp=grid.tp_comm)
    model.train()
    cpu = torch.device("cpu")
    zero = make_zero([model], grid, ZeroConfig(stage=stage, reshard_after_forward=True), "fp32", WD, cpu,
                     adam_impl="fused", overlap_param_gather=overlap)  # its AdamW defaults are BETAS, EPS
    executor = make_executor([model], grid, cpu, MICRO_BATCH, SEQ_LEN, HIDDEN, "fp32", tokens)
    actions = make_schedules("1f1b", grid, M)[0]

    def step(mbs) -> float:  # the trainer's step, without data loading, lr schedule and metrics
        return train_step(zero, executor, actions, mbs, LR, CLIP).loss_total.item() / tokens

    def params() -> dict:
        return zero.full_parameters()  # settles the gathers in flight; gathers over dp under stage 3

    return step, params, zero


def _adamw(model, **impl) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS, **impl)


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
    opt = _adamw(model, fused=True)  # the torch peers' best on the CPU (see bench/optimizer.py)
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        try:
            opt.step()
        except RuntimeError:  # fused AdamW refused these (DTensor) parameters: its next best, foreach
            if not opt.defaults.get("fused"):
                raise
            for group in opt.param_groups:
                group["fused"], group["foreach"] = False, True
            opt.defaults["fused"] = False
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

    def impl() -> str:
        return "fused" if opt.param_groups[0].get("fused") else "foreach"

    return step, params, (state_bytes, impl)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _bench_rank(rank: int, world: int, steps: int, repeats: int, size: str) -> dict:
    _use(size)
    torch.set_num_threads(1)
    grid = Grid.build(tp=1, pp=1, dp=world, device_type="cpu")
    tokens = world * M * MICRO_BATCH * SEQ_LEN  # the global batch's tokens
    zeros, contenders, torch_bytes, impls, errors = {}, {}, {}, {}, {}
    for name, (stage, overlap) in STAGES.items():
        *contenders[name], zeros[name] = _megazero(stage, overlap, grid, tokens)
    for name, kind in ((NAMES[1], "ddp"), (NAMES[3], "fsdp2")):
        try:  # building is collective: an error is the same on every rank
            *contenders[name], (torch_bytes[name], impls[name]) = _torch(kind, grid, tokens)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    order = [n for n in NAMES if n in contenders]
    times, losses = {n: [[] for _ in range(repeats)] for n in order}, {}
    i = 0
    for r in range(repeats):
        for k in range(WARMUP + steps):
            mbs = _data(i, grid.dp_rank, grid.dp)
            for name in order[i % len(order):] + order[:i % len(order)]:
                out = []
                t = timed_between_barriers(lambda: out.append(contenders[name][0](mbs)))
                if k >= WARMUP:
                    times[name][r].append(t)
                    losses.setdefault(name, out[0])
            if i == WARMUP:  # after the first timed step (WARMUP + 1 optimizer steps each); collectives
                p = {n: contenders[n][1]() for n in order}
                pairs = [(NAMES[0], NAMES[1]), (NAMES[2], NAMES[3]), (NAMES[0], NAMES[2]), (NAMES[4], NAMES[5])]
                diffs = {f"{a} vs {b}": _max_diff(p[a], p[b]) for a, b in pairs if a in p and b in p}
                diffs["largest |param|"] = max(t.abs().max().item() for t in p[NAMES[0]].values())
                torch_state = {n: f() for n, f in torch_bytes.items()}
            i += 1
    psi = sum(p.numel() for p in build_gpt(_cfg(), MODEL_SEED, device="meta").parameters())
    return {"times": times, "losses": losses, "diffs": diffs, "errors": errors, "psi": psi,
            "impls": {n: f() for n, f in impls.items()},
            "buckets": {n: len(z.buckets) for n, z in zeros.items()},
            "bytes": {n: z.model_state_bytes() for n, z in zeros.items() if "no overlap" not in n},
            "torch": torch_state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round, after warm-up")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--smoke", action="store_true", help="a toy model and few steps: checks the script")
    args = ap.parse_args()
    dp, steps, repeats = args.dp, args.steps, args.repeats
    assert dp >= 2 and steps >= 1 and repeats >= 1, "need --dp >= 2, --steps >= 1, --repeats >= 1"
    size = "smoke" if args.smoke else "full"
    _use(size)

    wall = time.perf_counter()
    results = run_ranks(dp, _bench_rank, steps, repeats, size, timeout=3600)
    cores = os.cpu_count() or 1
    r0 = results[0]
    psi = r0["psi"]
    shared = " (time-shared)" if dp >= cores else ""
    print(f"ZeRO benchmark: CPU, gloo, {dp} ranks on {cores} cores{shared}, fp32, 1 thread/rank; "
          f"GPT {LAYERS} layers hidden {HIDDEN} heads {HEADS} seq {SEQ_LEN} vocab {VOCAB} ({psi:,} params); "
          f"{M} microbatches of {MICRO_BATCH}x{SEQ_LEN} tokens per rank per step; {repeats} rounds of {steps} "
          f"timed steps after {WARMUP} warm-up each, contenders alternate (order rotates each step); torch AdamW: "
          + ", ".join(f"{n} {v}" for n, v in r0["impls"].items()))
    # a step's time is its makespan: the slowest rank between the two barriers
    rounds = {n: [statistics.median(max(ts) for ts in zip(*(r["times"][n][k] for r in results)))
                  for k in range(repeats)] for n in r0["times"]}
    med = {n: statistics.median(v) for n, v in rounds.items()}
    print(f"{'contender':<19} {'median s':>9}  {'rounds (median s each)':<30} {'loss (1st timed step)':>22}")
    for n in NAMES:
        if n in med:
            each = " ".join(f"{v:.4f}" for v in rounds[n])
            print(f"{n:<19} {med[n]:>9.4f}  {each:<30} {r0['losses'][n]:>22.7f}")
        else:
            print(f"{n:<19} not run: {r0['errors'].get(n)}")
    for a, b in RATIOS:
        if a in med and b in med:
            each = " ".join(f"{x / y:.3f}" for x, y in zip(rounds[a], rounds[b]))
            print(f"ratio {a} / {b}: {med[a] / med[b]:.3f} (rounds: {each})")
    ls = list(r0["losses"].values())
    print(f"loss: max |diff| across contenders {max(ls) - min(ls):.1e} (fp32, same weights, data and loss: "
          f"~1e-5 or better expected)")
    print("max |param diff| after the first timed step: " + "; ".join(f"{k} {v:.1e}" for k, v in r0["diffs"].items()))
    print(f"notes: buckets of <=25 MB: " + ", ".join(f"{n} {v}" for n, v in r0["buckets"].items())
          + "; ZeRO-3 has one per layer + root and reduce-scatters every microbatch, FSDP2 with "
          "set_requires_gradient_sync(False) once per step (holding unsharded grads meanwhile)")
    print(f"  {'per-rank model state, bytes (rank 0)':<35} {'params':>10} {'grads':>10} {'optimizer':>10} "
          f"{'total':>10}  plan.model_state_bytes(psi, stage, dp={dp}, 'fp32')")
    rows = list(r0["bytes"].items()) + list(r0["torch"].items())
    for n, m in rows:
        total = m["params"] + m["grads"] + m["optimizer"]
        stage = STAGES[n][0] if n in STAGES else None
        ref = f"{plan.model_state_bytes(psi, stage, dp, 'fp32')['device_total']:>10,}" if stage is not None else \
            "- (counted: params, .grad, AdamW moments" + ("; not DDP's reducer buckets, +4 B/param)" if "DDP" in n
                                                             else ")")
        print(f"  {n:<35} {m['params']:>10,} {m['grads']:>10,} {m['optimizer']:>10,} {total:>10,}  {ref}")
    print(f"wall time {time.perf_counter() - wall:.1f} s (spawn and import included)")


if __name__ == "__main__":
    main()
