"""Offloaded optimizer on a GPU: do the gradients' device-to-host copies overlap the backward?

ZeRO-Offload (Ren et al. 2021, section 4.1) hides the gradient copies to the host behind the backward:
each bucket is copied as soon as its reduced gradient is final, on a side stream. This builds a GPT on
one GPU under ZeRO-2 with the optimizer states in pinned CPU memory (bf16, 2 microbatches), runs
warm-up steps through ``megazero.engine.step.train_step``, then times one step with CUDA events: when the
backward's last kernel ended on the compute stream (the executor's timeline), and when each bucket's copy
ended on the copy stream (the optimizer's ``copy_events``). A copy that ended before the backward did was
hidden entirely.

    python bench/offload_overlap.py [--layers 12 --hidden 768 --seq 1024 --micro-batch 4] [--smoke]

Prints markdown lines; ``--smoke`` runs a toy model on the CPU (no copies to time: checks the script).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402

import torch  # noqa: E402

from megazero.config.schema import ModelConfig, ZeroConfig  # noqa: E402
from megazero.engine.build import make_executor, make_schedules, make_zero  # noqa: E402
from megazero.engine.step import train_step  # noqa: E402
from megazero.models.build import build_gpt  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402

M = 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.heads, args.seq, args.vocab, args.micro_batch = 2, 64, 2, 32, 128, 2
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("bench/offload_overlap.py needs a CUDA GPU (--smoke runs it on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    cfg = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq,
                      vocab_size=args.vocab)
    grid = Grid.build(1, 1, 1, device.type)
    model = build_gpt(cfg, 0, device=device, tp=grid.tp_comm)
    offloaded = ZeroConfig(stage=2, reshard_after_forward=True, offload_optimizer="cpu")
    zero = make_zero([model], grid, offloaded, "bf16", 0.1, device, adam_impl="fused")
    tokens = M * args.micro_batch * args.seq
    executor = make_executor([model], grid, device, args.micro_batch, args.seq, args.hidden, "bf16", tokens)
    schedule = make_schedules("1f1b", grid, M)[0]
    gen = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen) for _ in range(M)]
    for _ in range(3):  # warm-up: allocator, kernels' autotuning, pinned buffers
        train_step(zero, executor, schedule, mbs, 1e-4, 1.0)
    psi = sum(p.numel() for p in model.parameters())
    print(f"- model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, {psi / 1e6:.1f}M parameters; "
          f"ZeRO-2, bf16, optimizer offloaded (fused CPU AdamW), {M} microbatches of {args.micro_batch}; "
          f"{len(zero.buckets)} buckets")
    if not cuda:
        print("- smoke run on the CPU: no device-to-host copies to time")
        return 0

    # the executor's timeline ends at the schedule's last kernel (its stamps are CUDA events); the optimizer
    # records an event after each bucket's copy to the host when asked to
    zero.optim.copy_events = copies = []
    torch.cuda.synchronize()
    train_step(zero, executor, schedule, mbs, 1e-4, 1.0)
    torch.cuda.synchronize()
    zero.optim.copy_events = None
    start, backward_end = executor.trace_origin, executor.trace[-1][-1]
    end_ms = start.elapsed_time(backward_end)
    ended = [(n, start.elapsed_time(e)) for n, e in copies]
    hidden = [n for n, t in ended if t <= end_ms]
    last = max(t for _, t in ended) if ended else end_ms
    total = sum(n for n, _ in ended)
    print(f"- schedule (forwards and backwards) ended at {end_ms:.2f} ms; {len(ended)} gradient copies to the "
          f"host ({total / 2 ** 20:.0f} MiB), {len(hidden)} of them ended before it ({sum(hidden) / 2 ** 20:.0f} "
          f"MiB hidden); the last ended at {last:.2f} ms ({max(0.0, last - end_ms):.2f} ms after the backward)")
    ok = len(ended) > 0 and sum(hidden) >= total / 2
    print(f"- verdict: {'ok' if ok else 'NOT overlapped'}: at least half the gradient bytes reach the host "
          f"before the backward ends")

    # a checkpoint's view of the offloaded states: read from host memory, not staged on the device
    states = zero.optim.state_bytes()
    masters = [t.clone() for t in zero.optim.master]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    exported = zero.export_state()
    staged = torch.cuda.max_memory_allocated(device) - before
    places = {t.device.type for kinds in exported.values() for t in kinds.values()}
    zero.import_state(exported, zero.step_count)
    same = all(torch.equal(a, b) for a, b in zip(masters, zero.optim.master))
    bucket = max(b.numel for b in zero.buckets) * 4  # one bucket of one fp32 state
    # one bucket at a time: its three states gathered and one copy on its way to the device, plus one bucket
    # of slack for the caching allocator's block rounding
    saved_ok = places == {"cpu"} and staged <= 5 * bucket and same
    print(f"- checkpoint export under offload: parameters and optimizer states handed over in {sorted(places)} memory; device "
          f"memory staged {staged / 2 ** 20:.1f} MiB (bound: 5 fp32 buckets, {5 * bucket / 2 ** 20:.0f} MiB) "
          f"against {states / 2 ** 20:.0f} MiB of optimizer state; "
          f"export then import leaves the masters {'equal' if same else 'CHANGED'}: "
          f"{'ok' if saved_ok else 'NOT ok'}")
    return 0 if ok and saved_ok else 1


if __name__ == "__main__":
    sys.exit(main())
