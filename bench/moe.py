"""Mixture-of-experts benchmark (CPU): megazero's MoE layer against its peers, measured in the same run.

One MoE layer (``models.moe.MoE``: route, sort the token copies by expert, each expert's SwiGLU as grouped
matmuls, un-permute and weight by gate; softmax router, dropless), forward + backward of one microbatch with
a fixed output gradient, fp32, against:

  per-expert loop   the same routing and the same parameters, then a Python loop over the experts that were hit,
                    each F.linear over its index-selected rows and index_add_ back: transformers' eager
                    ``MixtralExperts.forward`` (gate and up as two linears over the layer's own weights, each
                    expert's a view from one ``unbind``: its peer at its best, see ``loop_moe``)
  dense SwiGLU      ``models.llama.SwiGLU`` of width top_k·expert_hidden (+ the shared experts' width): the
                    same active matmul FLOPs, no routing
  ep 2 vs ep 1      2 gloo ranks of one thread, the same global tokens split over them: ep 1 is dp 2 (every
                    rank holds all experts), ep 2 splits them (all-to-all dispatch and combine); a step is
                    forward + backward + the gradients' all-reduce over each parameter's group (router over
                    dp; experts over dp at ep 1, over their edp group, of one rank, at ep 2), its time the
                    slower rank's between barriers; the forward + backward part is shown too

and the grouped-matmul implementations of ``kernels.grouped`` on this CPU (``bench/grouped_mm.py``'s table).
``--steps`` timed steps after warm-up, ``--repeats`` rounds, the contenders alternating step by step (the order
rotating); each round's median, and the median of the rounds' medians; ratios per round and of the medians.

    python bench/moe.py [--hidden 512] [--experts 8] [--top-k 2] [--expert-hidden 1024] [--shared 0]
                        [--tokens 1024] [--seq 512] [--steps 20] [--repeats 3] [--threads N]
                        [--only layer,ep,grouped] [--smoke]

Prints markdown for docs/benchmarks.md. ``--smoke``: toy sizes and one step (tests/bench/test_bench_moe.py).
Not a test: nothing here asserts but that the contenders compute the same thing.
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
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from megazero.config.schema import ModelConfig, MoeConfig  # noqa: E402
from megazero.models.llama import SwiGLU  # noqa: E402
from megazero.models.moe import MoE, route  # noqa: E402
from megazero.models.split import Split  # noqa: E402
from megazero.parallel.comm import Comm  # noqa: E402
from megazero.parallel.tp_random import TPRandom  # noqa: E402

WARMUP, SEED, STD = 3, 0, 0.02
SECTIONS = ("layer", "ep", "grouped")
LAYER = ("MoE layer", "per-expert loop", "dense SwiGLU")
EP = ("ep 1", "ep 2")


def model_cfg(args: argparse.Namespace) -> ModelConfig:
    moe = MoeConfig(experts=args.experts, top_k=args.top_k, expert_hidden=args.expert_hidden,
                    shared_experts=args.shared)
    return ModelConfig(arch="llama", hidden=args.hidden, heads=max(1, args.hidden // 64), seq_len=args.seq,
                       moe=moe)


def build_moe(cfg: ModelConfig, ep: Comm) -> MoE:
    """The layer with this ep rank's slice of the same logical weights at every ep (one seed, N(0, 0.02))."""
    layer = MoE(cfg, Split(None, False, TPRandom(), ep=ep))
    gen = torch.Generator().manual_seed(SEED)
    local, first = layer.experts.local, layer.experts.first
    with torch.no_grad():
        for name, p in layer.named_parameters():
            full = (torch.randn(cfg.moe.experts, *p.shape[1:], generator=gen) if name.startswith("experts.")
                    else torch.randn(p.shape, generator=gen))
            p.copy_(STD * (full[first:first + local] if name.startswith("experts.") else full))
    return layer


def build_dense(cfg: ModelConfig, width: int) -> SwiGLU:
    dense = SwiGLU(cfg, Split(None, False, TPRandom()), width=width)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(STD * torch.randn(p.shape, generator=gen))
    return dense


def loop_moe(layer: MoE, x: Tensor) -> Tensor:
    """The layer's routed output computed the way transformers' eager Mixtral does: one pass per expert hit."""
    moe, experts = layer.moe, layer.experts
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    logits = F.linear(flat, layer.router.weight).float()
    idx, gates, _ = route(logits, moe, layer.router.expert_bias)
    y = torch.zeros_like(flat)
    with torch.no_grad():
        mask = F.one_hot(idx, num_classes=moe.experts).permute(2, 1, 0)  # (E, k, tokens)
        hit = mask.sum(dim=(-1, -2)).nonzero().flatten().tolist()
    # one view per expert, whose backward is one stack per parameter: indexing ``experts.gate[e]`` instead (as
    # transformers' 3-D parameters are) zero-fills a full-size gradient per expert in backward
    gate, up, down = experts.gate.unbind(0), experts.up.unbind(0), experts.down.unbind(0)
    for e in hit:
        slot, token = torch.where(mask[e])
        rows = flat[token]
        out = F.linear(F.silu(F.linear(rows, gate[e])) * F.linear(rows, up[e]), down[e])
        y.index_add_(0, token, out * gates[token, slot, None].to(out.dtype))
    y = y.view(b, s, h)
    return y + layer.shared(x) if layer.shared is not None else y


def _inputs(cfg: ModelConfig, tokens: int, rank: int = 0) -> tuple[Tensor, Tensor]:
    """This rank's (batch, seq, hidden) input and output gradient, from its own seed (the same at every ep)."""
    gen = torch.Generator().manual_seed(SEED + 7 + rank)
    b = tokens // cfg.seq_len
    return (torch.randn(b, cfg.seq_len, cfg.hidden, generator=gen),
            torch.randn(b, cfg.seq_len, cfg.hidden, generator=gen))


def fwd_bwd(fn: Callable[[Tensor], Tensor], module: nn.Module, x: Tensor, dy: Tensor) -> Tensor:
    """One forward + backward from a fresh leaf input (the input's gradient too, as inside a model)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach()


def alternate(steps: int, repeats: int, contenders: dict[str, Callable[[], object]]) -> dict[str, list[list]]:
    """What each contender's timed steps returned, per round; the contenders alternate, their order rotating."""
    names = list(contenders)
    times: dict[str, list[list]] = {n: [[] for _ in range(repeats)] for n in names}
    for r in range(repeats):
        for k in range(WARMUP + steps):
            for name in names[k % len(names):] + names[:k % len(names)]:
                t = contenders[name]()
                if k >= WARMUP:
                    times[name][r].append(t)
    return times


def medians(rounds: list[list[float]]) -> list[float]:
    return [statistics.median(ts) for ts in rounds]


def _wall(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rel(a: Tensor, b: Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def bench_layer(args: argparse.Namespace) -> list[str]:
    cfg = model_cfg(args)
    moe = cfg.moe
    f = moe.expert_hidden
    layer = build_moe(cfg, Comm(None, "ep"))
    dense = build_dense(cfg, moe.top_k * f + moe.shared_experts * f)
    x, dy = _inputs(cfg, args.tokens)
    # the same thing computed two ways: output and every gradient
    got = {}
    for name, fn in (("moe", layer), ("loop", lambda t: loop_moe(layer, t))):
        y = fwd_bwd(fn, layer, x, dy)
        got[name] = [y] + [p.grad.clone() for p in layer.parameters()]
    diff = max(_rel(a, b) for a, b in zip(got["moe"], got["loop"]))
    sizes = torch.bincount(route(F.linear(x.reshape(-1, cfg.hidden), layer.router.weight).float(), moe,
                                 None)[0].flatten(), minlength=moe.experts)
    timed = alternate(args.steps, args.repeats, {
        LAYER[0]: lambda: _wall(lambda: fwd_bwd(layer, layer, x, dy)),
        LAYER[1]: lambda: _wall(lambda: fwd_bwd(lambda t: loop_moe(layer, t), layer, x, dy)),
        LAYER[2]: lambda: _wall(lambda: fwd_bwd(dense, dense, x, dy))})
    rounds = {n: medians(v) for n, v in timed.items()}
    tokens = x.shape[0] * x.shape[1]
    active = 2 * 3 * tokens * cfg.hidden * (moe.top_k * f + moe.shared_experts * f)  # the SwiGLUs' forward
    lines = [f"### MoE layer, one process, {torch.get_num_threads()} threads, fp32: hidden {cfg.hidden}, "
             f"{moe.experts} experts, top-{moe.top_k}, expert_hidden {f}, shared {moe.shared_experts}, "
             f"{tokens} tokens ({x.shape[0]}x{cfg.seq_len}); tokens per expert {sizes.min().item()}-"
             f"{sizes.max().item()}", "",
             "| contender | ms/step (fwd+bwd) | rounds | GFLOP/s (active SwiGLU, fwd+bwd) | vs MoE layer |",
             "|---|---:|---|---:|---:|"]
    med = {n: statistics.median(v) for n, v in rounds.items()}
    for n in LAYER:
        each = " ".join(f"{1e3 * v:.1f}" for v in rounds[n])
        lines.append(f"| {n} | {1e3 * med[n]:.1f} | {each} | {3 * active / med[n] / 1e9:.1f} | "
                     f"{med[n] / med[LAYER[0]]:.3f} |")
    lines.append("")
    for peer in LAYER[1:]:
        each = " ".join(f"{a / b:.3f}" for a, b in zip(rounds[LAYER[0]], rounds[peer]))
        lines.append(f"- ratio MoE layer / {peer}: {med[LAYER[0]] / med[peer]:.3f} (rounds: {each})")
    lines.append(f"- MoE layer vs per-expert loop: max relative difference of the output and every gradient "
                 f"{diff:.1e} (fp32)")
    return lines


def _ep_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    from megazero.parallel.topology import Grid

    cfg = model_cfg(args)
    grids = {name: Grid.build(tp=1, pp=1, dp=world, ep=ep) for name, ep in zip(EP, (1, world))}
    layers = {name: build_moe(cfg, g.ep_comm) for name, g in grids.items()}
    x, dy = _inputs(cfg, args.tokens // world, rank)

    def step(name: str) -> tuple[float, float, Tensor]:
        grid, layer = grids[name], layers[name]
        dist.barrier()
        t0 = time.perf_counter()
        y = fwd_bwd(layer, layer, x, dy)
        t1 = time.perf_counter()
        for pname, p in layer.named_parameters():  # as ZeRO reduces them: experts over edp, the rest over dp
            (grid.edp_comm if pname.startswith("experts.") else grid.dp_comm).all_reduce(p.grad, tag="grads")
        dist.barrier()
        return time.perf_counter() - t0, t1 - t0, y

    outs = {name: step(name)[2] for name in EP}
    diff = _rel(outs[EP[1]], outs[EP[0]])
    timed = alternate(args.steps, args.repeats, {name: (lambda n=name: step(n)[:2]) for name in EP})
    return {"timed": timed, "diff": diff}


def bench_ep(args: argparse.Namespace, world: int = 2) -> list[str]:
    from tests.dist import run_ranks

    results = run_ranks(world, _ep_rank, args, timeout=3600)

    def slower(n: str, part: int) -> list[float]:  # each round's median over steps of the slower rank's time
        return medians([[max(t[part] for t in ranks) for ranks in zip(*(res["timed"][n][k] for res in results))]
                        for k in range(args.repeats)])

    rounds = {n: slower(n, 0) for n in EP}  # forward + backward + gradient all-reduce
    compute = {n: statistics.median(slower(n, 1)) for n in EP}
    med = {n: statistics.median(v) for n, v in rounds.items()}
    cores = os.cpu_count() or 1
    lines = [f"### Expert parallelism: {world} gloo ranks of 1 thread on {cores} cores, {args.tokens} global "
             f"tokens ({args.tokens // world} per rank), the layer above", "",
             "| contender | ms/step (fwd+bwd+grad all-reduce) | rounds | of which fwd+bwd ms | vs ep 1 |",
             "|---|---:|---|---:|---:|"]
    for n in EP:
        each = " ".join(f"{1e3 * v:.1f}" for v in rounds[n])
        lines.append(f"| {n} | {1e3 * med[n]:.1f} | {each} | {1e3 * compute[n]:.1f} | {med[n] / med[EP[0]]:.3f} |")
    each = " ".join(f"{a / b:.3f}" for a, b in zip(rounds[EP[1]], rounds[EP[0]]))
    lines += ["", f"- ratio ep 2 / ep 1: {med[EP[1]] / med[EP[0]]:.3f} (rounds: {each}); fwd+bwd only "
              f"{compute[EP[1]] / compute[EP[0]]:.3f}",
              f"- ep 2 vs ep 1: max relative difference of the output {max(r['diff'] for r in results):.1e} (fp32)"]
    return lines


def bench_grouped(args: argparse.Namespace) -> list[str]:
    from bench.grouped_mm import CPU_SHAPES, SMOKE_SHAPES, report

    return report(SMOKE_SHAPES if args.smoke else CPU_SHAPES, torch.device("cpu"), torch.float32, args.steps,
                  args.repeats)


def run(args: argparse.Namespace, only: list[str]) -> None:
    wall = time.perf_counter()
    print(f"## Mixture of experts (CPU): torch {torch.__version__}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {args.repeats} rounds of {args.steps} timed steps after {WARMUP} warm-up, "
          f"medians\n", flush=True)
    sections = {"layer": bench_layer, "ep": bench_ep, "grouped": bench_grouped}
    for name in SECTIONS:
        if name in only:
            print("\n".join(sections[name](args)) + "\n", flush=True)
    print(f"wall time {time.perf_counter() - wall:.1f} s, load average at the end {os.getloadavg()[0]:.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-hidden", type=int, default=1024)
    ap.add_argument("--shared", type=int, default=0, help="shared experts (one SwiGLU of shared·expert_hidden)")
    ap.add_argument("--tokens", type=int, default=1024, help="the microbatch's tokens (global, for ep)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round, after warm-up")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--threads", type=int, default=None, help="threads of the one-process parts (default torch's)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, one step: checks the script")
    args = ap.parse_args(argv)
    only = args.only.split(",")
    if not set(only) <= set(SECTIONS):
        ap.error(f"--only {args.only!r}: valid sections are {','.join(SECTIONS)}")
    if args.smoke:
        args.hidden, args.experts, args.expert_hidden, args.tokens, args.seq = 32, 4, 64, 128, 32
        args.steps, args.repeats = 1, 1
    if args.tokens % (2 * args.seq) or args.experts % 2 or not 1 <= args.top_k <= args.experts:
        ap.error(f"--tokens {args.tokens} must be a multiple of 2·--seq ({2 * args.seq}), --experts "
                 f"{args.experts} even (ep 2), --top-k {args.top_k} in 1..experts")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or (1 if args.smoke else threads))  # toy sizes: no waking of idle threads
    try:
        run(args, only)
    finally:
        torch.set_num_threads(threads)  # a caller in this process (the test) keeps its own


if __name__ == "__main__":
    main()
