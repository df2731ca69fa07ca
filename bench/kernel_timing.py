"""What the kernel benchmarks share (bench/kernels.py and its grouped-query part, bench/kernels_gqa.py): the
sizes a run measures, the FLOP count, the timer, and printing a row as soon as it is measured."""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Sizes:
    """What one run measures: full sizes on a GPU, toy ones for --smoke."""
    device: torch.device
    hidden: int = 2048  # batch * heads * head_dim: every attention call is tokens rows of this width
    tokens: int = 16384
    head_dims: tuple[int, ...] = (64, 128)
    seqs: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    adam_elements: int = 256 * 2**20


def attention_flops(b: int, h: int, s: int, d: int, causal: bool = True) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs as Dao 2023 counts them."""
    fwd = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return fwd, 3.5 * fwd


def bench_ms(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """Median ms of fn, or None when it cannot run here (e.g. an SDPA backend with no kernel for the input).

    CUDA: triton's do_bench (CUDA events, L2 flushed between runs). CPU (--smoke): wall clock of 3 calls."""
    try:
        fn()  # compile / autotune outside the timed region, and check it runs at all
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 -- one contender failing must not end the benchmark
        print(f"  (skipped: {(str(err).splitlines() or [type(err).__name__])[0][:120]})", file=sys.stderr)
        return None
    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def release(device: torch.device) -> None:
    """Give the measured tensors' memory back to the device before the next size."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def emit(*lines: str) -> None:
    """Print now: a run cut short by a time limit keeps every row measured so far."""
    print("\n".join(lines), flush=True)


def fmt(x: Optional[float], spec: str = ".0f") -> str:
    """A table cell: ``x`` formatted, or n/a for a contender that could not run."""
    return "n/a" if x is None else format(x, spec)
