"""tp_overlap benchmark: a tensor-parallel GPT's training step with ``parallel.tp_overlap`` on and off.

Both models are the same GPT (same parameters, the same microbatch, fp32) on tp ranks; steps alternate between
them (on-off, then off-on) so both see the same machine noise. A step is forward + backward of one microbatch.
Printed: the median step time of each and their ratio, and the share of collective time the overlap hides:

    hidden = 1 - blocked_on / collectives_off

``collectives_off``: the time a rank spends inside the tp collectives of an off step, all of them blocking
(host timestamps around each call; a gloo collective blocks the calling thread). ``blocked_on``: the time a
rank spends blocked on tp collectives in an on step: inside blocking calls, launching asynchronous ones, and
inside ``wait()`` of each asynchronous one. Both are medians per step over the same steps; the same
collectives run in both (the overlap's are as many again, each half as large), so the difference is the time
its collectives ran while the rank computed. Every collective of the step counts, the embedding's, the head's
and the loss's too, which no overlap hides.

    python bench/tp_overlap.py [--tp 2] [--hidden 512] [--layers 4] [--seq 256] [--micro-batch 4]
                               [--steps 20] [--repeats 3] [--sequence-parallel]
    torchrun --nproc-per-node 2 bench/tp_overlap.py --device cuda   # NCCL: step times only

Also printed: compute (step time less time blocked) on and off, and the step time on/off with collectives that
do nothing (a fake process group in one process), which is what the halves cost by themselves (smaller matmuls,
the segments' nested backward passes, the concatenation). On a machine with as many cores as ranks a collective's
own work (loopback copies and sums on gloo's threads) takes a core from the compute it runs under, so the time
hidden from the waits shows up as slower compute, and the step gains only what was spent waiting for the peer.
With sequence parallelism only the reduce-scatters are hidden, and the all-gathers, blocking, are twice as many.

On CUDA a wait does not block the host, so host timestamps cannot see hidden time: only the step times are
printed there. Not a test: nothing here asserts.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.config.schema import ModelConfig  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402
from megazero.parallel.comm import Comm  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402

WARMUP = 3
VOCAB, HEAD_DIM, MODEL_SEED, DATA_SEED = 1024, 64, 0, 1234
COLLECTIVES = ("all_reduce", "reduce_scatter_into", "all_gather_into", "all_gather", "reduce_scatter")


class Timeline:
    """Host timestamps of every collective issued through one :class:`Comm` (its methods wrapped on the
    instance): each record is a dict with kind, tag, numel, whether it was async, ``start``/``end`` of the
    call and, for an asynchronous one, ``wait_start``/``wait_end`` of its ``wait()`` (None until waited)."""

    def __init__(self, comm: Comm):
        self.records: list[dict] = []
        for name in COLLECTIVES:
            setattr(comm, name, self._wrap(name, getattr(comm, name)))

    def _wrap(self, name: str, method: Callable) -> Callable:
        signature = inspect.signature(method)
        timeline = self

        @functools.wraps(method)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            x = bound.arguments.get("x")
            rec = {"kind": name, "tag": bound.arguments.get("tag"), "numel": x.numel(),
                   "async": bool(bound.arguments.get("async_op", False)), "wait_start": None, "wait_end": None}
            rec["start"] = time.perf_counter()
            out = method(*args, **kwargs)
            rec["end"] = time.perf_counter()
            timeline.records.append(rec)
            if rec["async"] and out is not None:
                return _TimedWork(out, rec)
            return out

        return call

    def clear(self) -> None:
        self.records.clear()

    def blocked(self) -> float:
        """Seconds the host spent inside collective calls and inside waits for them."""
        return sum(r["end"] - r["start"] + ((r["wait_end"] - r["wait_start"]) if r["wait_end"] else 0.0)
                   for r in self.records)


class _TimedWork:
    """A collective's work handle whose ``wait()`` is timed."""

    def __init__(self, work, rec: dict):
        self.work, self.rec = work, rec

    def wait(self, *args) -> Any:
        self.rec["wait_start"] = time.perf_counter()
        out = self.work.wait(*args)
        self.rec["wait_end"] = time.perf_counter()
        return out

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _model_cfg(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.hidden // HEAD_DIM, seq_len=args.seq,
                       vocab_size=VOCAB)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" else (
        torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    grid = Grid.build(world, 1, 1, device.type)
    cfg = _model_cfg(args)
    models = {on: build_gpt(cfg, MODEL_SEED, device=device, tp=grid.tp_comm, sequence_parallel=args.sequence_parallel,
                            tp_overlap=on) for on in (True, False)}
    gen = torch.Generator().manual_seed(DATA_SEED)
    batch = torch.randint(0, VOCAB, (args.micro_batch, args.seq + 1), generator=gen).to(device)
    x, t = batch[:, :-1], batch[:, 1:]
    timeline = Timeline(grid.tp_comm) if device.type == "cpu" else None
    losses: dict[bool, float] = {}

    def step(on: bool) -> tuple[float, float]:
        model = models[on]
        model.zero_grad(set_to_none=True)
        if timeline is not None:
            timeline.clear()
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, t).sum() / t.numel()
        loss.backward()
        _sync(device)
        elapsed = time.perf_counter() - t0
        losses[on] = loss.item()
        return elapsed, (timeline.blocked() if timeline is not None else float("nan"))

    for i in range(WARMUP):
        step(i % 2 == 0)
        step(i % 2 == 1)
    repeats = []
    for _ in range(args.repeats):
        times: dict[bool, list] = {True: [], False: []}
        comm: dict[bool, list] = {True: [], False: []}
        for i in range(args.steps):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                elapsed, blocked = step(on)
                times[on].append(elapsed)
                comm[on].append(blocked)
        repeats.append({on: (statistics.median(times[on]), statistics.median(comm[on])) for on in (True, False)})
    calls = {}
    if timeline is not None:
        for on in (True, False):
            step(on)
            calls[on] = (len(timeline.records), sum(r["async"] for r in timeline.records))
    return {"repeats": repeats, "loss": losses, "calls": calls}


def _halves_alone(args: argparse.Namespace) -> float:
    """Step time on/off with collectives that do nothing (a fake process group, in this process): what running
    a block as two halves costs by itself, apart from any collective."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(args.threads)
    dist.init_process_group("fake", rank=0, world_size=args.tp, store=FakeStore())
    try:
        grid = Grid.build(args.tp, 1, 1, "cpu")
        models = {on: build_gpt(_model_cfg(args), MODEL_SEED, tp=grid.tp_comm,
                                sequence_parallel=args.sequence_parallel, tp_overlap=on) for on in (True, False)}
        x = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(DATA_SEED))
        times: dict[bool, list] = {True: [], False: []}
        for i in range(WARMUP + args.steps):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                models[on].zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                models[on](x, x).sum().backward()
                if i >= WARMUP:
                    times[on].append(time.perf_counter() - t0)
        return statistics.median(times[True]) / statistics.median(times[False])
    finally:
        dist.destroy_process_group()


def _spawned(world: int, args: argparse.Namespace) -> list[dict]:
    from tests.dist import run_ranks

    return run_ranks(world, _bench_rank, args, timeout=3600)


def _report(results: list[dict], args: argparse.Namespace, alone: Optional[float] = None) -> None:
    r0 = results[0]
    sp = ", sequence parallel" if args.sequence_parallel else ""
    print(f"tp={args.tp} GPT layers={args.layers} hidden={args.hidden} seq={args.seq} micro_batch={args.micro_batch} "
          f"fp32 {args.device}{sp}: {args.repeats} repeats x {args.steps} steps each way (after {WARMUP} warm-up)")
    print(f"loss on/off: {r0['loss'][True]:.6f} / {r0['loss'][False]:.6f}")
    if r0["calls"]:
        (n_on, a_on), (n_off, a_off) = r0["calls"][True], r0["calls"][False]
        print(f"tp collectives per step: on {n_on} ({a_on} async), off {n_off} ({a_off} async)")
    print("ms per step (medians); compute = step - time blocked on collectives")
    print(f"{'repeat':>6} {'rank':>4} {'on':>7} {'off':>7} {'on/off':>7} {'comm off':>8} {'blocked on':>10} "
          f"{'hidden':>7} {'compute on':>10} {'compute off':>11}")
    ratios, hidden, slower = [], [], []
    for i in range(args.repeats):
        for rank, res in enumerate(results):
            (on, blocked), (off, comm) = res["repeats"][i][True], res["repeats"][i][False]
            ratios.append(on / off)
            share = 1.0 - blocked / comm if comm == comm and comm > 0 else float("nan")
            hidden.append(share)
            slower.append((on - blocked) / (off - comm))
            print(f"{i:>6} {rank:>4} {on * 1e3:>7.1f} {off * 1e3:>7.1f} {on / off:>7.3f} {comm * 1e3:>8.1f} "
                  f"{blocked * 1e3:>10.1f} {share:>7.1%} {(on - blocked) * 1e3:>10.1f} {(off - comm) * 1e3:>11.1f}")
    print(f"step time on/off: median {statistics.median(ratios):.3f}")
    if args.device == "cpu":
        print(f"collective time hidden: median {statistics.median(hidden):.1%}; "
              f"compute on/off: median {statistics.median(slower):.3f}")
    else:
        print("collective time hidden: not measured on cuda (a wait does not block the host)")
    if alone is not None:
        print(f"the halves alone (collectives that do nothing, one process): step time on/off {alone:.3f}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps each way per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        args.tp = world
        result = _bench_rank(rank, world, args)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
        if rank == 0:
            _report(gathered, args)
        return 0
    if args.device == "cuda":
        print(f"tp_overlap on cuda runs under torchrun with {args.tp} GPUs, one per rank "
              f"(this machine has {torch.cuda.device_count()}): nothing measured")
        return 0
    results = _spawned(args.tp, args)
    _report(results, args, _halves_alone(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
