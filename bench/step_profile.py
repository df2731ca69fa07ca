"""Where one process's training step spends its time, per kernel set: the device's busy time against the wall.

A step is device-bound when the GPU is busy for most of its wall time; when it is not, the host (Python, kernel
launches) sets the pace and a faster kernel cannot help. For each kernel set (``kernels.attention`` x
``kernels.adam``) this builds the real trainer (pretrain.py's path, one process) and prints:

- wall ms per step: the median of 3 windows of 20 steps each, after 5 warm-up steps (autotuning included
  there);
- from a torch.profiler capture of 3 more steps: the device's busy time per step (the union of its kernels'
  intervals, so overlapping kernels count once), kernel launches per step, and the kernels that take the most
  device time;
- the host's cost of one attention call at the model's shape: the time to enqueue a forward, measured over 50
  calls without a synchronisation between them, where the device is not the bottleneck (batch 1).

    python bench/step_profile.py [--config configs/tiny.yaml] [--set k=v ...] [--sets torch/torch,triton/triton]

``--smoke`` runs the same code on the CPU at toy sizes (Triton under its interpreter). Not a test.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or os.curdir) not in (ROOT, HERE)]
if "--smoke" in sys.argv:  # before triton is imported anywhere: the interpreter is chosen at import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

from megazero.config.load import load_config  # noqa: E402
from megazero.config.resolve import resolve  # noqa: E402
from megazero.train.trainer import Trainer  # noqa: E402
from megazero.parallel.topology import Grid  # noqa: E402
from megazero.parallel.dims import ParallelDims

WARMUP, WINDOWS, WINDOW_STEPS, PROFILED = 5, 3, 20, 3
GPT2_SMALL = ["model.layers=12", "model.hidden=768", "model.heads=12", "model.seq_len=1024",
              "train.global_batch=16", "train.micro_batch=16"]
ONE_PROCESS = ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=1", "parallel.dp=1",
               "train.eval_every=0", "log.tensorboard=false", "train.precision=bf16", "train.save_every=0"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by these (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def _device_kernels(trace_path: str) -> list[dict]:
    """The device-side kernel events of a chrome trace torch.profiler wrote (microseconds)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def launch_cost_us(impl: str, cfg, device: torch.device, calls: int = 50) -> float:
    """Host microseconds to enqueue one attention forward at the model's head shape, batch 1."""
    from megazero.kernels.attend import attention

    h, d, s = cfg.model.heads, cfg.model.head_width, cfg.model.seq_len
    q, k, v = (torch.randn(1, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        attention(q, k, v, causal=True, impl=impl)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        attention(q, k, v, causal=True, impl=impl)
    per_call = (time.perf_counter() - t0) / calls * 1e6
    _sync(device)
    return per_call


def profile_set(config: str, sets: list[str], attention: str, adam: str, smoke: bool) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, sets + [f"kernels.attention={attention}", f"kernels.adam={adam}", f"log.dir={tmp}"])
        device = torch.device(cfg.launch.device if cfg.launch.device != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        resolve(cfg, 1, device.type)  # as pretrain.py's entry point does
        trainer = Trainer(cfg, Grid.build(ParallelDims(tp=1, pp=1, dp=1), device.type), device)
        warmup, windows, window_steps, profiled = (1, 2, 2, 1) if smoke else (WARMUP, WINDOWS, WINDOW_STEPS, PROFILED)
        for _ in range(warmup):
            trainer.train_step()
        means = []
        for _ in range(windows):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(window_steps):
                trainer.train_step()  # its one host read waits for the device mid-step; the last step's tail:
            _sync(device)
            means.append((time.perf_counter() - t0) / window_steps * 1e3)
        wall = statistics.median(means)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(profiled):
                trainer.train_step()
            _sync(device)
        lines = [f"### kernels.attention={attention}, kernels.adam={adam}", "",
                 f"- wall: {wall:.2f} ms/step (median of {windows} windows of {window_steps} steps: "
                 + ", ".join(f"{m:.2f}" for m in means) + ")"]
        if device.type == "cuda":
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            kernels = _device_kernels(trace)
            busy = _busy_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / 1e3 / profiled
            per_name = defaultdict(float)
            for e in kernels:
                per_name[e["name"]] += e["dur"] / 1e3 / profiled
            lines.append(f"- device busy: {busy:.2f} ms/step, {busy / wall:.0%} of the wall; "
                         f"{len(kernels) / profiled:.0f} kernels and copies per step")
            lines.append("- most device time (ms/step):")
            for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[:12]:
                lines.append(f"  - {ms:7.3f}  {name[:110]}")
        else:
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        lines.append(f"- enqueueing one attention forward (batch 1): {launch_cost_us(attention, cfg, device):.0f} us "
                     f"on the host")
        lines.append(f"- host syncs per step: {host_syncs(trainer, device)} (a step not logged; its one is the "
                     f"optimizer's read of the agreed flags and the norm)")
        del trainer, prof
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return lines


def host_syncs(trainer, device: torch.device, steps: int = 3) -> str:
    """Synchronisations per step that CUDA's sync debug mode reports (one warning each), over a few steps;
    "n/a" on the CPU, where nothing synchronises (tests/engine/test_host_reads.py counts the reads there)."""
    if device.type != "cuda":
        return "n/a on the CPU"
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                trainer.train_step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return f"{sum('synchroniz' in str(w.message) for w in caught) / steps:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--sets", default="torch/torch,triton/torch,torch/triton,triton/triton",
                    help="comma-separated ATTENTION/ADAM kernel pairs")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script")
    args = ap.parse_args()
    if args.smoke:
        # fp32: Triton's interpreter computes bf16 wrongly, and a CPU without native bf16 runs it ~5x slower
        body = ["launch.device=cpu", "model.layers=1", "model.hidden=64", "model.heads=1", "model.seq_len=32",
                "train.global_batch=1", "train.micro_batch=1", "train.precision=fp32"]
    else:
        if not torch.cuda.is_available():
            print("bench/step_profile.py needs a CUDA GPU (--smoke runs the script on the CPU)", file=sys.stderr)
            return 2
        body = ["launch.device=cuda", *GPT2_SMALL]
    sets = ONE_PROCESS + body + args.set
    print(f"## One training step, one process: {' '.join(body[1:] + args.set)}\n")
    for pair in args.sets.split(","):
        attention, adam = pair.split("/")
        print("\n".join(profile_set(args.config, sets, attention, adam, args.smoke)) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
