"""The rank side of the compressed optimizers' reference tests (1-bit Adam, 0/1 Adam, 1-bit LAMB): a 2-layer GPT
at dp ``world`` and one ZeRO stage, each rank on its own two microbatches a step, every local gradient recorded
by hooks for the in-process reference, and per step the bytes the ranks sent, the norm and the optimizer's
metrics. ``keep(step, zero, grid)`` may record more after a step (the reduced gradient of a full-precision step).
The references' side of the compression is here too (``two_phase``), written from the paper, not from
parallel.onebit."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from tests.runs import ROOT

SIZES = ["parallel.tp=1", "parallel.pp=1", "model.layers=2", "model.hidden=48", "model.heads=4",
         "model.vocab_size=256", "model.seq_len=16"]


def microbatches(rank: int, step: int, vocab: int, seq_len: int) -> list[torch.Tensor]:
    """Two microbatches of 2 sequences; 64 of 256 token ids only, so most embedding rows get no gradient (their
    variance stays 0: the mask's case)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(0, 64, (2, seq_len + 1), generator=gen) for _ in range(2)]


def initial(cfg) -> dict:
    from megazero.models.build import build_gpt
    from megazero.parallel.topology import Grid

    return {n: p.detach().clone() for n, p in build_gpt(cfg, 0, tp=Grid.single().tp_comm).named_parameters()}


def train_stage(rank: int, world: int, stage: int, optim: Any, steps: int, lr: Union[float, list[float]], wd: float,
                clip: float,
                keep: Optional[Callable[[int, Any, Any], Optional[dict]]] = None,
                prepare: Optional[Callable[[Any], None]] = None) -> dict:
    """``steps`` steps at ZeRO ``stage`` with ``optim`` (an OptimConfig) at ``lr`` (or a rate per step, the
    largest train.lr's peak); ``prepare(zero)`` runs before the first.
    Returns numpy copies: the final weights, the initial ones, every step's local gradients, norms, bytes sent,
    optimizer records, the buckets' layout and what ``keep`` returned by step."""
    from megazero.config.load import load_config
    from megazero.config.schema import ZeroConfig
    from megazero.engine.build import make_executor, make_schedules, make_zero
    from megazero.engine.step import train_step
    from megazero.models.build import build_gpt
    from megazero.parallel.dims import ParallelDims
    from megazero.parallel.topology import Grid

    rates = lr if isinstance(lr, list) else [lr] * steps
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), SIZES).model
    grid = Grid.build(ParallelDims(tp=1, pp=1, dp=world), "cpu")
    model = build_gpt(cfg, 0, tp=grid.tp_comm)
    grads: list[dict] = []

    def record(p, name):
        grads[-1][name] = grads[-1].get(name, 0) + p.grad.detach().clone()

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: record(p, name))
    zero = make_zero([model], grid, ZeroConfig(stage=stage, bucket_mb=0.02, reshard_after_forward=True),
                     "fp32", wd, torch.device("cpu"), optim=optim, lr=max(rates))
    executor = make_executor([model], grid, torch.device("cpu"), 2, cfg.seq_len, cfg.hidden, "fp32",
                             world * 2 * 2 * cfg.seq_len)  # the loss is the mean over the global batch
    schedule = make_schedules("1f1b", grid, 2)[0]
    if prepare is not None:
        prepare(zero)
    norms, sent, records, kept = [], [], [], {}
    for step in range(steps):
        grads.append({})
        before = sum(grid.counter.sent_bytes().values())
        batch = microbatches(rank, step, cfg.vocab_size, cfg.seq_len)
        result = train_step(zero, executor, schedule, batch, rates[step], clip)
        assert not result.skipped
        sent.append(sum(grid.counter.sent_bytes().values()) - before)
        norms.append(result.grad_norm)
        records.append(zero.optimizer_record())
        extra = keep(step, zero, grid) if keep is not None else None
        if extra is not None:
            kept[step] = {n: g.numpy() for n, g in extra.items()}
    layout = [(b.numel, [(n, off) for (n, _), off in zip(b.params, b.offsets)]) for b in zero.buckets]
    return {"params": {n: t.detach().numpy().copy() for n, t in zero.full_parameters().items()},
            "start": {n: t.numpy() for n, t in initial(cfg).items()},
            "grads": [{n: g.numpy() for n, g in step.items()} for step in grads],
            "norms": norms, "sent": sent, "records": records, "layout": layout, "kept": kept}


def flat_bucket(tensors: dict, numel: int, names: list, world: int) -> torch.Tensor:
    """The references' flat bucket: the named tensors at their offsets, padded to a multiple of 8 * world."""
    out = torch.zeros(-(-numel // (8 * world)) * 8 * world)
    for n, off in names:
        t = torch.as_tensor(tensors[n]).reshape(-1)
        out[off:off + t.numel()] = t
    return out


def signs_and_scales(parts: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The paper's compression of each row of ``parts``, a scale per group: ||group's elements||/sqrt(their count)
    * sign(element), 0 where the group is 0 (left out); each norm's fp32 squares summed in float64 and the
    scale rounded once to fp32, as the ranks do (then only the float64 sum's order differs, far below an fp32
    ulp: an ulp off in a scale could flip a sign near 0 later, which would move an element by two scales)."""
    out = torch.zeros_like(parts)
    for k in range(1, int(groups.max()) + 1):
        mine = groups == k
        count = mine.sum(1, keepdim=True).double().clamp(min=1.0)
        squares = torch.where(mine, parts, 0.0).square().sum(1, keepdim=True, dtype=torch.float64)
        scale = (squares.sqrt() / count.sqrt()).float()
        out = torch.where(mine, torch.where(parts >= 0, 1.0, -1.0) * scale, out)
    return out


def two_phase(values: list[torch.Tensor], workers: list, servers: list, groups: torch.Tensor) -> torch.Tensor:
    """The compressed average of the workers' ``values`` (one flat bucket; ``groups``: each element's scale
    group, 0 left out), 1-bit Adam's two phases, errors updated in place."""
    world = len(values)
    chunk = values[0].numel() // world
    by_chunk = groups.view(world, chunk)
    keep = groups > 0
    sent = []
    for r in range(world):
        c = torch.where(keep, values[r] + workers[r], 0.0)
        q = signs_and_scales(c.view(world, chunk), by_chunk).view(-1)
        workers[r].copy_(c - q)
        sent.append(q)
    parts = []
    for r in range(world):
        s = torch.stack([x[r * chunk:(r + 1) * chunk] for x in sent]).mean(0) + servers[r]
        s = torch.where(by_chunk[r] > 0, s, 0.0)
        q = signs_and_scales(s.view(1, chunk), by_chunk[r:r + 1]).view(-1)
        servers[r].copy_(s - q)
        parts.append(q)
    return torch.cat(parts)
