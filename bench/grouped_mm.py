"""Grouped-matmul benchmark: the ways ``kernels.grouped`` can run an MoE layer's per-expert matmuls, forward +
backward, at a few expert shapes.

Contenders, each y[rows of group g] = x[rows of group g] @ w[g].T with gradients for x and w:

  torch._grouped_mm  ``kernels.grouped.grouped_mm(impl="grouped")``: every group in one call
  loop               ``kernels.grouped.grouped_mm_loop``: one matmul per group over its rows (split, cat)
  padded bmm         the rows scattered into (groups, largest group, in) zeros, one ``torch.bmm``, gathered back

On the CPU in fp32 (what ``kernels.grouped`` runs there), on CUDA in bf16. FLOPs: 2·rows·in·out forward, three
times that forward + backward. Group sizes are random around the balanced load (and one skewed case: half the
rows to one group), as a router makes them. ``--steps`` timed steps after warm-up, ``--repeats`` rounds, the
contenders alternating step by step; medians of the rounds' medians.

    python bench/grouped_mm.py [--device cpu|cuda] [--steps 20] [--repeats 3] [--smoke]

Prints a markdown table (ms and TFLOP/s of each contender, loop / grouped), the max |difference| of each from
the loop's output and gradients, and the fastest contender at each shape. ``bench/moe.py`` prints the same table
on the CPU, ``bench/gpu_checks.py`` runs this on the GPU. Not a test: nothing here asserts.
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
from typing import Callable, NamedTuple, Optional  # noqa: E402

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from megazero.kernels.grouped import grouped_mm, grouped_mm_loop, grouped_mm_supported  # noqa: E402

NAMES = ("torch._grouped_mm", "loop", "padded bmm")
WARMUP = 3
# each contender rounds its fp32 accumulation to the output dtype once: relative to the largest value, bf16
# differs by about 2^-8 (one rounding each side), fp32 by a few ulps of the accumulation order
BOUND = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


class Shape(NamedTuple):
    groups: int
    rows: int
    inner: int  # the input width
    outer: int  # the output width
    skew: bool = False  # half the rows to group 0

    def label(self) -> str:
        return f"{self.groups} x ({self.outer}, {self.inner}), {self.rows} rows" + (", skewed" if self.skew else "")


# bench/moe.py's experts (gate and up; 1024 tokens, top 2), the same with half the copies to one expert, and
# fine-grained experts of the same FLOPs (64 of a quarter the width, top 8)
CPU_SHAPES = (Shape(8, 2048, 512, 1024), Shape(8, 2048, 512, 1024, True), Shape(64, 8192, 512, 256))
# Mixtral-8x7B (8192 tokens, top 2), Qwen3-30B-A3B (8192 tokens, top 8), DeepSeek-V3's 32 experts of an ep-8 rank
CUDA_SHAPES = (Shape(8, 16384, 4096, 14336), Shape(128, 65536, 2048, 768), Shape(32, 32768, 7168, 2048))
SMOKE_SHAPES = (Shape(4, 64, 16, 32), Shape(4, 64, 16, 32, True))


def group_sizes(shape: Shape, gen: torch.Generator) -> list[int]:
    """Random sizes summing to ``rows``: a multinomial draw over equal groups (or half to group 0 when skewed)."""
    g, rows = shape.groups, shape.rows
    if shape.skew:
        rest = torch.multinomial(torch.ones(g - 1), rows - rows // 2, replacement=True, generator=gen)
        return [rows // 2] + torch.bincount(rest, minlength=g - 1).tolist()
    return torch.bincount(torch.multinomial(torch.ones(g), rows, replacement=True, generator=gen),
                          minlength=g).tolist()


def padded_bmm(x: Tensor, weight: Tensor, sizes: list[int]) -> Tensor:
    """The rows of each group padded to the largest group, one batched matmul, the padding dropped."""
    g, most = len(sizes), max(sizes)
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    slot = torch.arange(g) * most - starts  # row i of group j lands at j*most + (i - start_j)
    where = (torch.arange(x.shape[0]) + slot.repeat_interleave(torch.tensor(sizes))).to(x.device)
    padded = x.new_zeros(g * most, x.shape[1]).index_copy(0, where, x).view(g, most, x.shape[1])
    return torch.bmm(padded, weight.to(x.dtype).transpose(1, 2)).reshape(g * most, -1).index_select(0, where)


def contenders(sizes: list[int], offsets: Tensor) -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    return {"torch._grouped_mm": lambda x, w: grouped_mm(x, w, sizes, offsets, impl="grouped"),
            "loop": lambda x, w: grouped_mm_loop(x, w, sizes),
            "padded bmm": lambda x, w: padded_bmm(x, w, sizes)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_shape(shape: Shape, device: torch.device, dtype: torch.dtype, steps: int, repeats: int,
                seed: int = 0) -> dict:
    """{"sizes", "ms": {name: [round medians]}, "diff": {name: max |difference| from the loop}}; a contender
    that cannot run here is left out (its error in "skipped")."""
    sizes = group_sizes(shape, torch.Generator().manual_seed(seed))
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: a GPU's shapes are large

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    x = randn(shape.rows, shape.inner).requires_grad_()
    w = randn(shape.groups, shape.outer, shape.inner, scale=shape.inner ** -0.5).requires_grad_()
    dy = randn(shape.rows, shape.outer)
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    fns, outs, skipped = contenders(sizes, offsets), {}, {}
    for name, fn in list(fns.items()):
        try:
            y = fn(x, w)
            outs[name] = [y.detach().float(), *(t.float() for t in torch.autograd.grad(y, (x, w), dy))]
        except Exception as err:  # noqa: BLE001 -- a contender that cannot run here is reported, not fatal
            skipped[name] = (str(err).splitlines() or [type(err).__name__])[0][:100]
            del fns[name]
    ref = outs["loop"]
    diff = {n: max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(o, ref))
            for n, o in outs.items()}
    times: dict[str, list[list[float]]] = {n: [[] for _ in range(repeats)] for n in fns}
    order = list(fns)
    for r in range(repeats):
        for k in range(WARMUP + steps):
            for name in order[k % len(order):] + order[:k % len(order)]:
                _sync(device)
                t0 = time.perf_counter()
                torch.autograd.grad(fns[name](x, w), (x, w), dy)
                _sync(device)
                if k >= WARMUP:
                    times[name][r].append(time.perf_counter() - t0)
    ms = {n: [1e3 * statistics.median(t) for t in ts] for n, ts in times.items()}
    return {"sizes": sizes, "ms": ms, "diff": diff, "skipped": skipped}


def flops(shape: Shape) -> float:
    """Forward + backward FLOPs of one grouped matmul (dx and dw each cost the forward's)."""
    return 3 * 2.0 * shape.rows * shape.inner * shape.outer


def _cell(x: Optional[float], spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def report(shapes: tuple[Shape, ...], device: torch.device, dtype: torch.dtype, steps: int, repeats: int) -> list[str]:
    """Measure every shape; the markdown lines (table, then one line per shape naming the fastest)."""
    dt = str(dtype).replace("torch.", "")
    lines = [f"Grouped matmul, {device.type} {dt}, forward + backward (dx, dw): ms (TFLOP/s), medians of {repeats} "
             f"rounds of {steps} steps; max |difference| from the loop relative to its largest value",
             "",
             "| groups x (out, in), rows | group sizes min-max | " + " | ".join(f"{n} ms (TFLOP/s)" for n in NAMES)
             + " | loop / grouped | padded bmm / grouped | max rel. difference (grouped, bmm) |",
             "|---|---|" + "---|" * (len(NAMES) + 3)]
    verdicts, worst = [], 0.0
    for shape in shapes:
        print(f"grouped matmul: {shape.label()}", file=sys.stderr, flush=True)
        got = bench_shape(shape, device, dtype, steps, repeats)
        med = {n: statistics.median(v) for n, v in got["ms"].items()}
        cells = [f"{_cell(med.get(n), '.2f')} ({_cell(flops(shape) / med[n] / 1e9 if n in med else None, '.3g')})"
                 for n in NAMES]
        g = med.get("torch._grouped_mm")
        ratios = [_cell(med[n] / g if g and n in med else None, ".2f") for n in ("loop", "padded bmm")]
        diffs = ", ".join(_cell(got["diff"].get(n), ".1e") for n in ("torch._grouped_mm", "padded bmm"))
        lines.append(f"| {shape.label()} | {min(got['sizes'])}-{max(got['sizes'])} | " + " | ".join(cells)
                     + f" | {' | '.join(ratios)} | {diffs} |")
        worst = max([worst] + list(got["diff"].values()))
        best = min(med, key=med.get)
        verdicts.append(f"- fastest at {shape.label()}: {best}" + "".join(
            f"; {n} not run: {why}" for n, why in got["skipped"].items()))
    bound = BOUND[dtype]
    return lines + [""] + verdicts + [f"- largest relative difference from the loop: {worst:.1e} (bound {bound:g}): "
                                      f"{'ok' if worst <= bound else 'FAILED'}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round, after warm-up")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default torch's)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes, 1 step: checks the script")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/grouped_mm.py --device cuda needs a CUDA GPU: torch.cuda.is_available() is False here",
              file=sys.stderr)
        sys.exit(2)
    if args.threads or args.smoke:  # toy shapes: one thread, no waking of idle ones
        torch.set_num_threads(args.threads or 1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    steps, repeats = (1, 1) if args.smoke else (args.steps, args.repeats)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    probe = torch.empty(1, device=device, dtype=dtype)
    print(f"### Grouped matmul: {where}, torch {torch.__version__}\n\n"
          f"kernels.grouped picks {'torch._grouped_mm' if grouped_mm_supported(probe) else 'loop'} here (auto)\n")
    print("\n".join(report(shapes, device, dtype, steps, repeats)), flush=True)


if __name__ == "__main__":
    main()
