"""Newton-Schulz benchmark: Muon's orthogonalisation (``kernels.newton_schulz``, five quintic steps) on square
and rectangular matrices, fp32 and bf16, in TFLOP/s against the device's matmul peak.

FLOPs per call: 5 (4 m^2 n + 2 m^3) with m = min and n = max of the shape (``newton_schulz_flops``). Each
contender runs ``--steps`` timed calls after warm-up, ``--repeats`` rounds; medians of the rounds' medians. On
CUDA with ``torch.compile`` too (one graph per shape: the five steps fused where the compiler can).

    python bench/newton_schulz.py [--device cpu|cuda] [--steps 20] [--repeats 3] [--smoke]

Prints a markdown table: shape, dtype, ms per call and TFLOP/s (and the share of ``--peak`` TFLOP/s, default
989, an H100/H200's dense bf16). Not a test: nothing here asserts.
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

from megazero.kernels.newton_schulz import newton_schulz, newton_schulz_flops  # noqa: E402

WARMUP = 3
# a 4096-wide model's square and MLP matrices (the 4096 x 4096 first), and Llama-8B's MLP shape
CUDA_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
CPU_SHAPES = ((512, 512), (512, 2048))
SMOKE_SHAPES = ((32, 32), (32, 64))


def time_calls(fn, steps: int, sync) -> float:
    """Median seconds per call over ``steps`` calls, each timed alone."""
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak", type=float, default=989.0, help="the device's dense bf16 TFLOP/s")
    ap.add_argument("--smoke", action="store_true", help="toy shapes, 2 steps x 1 repeat: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.repeats = 2, 1
    device = torch.device(args.device)
    shapes = SMOKE_SHAPES if args.smoke else (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as fp32: the optimizer's own setting
    contenders = [("eager", newton_schulz)]
    if device.type == "cuda":
        contenders.append(("compiled", torch.compile(newton_schulz, dynamic=False)))
    gen = torch.Generator().manual_seed(0)
    print(f"### Newton-Schulz (5 steps), {device.type}, {args.steps} calls x {args.repeats} repeats", flush=True)
    print("", "| shape | dtype | contender | ms/call | TFLOP/s | of peak |", "|---|---|---|---:|---:|---:|",
          sep="\n", flush=True)
    for rows, cols in shapes:
        flops = newton_schulz_flops(rows, cols)
        for dtype in dtypes:
            g = torch.randn(rows, cols, generator=gen).to(device=device, dtype=dtype)
            for label, fn in contenders:
                for _ in range(WARMUP):
                    fn(g)
                sync()
                med = statistics.median(time_calls(lambda: fn(g), args.steps, sync) for _ in range(args.repeats))
                tflops = flops / med / 1e12
                print(f"| {rows} x {cols} | {str(dtype).removeprefix('torch.')} | {label} | {med * 1e3:.3f} | "
                      f"{tflops:.1f} | {tflops / args.peak:.1%} |", flush=True)


if __name__ == "__main__":
    main()
