"""Ring attention benchmark: how much of the K/V transfer the ring hides, and a step against cp = 1.

A Llama (grouped-query attention, fp32) on cp ranks, each holding ``--seq-per-rank`` tokens of a sample of
cp x that many (parallel.context's head-tail split), forward + backward of one microbatch. Three variants
alternate step by step so that all see the same machine noise:

* ``ring``: megazero's ring, each K/V (forward) and dK/dV (backward) transfer posted before the block of
  attention it runs under, waited after it;
* ``blocking``: the same ring with each transfer waited for as soon as it is posted (the bench wraps the
  cp Comm's ``exchange`` on the instance): the transfer time all exposed;
* ``cp=1``: the same model on one rank's ``--seq-per-rank`` tokens alone (every rank runs its own): the
  same tokens per rank, no communication.

Printed, as medians over ``--steps`` timed steps after warm-up, per repeat and overall:

    hidden = (blocked_blocking - blocked_ring) / transfers_alone    (and the same from step times)

``blocked_*``: the time a rank spends inside ``exchange`` and inside the waits of the cp transfers, per step
(host timestamps; a gloo wait blocks the calling thread). Both include the ranks' skew (a rank that reaches a
hop first waits for its peer); the blocking variant's is that skew plus every transfer's whole time, so what
the ring saves against it is the transfer time it hid. ``transfers_alone``: a step's transfers (the same
messages) posted and waited one after another right after a barrier, with nothing else running: the time
they take. Also step times: ring / cp=1 against the FLOPs ideal (W + cp·A) / (W + A), W the weight matmuls'
and A the attention's FLOPs per token at cp = 1 (at cp the local queries attend over cp times the keys),
and ring / blocking.

Balance: the CPU seconds each rank spends in its blocks of attention (``parallel.context``'s block functions,
timed on the instance of the module this bench runs) per training step, busiest over least busy rank, beside
the same ratio of the (query, key) pairs its block plan computes (``parallel.context._block_plan``).

``--trace PATH`` writes one ring training step's timeline as a Chrome trace (open in Perfetto or chrome://tracing):
per rank, each transfer from its post to the end of its wait (K/V and dK/dV hops on tracks of their own), and
the host's work in between (the block of attention it runs under; in backward also the next dK/dV post). The console lists the same: the time the post call held the host, the work under
the transfer, and the time its wait blocked (~0: the transfer ended under the block).

    python bench/context_parallel.py [--cp 2] [--layers 2] [--hidden 512] [--kv-heads 8] [--seq-per-rank 512]
                                     [--steps 20] [--repeats 3] [--trace ring.json]

On CUDA a wait does not block the host (NCCL's streams), so host timestamps cannot see hidden time there;
this bench runs on the CPU with gloo. Not a test: nothing here asserts.
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
import time  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.config.schema import ModelConfig  # noqa: E402
from megazero.costs import layers_flops_per_token  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402
from megazero.parallel.comm import Comm  # noqa: E402
from megazero.parallel.sequence import SequenceSplit  # noqa: E402

WARMUP = 3
VOCAB, HEAD_DIM, MODEL_SEED, DATA_SEED = 512, 64, 0, 1234
VARIANTS = ("ring", "blocking", "cp=1")
CP_TAGS = ("context_kv", "context_grad")


class AttentionClock:
    """CPU seconds the calling thread spends in the ring's block attention, forward and backward:
    ``parallel.context``'s two block functions wrapped for this process (the bench's own instrumentation; every
    call goes through). Thread CPU time, not wall time: with more ranks than cores a rank's wall time inside a
    block includes the time it waited for a core, which measures the machine, not the work. One torch thread
    per rank (``--threads 1``) keeps the work on this thread."""

    def __init__(self) -> None:
        import megazero.parallel.context as ring

        self.seconds = 0.0
        for name in ("block_attention", "block_attention_backward"):
            setattr(ring, name, self._timed(getattr(ring, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            out = fn(*args, **kwargs)
            self.seconds += time.thread_time() - t0
            return out
        return call


class RingTimeline:
    """Host timestamps of every cp transfer posted through one :class:`Comm` (``exchange`` wrapped on the
    instance). ``blocking``: wait for each batch as soon as it is posted. Each record: tag, bytes, ``post``
    and ``posted`` (the call), ``wait_start``/``wait_end`` (its first wait). (Gloo's ``is_completed`` stays
    False until a wait, so the wait's own length is what tells a finished transfer.)"""

    def __init__(self, comm: Comm):
        self.records: list[dict] = []
        self.blocking = False
        self._exchange = comm.exchange
        comm.exchange = self._timed_exchange

    def _timed_exchange(self, ops, times: int = 1) -> list:
        rec = {"tag": ops[0][3], "bytes": sum(t.numel() * t.element_size() for kind, t, _, _ in ops if kind == "send"),
               "post": time.perf_counter(), "wait_start": None, "wait_end": None}
        works = self._exchange(ops, times)
        rec["posted"] = time.perf_counter()
        self.records.append(rec)
        timed = _BatchWait(works, rec)
        if self.blocking:
            timed.wait()
        return [timed] + [_Done()] * (len(works) - 1)  # the callers wait on each handle: one wait stands for all

    def clear(self) -> None:
        self.records.clear()

    def blocked(self) -> float:
        """Seconds the host spent posting cp transfers and waiting for them."""
        return sum(r["posted"] - r["post"] + (r["wait_end"] - r["wait_start"] if r["wait_end"] else 0.0)
                   for r in self.records)


class _BatchWait:
    """One batch of transfers' handles behind one timed ``wait()``."""

    def __init__(self, works: list, rec: dict):
        self.works, self.rec = works, rec

    def wait(self, *args) -> Any:
        if self.rec["wait_start"] is None:
            self.rec["wait_start"] = time.perf_counter()
            for w in self.works:
                w.wait(*args)
            self.rec["wait_end"] = time.perf_counter()
        return True


class _Done:
    def wait(self, *args) -> bool:
        return True


def _model_cfg(args: argparse.Namespace, seq: int) -> ModelConfig:
    heads = args.hidden // HEAD_DIM
    return ModelConfig(arch="llama", layers=args.layers, hidden=args.hidden, heads=heads,
                       kv_heads=args.kv_heads or heads, ffn_hidden=args.hidden * 8 // 3 // 64 * 64, seq_len=seq,
                       vocab_size=VOCAB, dropout=0.0, bias=False)


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cp = Comm(dist.group.WORLD, "cp")
    one = Comm(None, "cp")
    seq = args.seq_per_rank * world
    models = {"ring": build_gpt(_model_cfg(args, seq), MODEL_SEED, cp=cp),
              "cp=1": build_gpt(_model_cfg(args, args.seq_per_rank), MODEL_SEED, cp=one)}
    gen = torch.Generator().manual_seed(DATA_SEED)
    rows = torch.randint(1, VOCAB, (args.micro_batch, seq + 1), generator=gen)
    inputs = {"ring": SequenceSplit(cp)(rows, torch.device("cpu")),
              "cp=1": SequenceSplit(one)(rows[:, rank * args.seq_per_rank:(rank + 1) * args.seq_per_rank + 1],
                                         torch.device("cpu"))}
    timeline = RingTimeline(cp)
    clock = AttentionClock()
    attention: list[float] = []

    def step(variant: str) -> tuple[float, float]:
        model = models["cp=1" if variant == "cp=1" else "ring"]
        x, t, info = inputs["cp=1" if variant == "cp=1" else "ring"]
        model.zero_grad(set_to_none=True)
        timeline.clear()
        before = clock.seconds
        timeline.blocking = variant == "blocking"
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, t, info)[0].sum() / t.numel()
        loss.backward()
        elapsed = time.perf_counter() - t0
        if variant == "ring":
            attention.append(clock.seconds - before)
        return elapsed, timeline.blocked()

    order = [VARIANTS[(i + j) % 3] for i in range(3) for j in range(3)]  # each first, second and third alike
    for v in order[:WARMUP * 3]:
        step(v)
    repeats = []
    for _ in range(args.repeats):
        times: dict[str, list] = {v: [] for v in VARIANTS}
        blocked: dict[str, list] = {v: [] for v in VARIANTS}
        for i in range(args.steps):
            for v in order[3 * (i % 3):3 * (i % 3) + 3]:
                elapsed, b = step(v)
                times[v].append(elapsed)
                blocked[v].append(b)
        repeats.append({v: (statistics.median(times[v]), statistics.median(blocked[v])) for v in VARIANTS})
    origin = time.perf_counter()
    step("ring")  # one more, traced
    trace = [{k: (v - origin if isinstance(v, float) and k not in ("bytes",) else v) for k, v in r.items()}
             for r in timeline.records]
    alone = [_transfers_alone(cp, timeline) for _ in range(args.steps)]
    return {"repeats": repeats, "trace": trace, "alone": statistics.median(alone),
            "attention": statistics.median(attention), "pairs": _planned_pairs(args.seq_per_rank // 2, world, rank)}


def _planned_pairs(chunk: int, cp: int, rank: int) -> int:
    """(query, key) pairs this rank's ring computes by its block plan (a causal block its lower triangle)."""
    from megazero.parallel.context import _block_plan

    pairs = 0
    for step in range(cp):
        for rows, keys, causal in _block_plan(step, (rank - step) % cp, rank, chunk):
            n, m = rows.stop - rows.start, keys.stop - keys.start
            pairs += n * (n + 1) // 2 if causal else n * m
    return pairs


def _transfers_alone(cp: Comm, timeline: RingTimeline) -> float:
    """Seconds a ring step's messages take by themselves: each (the sizes of the last traced step) posted right
    after a barrier, so both ranks are there, and waited at once; nothing runs beside them."""
    sizes = [r["bytes"] for r in timeline.records]
    rank, size = cp.rank, cp.size
    total = 0.0
    for nbytes in sizes:
        out, into = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
        dist.barrier()
        t0 = time.perf_counter()
        for w in timeline._exchange([("send", out, (rank + 1) % size, "alone"),
                                     ("recv", into, (rank - 1) % size, "alone")]):
            w.wait()
        total += time.perf_counter() - t0
    return total


def _ideal(args: argparse.Namespace, cp: int) -> float:
    """Step time at cp over cp = 1 if only FLOPs counted: the weights' work per rank is the same, the
    attention's grows cp-fold (local queries over cp times the keys)."""
    cfg = _model_cfg(args, args.seq_per_rank)
    weights = layers_flops_per_token(cfg, range(cfg.layers), seq_len=0)
    attention = layers_flops_per_token(cfg, range(cfg.layers)) - weights
    return (weights + cp * attention) / (weights + attention)


def _report(results: list[dict], args: argparse.Namespace, world: int) -> None:
    cfg = _model_cfg(args, args.seq_per_rank * world)
    print(f"cp={world} ring, llama layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} kv_heads={cfg.kv_heads} "
          f"seq={cfg.seq_len} ({args.seq_per_rank} per rank) micro_batch={args.micro_batch} fp32 cpu gloo, "
          f"{args.threads} thread(s) per rank: {args.repeats} repeats x {args.steps} steps per variant "
          f"(after {WARMUP} warm-up each)")
    print("ms per step (medians); blocked = time in cp transfers' posts and waits")
    print(f"{'repeat':>6} {'rank':>4} {'ring':>7} {'blocking':>8} {'cp=1':>7} {'blocked ring':>12} "
          f"{'blocked blocking':>16} {'alone':>6} {'hidden':>7} {'ring/cp1':>8} {'ring/blocking':>13}")
    hidden, by_steps, vs_one, vs_blocking = [], [], [], []
    for i in range(args.repeats):
        for rank, res in enumerate(results):
            r = res["repeats"][i]
            (ring, b_ring), (blocking, b_blocking), (one, _) = r["ring"], r["blocking"], r["cp=1"]
            alone = res["alone"]
            share = (b_blocking - b_ring) / alone if alone > 0 else float("nan")
            hidden.append(share)
            by_steps.append((blocking - ring) / alone if alone > 0 else float("nan"))
            vs_one.append(ring / one)
            vs_blocking.append(ring / blocking)
            print(f"{i:>6} {rank:>4} {ring * 1e3:>7.1f} {blocking * 1e3:>8.1f} {one * 1e3:>7.1f} "
                  f"{b_ring * 1e3:>12.1f} {b_blocking * 1e3:>16.1f} {alone * 1e3:>6.1f} {share:>7.1%} {ring / one:>8.3f} "
                  f"{ring / blocking:>13.3f}")
    print(f"transfer time hidden: median {statistics.median(hidden):.1%}; from step times, (blocking - ring) / "
          f"alone: median {statistics.median(by_steps):.1%} ({min(by_steps):.0%} to {max(by_steps):.0%})")
    print(f"step time ring / cp=1 at {args.seq_per_rank} tokens per rank: median {statistics.median(vs_one):.3f} "
          f"(FLOPs ideal {_ideal(args, world):.3f}); ring / blocking: median {statistics.median(vs_blocking):.3f}")
    seconds = [r["attention"] for r in results]
    pairs = [r["pairs"] for r in results]
    print(f"attention per training step, CPU ms by rank (median): {' '.join(f'{x * 1e3:.1f}' for x in seconds)}; busiest / "
          f"least busy {max(seconds) / min(seconds):.3f} (block plan's (query, key) pairs: "
          f"{max(pairs) / min(pairs):.3f})")
    trace = results[0]["trace"]
    print(f"\none traced ring step, rank 0: {len(trace)} transfers (ms from the step's start)")
    print(f"{'#':>3} {'tag':>12} {'KB':>6} {'post at':>8} {'post':>6} {'under':>7} {'wait':>6}")
    for n, r in enumerate(trace):
        print(f"{n:>3} {r['tag']:>12} {r['bytes'] / 1024:>6.0f} {r['post'] * 1e3:>8.2f} "
              f"{(r['posted'] - r['post']) * 1e3:>6.2f} {(r['wait_start'] - r['posted']) * 1e3:>7.2f} "
              f"{(r['wait_end'] - r['wait_start']) * 1e3:>6.2f}")
    ended = sum(r["wait_end"] - r["wait_start"] < 1e-3 for r in trace)
    print(f"transfers whose wait blocked < 1 ms (ended under the block of attention they were posted before): "
          f"{ended} of {len(trace)}")


def _write_trace(path: str, results: list[dict]) -> None:
    """Chrome trace events: per rank (pid), K/V hops (track 1) and the host's work under each (track 0), dK/dV
    hops (track 3) and the host's work under each (track 2): a K/V hop and a dK/dV hop overlap in backward."""
    events = []
    for rank, res in enumerate(results):
        for n, r in enumerate(res["trace"]):
            us = lambda t: t * 1e6  # noqa: E731
            track = 1 if r["tag"] == "context_kv" else 3
            events.append({"name": f"{r['tag']} {n} ({r['bytes'] // 1024} KB)", "ph": "X", "pid": rank, "tid": track,
                           "ts": us(r["post"]), "dur": us(r["wait_end"] - r["post"])})
            events.append({"name": f"host work while transfer {n} is in flight", "ph": "X", "pid": rank,
                           "tid": track - 1,
                           "ts": us(r["posted"]), "dur": us(r["wait_start"] - r["posted"])})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=0, help="k/v heads (0: as many as query heads)")
    parser.add_argument("--seq-per-rank", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--trace", help="write one ring step's timeline here (Chrome trace JSON)")
    args = parser.parse_args(argv)
    if args.seq_per_rank % 2:
        print(f"--seq-per-rank {args.seq_per_rank}: must be even (two head-tail chunks per rank)", file=sys.stderr)
        return 2
    from tests.dist import run_ranks

    results = run_ranks(args.cp, _bench_rank, args, timeout=3600)
    _report(results, args, args.cp)
    if args.trace:
        _write_trace(args.trace, results)
        print(f"trace: {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
