"""CPU optimizer benchmark: megazero's flat fused AdamW against torch.optim.AdamW, and LAMB and Muon against both.

A GPT's parameter shapes (2-D matrices that decay; embeddings, biases and LayerNorm vectors that do not,
~7-11% of the elements), fp32 masters and fp32 grads, AdamW (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight
decay 0.1) stepped by:

  new flat fused     kernels.adam.adamw("fused", ...): one flat master/grad/m/v buffer with precomputed decay
                     runs, as parallel.zero calls it (kernels.adam_cpu.adamw_step_fused)
  torch fused        torch.optim.AdamW(fused=True) on the parameter tensors (two param groups)
  torch foreach      torch.optim.AdamW(foreach=True), same tensors
  old flat torch     kernels.adam.adamw_step (the elementwise-ops fallback) on the flat buffers

The per-tensor parameters and grads are views of the flat master and grad buffers (the torch optimizers keep
their own moments, the flat contenders share one pair), so all fit in memory at once and take turns: per
repeat each runs >= 20 timed steps after warm-up, the order rotating, 5 repeats; the table gives the
median (and fastest) repeat's time per step.
Two more rows use the new optimizer as ZeRO may: grad_scale 0.5 and 2 in turn (clipping or unscaling folded
in: the kernel writes the scaled grad back, +4 B/element) and bf16 grads (converted chunk by chunk into a
bounded fp32 scratch).
GB/s counts 28 B/element (read grad, master, m, v; write master, m, v; 26 with bf16 grads) against a
measured ``dst.copy_(src)`` of the same bytes (src and dst of 14 B/element each, counted read + write).
On a small VM the in-place update can beat that copy (> 100%), likely because copy_'s stores first read the
lines they overwrite and one stream per core keeps fewer misses in flight than AdamW's four.

    python bench/optimizer.py [--sizes 12M,30M,300M] [--steps 20] [--repeats 5] [--tables adamw,updates] [--smoke]

Prints a markdown table per size and the ratios new/fused and new/foreach (<= 1.0: at least as fast); then
LAMB (``optim.name: lamb``, parallel.zero.lamb) and Muon (``optim.name: muon``, parallel.zero.muon) on the same
GPT's ZeRO buckets (stage 0, one process) against megazero's AdamW on the same buckets and torch's fused AdamW
on the parameters (LAMB/AdamW, Muon/AdamW), and Muon's Newton-Schulz iterations alone over the same matrices
(their share of Muon's update, and their GFLOP/s). Each step reuses its buffers (LAMB and Muon write their
direction over the gradient, so later steps see other values: the work is the same).
``--smoke``: toy sizes and few steps, to check the script (tests/kernels/test_adam_cpu.py runs it). Not a test.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from megazero.kernels.adam import adamw, adamw_step  # noqa: E402
from megazero.kernels.adam_cpu import decay_runs  # noqa: E402

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
BYTES_FP32, BYTES_BF16 = 28, 26
# name -> (hidden, layers, vocab): GPT-2-like blocks, embeddings sized to ~10% of the elements
PRESETS = {"12M": (384, 6, 4096), "30M": (512, 9, 6144), "300M": (1024, 22, 24576), "smoke": (32, 2, 256)}
SEQ = 1024


def gpt_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, decays) of a GPT's parameters: only >= 2-D weights other than the embeddings decay."""
    h = hidden
    out = [((vocab, h), False), ((SEQ, h), False)]
    for _ in range(layers):
        out += [((h,), False), ((h,), False), ((3 * h, h), True), ((3 * h,), False), ((h, h), True), ((h,), False),
                ((h,), False), ((h,), False), ((4 * h, h), True), ((4 * h,), False), ((h, 4 * h), True), ((h,), False)]
    return out + [((h,), False), ((h,), False)]


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return 1 << 62


def time_steps(fn: Callable[[], None], steps: int) -> float:
    """Seconds per step over ``steps`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def copy_rate(n: int, steps: int, repeats: int) -> float:
    """Copy GB/s (read + write) moving 28 B per element: src and dst of 14 B/element each."""
    count = (n * BYTES_FP32 // 2) // 4
    src, dst = torch.randn(count), torch.empty(count)
    dst.copy_(src)
    times = [time_steps(lambda: dst.copy_(src), steps) for _ in range(repeats)]
    return 2 * 4 * count / statistics.median(times) / 1e9


def contenders(shapes, seed: int = 0) -> dict[str, Callable[[], None]]:
    """Step functions over shared flat master/grad buffers (params are views of them), by contender name."""
    n = sum(torch.Size(s).numel() for s, _ in shapes)
    gen = torch.Generator().manual_seed(seed)
    master, grad = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
    mask = torch.cat([torch.full((torch.Size(s).numel(),), d) for s, d in shapes])
    runs = decay_runs(mask)
    params, offset = [], 0
    for s, d in shapes:
        k = torch.Size(s).numel()
        p = torch.nn.Parameter(master[offset:offset + k].view(s))
        p.grad = grad[offset:offset + k].view(s)
        params.append((p, d))
        offset += k
    m, v = torch.zeros(n), torch.zeros(n)  # the flat contenders share moments (values do not change the time)
    grad_bf16 = grad.to(torch.bfloat16)

    def groups() -> list[dict]:  # new dicts for each optimizer: torch writes its defaults (fused, ...) into them
        return [{"params": [p for p, d in params if d], "weight_decay": HYPER["weight_decay"]},
                {"params": [p for p, d in params if not d], "weight_decay": 0.0}]

    kw = dict(lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"])
    fused, foreach = torch.optim.AdamW(groups(), fused=True, **kw), torch.optim.AdamW(groups(), foreach=True, **kw)
    assert fused.param_groups[0]["fused"] and not foreach.param_groups[0]["fused"], "optimizers share settings"

    def flat(impl: str, g: torch.Tensor, scaled: bool = False):
        step = [0]

        def run() -> None:
            step[0] += 1
            if impl == "old":
                adamw_step(master, g, m, v, step=step[0], decay_mask=mask, **HYPER)
            else:  # scaled: 0.5 and 2 in turn, exact in fp32, so the grad written back keeps its size
                adamw("fused", master, g, m, v, step=step[0], runs=runs, **HYPER,
                      grad_scale=(0.5 if step[0] % 2 else 2.0) if scaled else 1.0)
        return run

    return {"new flat fused": flat("fused", grad), "torch fused": fused.step, "torch foreach": foreach.step,
            "old flat torch": flat("old", grad), "new, grad_scale != 1": flat("fused", grad, scaled=True),
            "new, bf16 grads": flat("fused", grad_bf16)}


def time_in_turns(fns: dict[str, Callable[[], None]], steps: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per step of each contender, per repeat: all warmed up, then ``steps`` timed steps each per repeat,
    the order rotating so none always runs first."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    keys = list(fns)
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(time_steps(fns[k], steps))
    return times


def bench_size(name: str, steps: int, repeats: int, warmup: int) -> list[str]:
    shapes = gpt_shapes(*PRESETS[name])
    n = sum(torch.Size(s).numel() for s, _ in shapes)
    no_decay = sum(torch.Size(s).numel() for s, d in shapes if not d) / n
    runs = decay_runs(torch.cat([torch.full((torch.Size(s).numel(),), d) for s, d in shapes]))
    need = n * (8 + 8 * 3 + 2 + 12)  # master, grad; 3 x (m, v); bf16 grad; the old fallback's temporaries
    if need > 0.9 * mem_available():
        return [f"### {name}: skipped, needs ~{need / 2**30:.1f} GiB, {mem_available() / 2**30:.1f} GiB available"]
    copy_gbs = copy_rate(n, steps, repeats)
    gc.collect()
    fns = contenders(shapes)
    times = time_in_turns(fns, steps, repeats, warmup)
    del fns
    gc.collect()
    lines = [f"### AdamW, {name}: {n / 1e6:.1f}M fp32 parameters in {len(shapes)} tensors ({len(runs)} decay runs, "
             f"{no_decay:.1%} no decay), {torch.get_num_threads()} threads, {steps} steps x {repeats} repeats, "
             f"load average {os.getloadavg()[0]:.1f}",
             "", "| contender | ms/step (median) | fastest | GB/s | of copy |", "|---|---:|---:|---:|---:|"]
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        gbs = n * (BYTES_BF16 if "bf16" in k else BYTES_FP32) / med[k] / 1e9
        lines.append(f"| {k} | {med[k] * 1e3:.2f} | {min(v) * 1e3:.2f} | {gbs:.1f} | {gbs / copy_gbs:.0%} |")
    lines += [f"| copy (dst.copy_(src), {BYTES_FP32} B/element) | {n * BYTES_FP32 / copy_gbs / 1e6:.2f} | | "
              f"{copy_gbs:.1f} | 100% |", "",
              f"- ratio new/fused at {name}: {med['new flat fused'] / med['torch fused']:.3f} "
              "(<= 1.0: at least as fast)",
              f"- ratio new/foreach at {name}: {med['new flat fused'] / med['torch foreach']:.3f}", ""]
    return lines


def bench_updates(name: str, steps: int, repeats: int, warmup: int) -> list[str]:
    """LAMB (parallel.zero.lamb) and Muon (parallel.zero.muon) against megazero's AdamW (fused CPU kernel) and
    torch's fused AdamW, each on the same GPT's parameters, ZeRO stage 0 on one process: the update alone, from
    one fixed reduced gradient per bucket; and Muon's Newton-Schulz iterations alone, over the same matrices."""
    from megazero.kernels.newton_schulz import newton_schulz, newton_schulz_flops
    from megazero.config.load import load_config
    from megazero.config.schema import OptimConfig, ZeroConfig
    from megazero.engine.build import make_zero
    from megazero.models.build import build_gpt
    from megazero.parallel.topology import Grid

    hidden, layers, vocab = PRESETS[name]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"model.hidden={hidden}", f"model.layers={layers}", f"model.heads={max(1, hidden // 64)}",
        f"model.vocab_size={vocab}", "model.seq_len=128", "parallel.tp=1", "parallel.pp=1"]).model
    grid, cpu = Grid.single(), torch.device("cpu")
    fns, n, plan = {}, 0, None
    for label, optim in (("megazero LAMB", "lamb"), ("megazero Muon", "muon"), ("megazero AdamW (fused)", "adamw")):
        zero = make_zero([build_gpt(cfg, 0, tp=grid.tp_comm)], grid, ZeroConfig(stage=0, reshard_after_forward=True),
                         "fp32", HYPER["weight_decay"], cpu, adam_impl="fused", optim=OptimConfig(name=optim))
        part = zero.parts[0]
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(b.numel, generator=gen) * 1e-3 for b in part.buckets]
        n = sum(b.numel for b in part.buckets)
        fns[label] = (lambda o=part.optim, g=grads: o.update(g, HYPER["lr"], 1.0, set()))
        if optim == "muon":
            plan = part.optim.plan
    shapes = [r.matrix.logical_shape for r in plan.rounds]
    gen = torch.Generator().manual_seed(1)
    mats = [torch.randn(*shape, generator=gen) for shape in shapes]
    fns["Newton-Schulz alone"] = lambda: [newton_schulz(m) for m in mats]
    flops = sum(newton_schulz_flops(*shape) for shape in shapes)
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    for p in model.parameters():
        p.grad = torch.randn(p.shape) * 1e-3
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    torch_fused = torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["weight_decay"]},
                                     {"params": other, "weight_decay": 0.0}], lr=HYPER["lr"],
                                    betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], fused=True)
    fns["torch AdamW (fused)"] = torch_fused.step
    times = time_in_turns(fns, steps, repeats, warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"### LAMB and Muon, {name}: {n / 1e6:.1f}M fp32 parameters ({len(shapes)} Muon matrices, "
             f"{sum(a * b for a, b in shapes) / 1e6:.1f}M), {torch.get_num_threads()} threads, {steps} steps "
             f"x {repeats} repeats, load average {os.getloadavg()[0]:.1f}", "",
             "| contender | ms/step (median) | fastest |", "|---|---:|---:|"]
    lines += [f"| {k} | {med[k] * 1e3:.2f} | {min(v) * 1e3:.2f} |" for k, v in times.items()]
    adamw, muon = med["megazero AdamW (fused)"], med["megazero Muon"]
    ns = med["Newton-Schulz alone"]
    lines += ["", f"- ratio LAMB/AdamW at {name}: {med['megazero LAMB'] / adamw:.3f} "
              "(LAMB is torch elementwise ops, ~11 passes over the buffers, AdamW one fused pass)",
              f"- ratio LAMB/torch fused AdamW at {name}: {med['megazero LAMB'] / med['torch AdamW (fused)']:.3f}",
              f"- ratio Muon/AdamW at {name}: {muon / adamw:.3f}; Newton-Schulz is {ns / muon:.2f} of Muon's update "
              f"({flops / 1e9:.1f} GFLOP, {flops / ns / 1e9:.1f} GFLOP/s fp32 here)",
              f"- ratio Muon/torch fused AdamW at {name}: {muon / med['torch AdamW (fused)']:.3f}", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="30M,300M", help=f"comma-separated, of {', '.join(PRESETS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tables", default="adamw,updates",
                        help="adamw (the flat AdamW against torch's), updates (LAMB and Muon), or both")
    parser.add_argument("--smoke", action="store_true", help="toy size, 2 steps x 2 repeats: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.steps, args.repeats, args.warmup = "smoke", 2, 2, 1
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in PRESETS]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {', '.join(PRESETS)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{mem_available() / 2**30:.1f} GiB available", flush=True)
    tables = args.tables.split(",")
    for name in sizes:
        if "adamw" in tables:
            print("\n".join(bench_size(name, args.steps, args.repeats, args.warmup)), flush=True)
        if "updates" in tables:
            print("\n".join(bench_updates(name, args.steps, args.repeats, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
