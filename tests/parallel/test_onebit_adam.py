"""1-bit Adam (parallel.zero.onebit_adam) at 4 gloo ranks, ZeRO 0 and 1: 20 steps (a warm-up of 6), each rank on
its own two microbatches, equal Tang et al. 2021's Algorithm 1 simulated for 4 workers in this process from the
local gradients each rank recorded: AdamW over the summed gradient for the warm-up; then the variance frozen,
each worker's momentum fed its own gradient, and the momenta averaged by the two-phase compression with worker
and server error feedback, per flat bucket cut into 4 chunks with one scale per parameter in each, leaving out
the elements whose frozen sqrt(v_hat) is at most eps. Clipped at 1.0 by the norm the step reports: the summed gradient's in the
warm-up, then the RMS over workers of n * g_rank's (each worker's contribution at the reduced gradient's scale).

After the warm-up the comm counter shows a step's bytes at stage 0 at most 1/16 of a warm-up (AdamW) step's (1/31
here); stage 1 adds the all-gather of the updated weight slices, half of an AdamW step's bytes.

Tolerance, per element, 1e-6 of the largest weight plus 4e-6 of the element's travel (the sum of its steps'
sizes). The reference takes the warm-up's summed gradient as the ranks summed it (gloo's order) and clips by the
ranks' norms (checked against its own to 1e-5), so it repeats the ranks' fp32 operations except AdamW's warm-up
(the fused update against torch ops) and the chunk norms' order: ulps of m and v. An update divides m by
sqrt(v_hat), so those ulps reach a weight as ulps of its travel: the largest difference, 3.3e-6, is in layer 1's
qkv weight, whose elements with a variance just above eps (the weak point of 1-bit Adam's frozen denominator)
travel up to 111; every other weight differs by at most 2e-7. A sign flipped by an ulp would
move an element by two scales, ~lr = 1e-2: outside the bound, and it does not happen once the sums are the
ranks'. Each mutation checked (no worker error: 327 off; no n scale: 103 off) misses by far more."""
from __future__ import annotations

import math

import torch

from tests.parallel.compressed_ranks import flat_bucket, train_stage, two_phase

WORLD, STEPS, FREEZE, LR, WD, CLIP = 4, 20, 6, 1e-2, 0.1, 1.0
BETAS, EPS = (0.9, 0.95), 1e-8
def rank_side(rank: int, world: int) -> list:
    from megazero.config.schema import OptimConfig
    from megazero.parallel.zero.registry import OnebitAdamSection

    optim = OptimConfig(name="onebit_adam", onebit_adam=OnebitAdamSection(beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                                                          freeze_step=FREEZE))
    out = []
    for stage in (0, 1):
        r = train_stage(rank, world, stage, optim, STEPS, LR, WD, CLIP,
                        keep=lambda step, zero, grid: _reduced_gradients(zero, grid, stage) if step < FREEZE else None)
        r["records"] = [x["optim/compressed_bytes"] for x in r["records"]]
        r["reduced"] = [r["kept"][t] for t in range(FREEZE)]
        out.append(r)
    return out


def _reduced_gradients(zero, grid, stage: int) -> dict:
    """The warm-up step's gradient as the reducer summed it over the ranks (gloo's order of the sum), by name:
    stage 1's slices gathered here, after the step's bytes were counted."""
    if stage == 0:
        return {n: g.detach().clone() for n, g in zero.full_gradients().items()}
    import torch.distributed as dist

    out = {}
    for part in zero.parts:
        for b in part.buckets:
            mine = part.reducer.grad(b).detach().clone()
            whole = torch.empty(mine.numel() * grid.dp, dtype=mine.dtype)
            dist.all_gather_into_tensor(whole, mine)
            for (n, p), off in zip(b.params, b.offsets):
                out[n] = whole[off:off + p.numel()].view(p.shape).clone()
    return out


def _reference(start: dict, grads: list[list[dict]], layout: list, reduced: list[dict],
               norms_seen: list[float]) -> tuple[dict, list[float], dict]:
    """Algorithm 1 of Tang et al. 2021 for WORLD workers, over flat fp32 buckets as ``layout`` lays them out
    ((numel, [(name, offset)]) each); ``grads[w][t]``: worker w's local gradient at step t (its share of the
    global mean); ``reduced[t]``: the warm-up's summed gradient as the ranks summed it. Clips by
    ``norms_seen``, the ranks' norms (whose own value this returns, to be compared with them). Returns the
    weights, the norms, and each weight's travel (the sum of its steps' sizes)."""
    b1, b2 = BETAS
    shapes = {n: t.shape for n, t in start.items()}

    def flat(tensors: dict, numel: int, names: list) -> torch.Tensor:
        return flat_bucket(tensors, numel, names, WORLD)

    w = [flat(start, numel, names) for numel, names in layout]
    params = [flat({n: torch.full(shapes[n], float(1 + j % 255)) for j, (n, _) in enumerate(names)}, numel,
                   names).long() for numel, names in layout]
    decay = [flat({n: torch.full(shapes[n], float(len(shapes[n]) >= 2)) for n in shapes}, numel, names).bool()
             for numel, names in layout]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    workers = [[torch.zeros_like(x) for x in w] for _ in range(WORLD)]
    servers = [[torch.zeros(x.numel() // WORLD) for x in w] for _ in range(WORLD)]
    live = None
    norms = []
    travel = [torch.zeros_like(x) for x in w]
    for t in range(1, STEPS + 1):
        g = [[flat(grads[r][t - 1], numel, names) for numel, names in layout] for r in range(WORLD)]
        frozen = t > FREEZE
        if not frozen:
            summed = [sum(g[r][i] for r in range(WORLD)) for i in range(len(w))]
            norm = math.sqrt(sum(x.double().square().sum().item() for x in summed))
            total = [flat(reduced[t - 1], numel, names) for numel, names in layout]
            assert max((a - b).abs().max().item() for a, b in zip(summed, total)) <= 1e-6  # the same sum
        else:
            norm = math.sqrt(WORLD * sum(x.double().square().sum().item() for gr in g for x in gr))
        norms.append(norm)
        coef = min(1.0, CLIP / (norms_seen[t - 1] + 1e-6))
        bc1 = 1.0 - b1 ** t
        bc2 = math.sqrt(1.0 - b2 ** min(t, FREEZE))
        if frozen and live is None:
            live = [(x.sqrt() / bc2 > EPS) for x in v]  # the padding's v is 0: never live
            m = [x * k for x, k in zip(m, live)]
        for i in range(len(w)):
            w[i] = torch.where(decay[i], w[i] * (1.0 - LR * WD), w[i])
            if not frozen:
                gi = total[i] * coef
                m[i] = torch.lerp(m[i], gi, 1.0 - b1)
                v[i] = v[i] * b2 + gi * gi * (1.0 - b2)
            else:
                mine = [(m[i] * b1).add_(g[r][i], alpha=(1.0 - b1) * WORLD * coef) for r in range(WORLD)]
                groups = torch.where(live[i], params[i], 0)  # each parameter its own scale group
                m[i] = two_phase(mine, [x[i] for x in workers], [x[i] for x in servers], groups)
            before = w[i]
            w[i] = w[i] - LR / bc1 * m[i] / (v[i].sqrt() / bc2 + EPS)
            travel[i] = travel[i] + (w[i] - before).abs()
    out, moved = {}, {}
    for x, t, (numel, names) in zip(w, travel, layout):
        for n, off in names:
            out[n] = x[off:off + math.prod(shapes[n])].view(shapes[n])
            moved[n] = t[off:off + math.prod(shapes[n])].view(shapes[n])
    return out, norms, moved


def check_four_ranks(results: list) -> None:
    """Each rank's weights, norms and bytes against the reference (``results``: ``rank_side``'s, per rank,
    spawned by tests/parallel/test_compressed_references.py)."""
    for stage in (0, 1):
        per_rank = [r[stage] for r in results]
        first = per_rank[0]
        for r in per_rank[1:]:  # the compressed average leaves the same momentum, so the same weights, everywhere
            for n, t in r["params"].items():
                assert (t == first["params"][n]).all(), (stage, n)
        start = {n: torch.from_numpy(t) for n, t in first["start"].items()}
        want, norms, travel = _reference(start, [r["grads"] for r in per_rank], first["layout"], first["reduced"],
                                 first["norms"])
        scale = max(t.abs().max().item() for t in want.values())
        worst = max((torch.from_numpy(first["params"][n]) - want[n]).abs().max().item() for n in want)
        over = {n: ((torch.from_numpy(first["params"][n]) - want[n]).abs() - 1e-6 * scale - 4e-6 * travel[n]).max()
                for n in want}
        assert max(over.values()).item() <= 0, (stage, worst, scale, max(over.items(), key=lambda kv: kv[1]))
        moved = max((want[n] - start[n]).abs().max().item() for n in want)
        assert moved > 1e3 * worst, (moved, worst)  # the comparison is of weights that moved
        for got, ref in zip(first["norms"], norms):
            assert abs(got - ref) <= 1e-5 * ref, (stage, got, ref)
        assert min(norms) < CLIP < max(norms), norms  # both sides of the clip
        warm = sorted(first["sent"][1:FREEZE])[FREEZE // 2 - 1]  # AdamW's steps through the same reducer
        compressed = max(first["sent"][FREEZE + 1:])  # the first also gathers the momentum (stage 1)
        assert all(x == 0 for x in first["records"][:FREEZE]) and min(first["records"][FREEZE:]) > 0
        if stage == 0:
            assert compressed <= warm / 16, (compressed, warm)
        else:  # stage 1 keeps the all-gather of each rank's updated slice of the weights (half of AdamW's bytes:
            assert compressed <= warm / 2 + warm / 16, (compressed, warm)  # it keeps the masters sharded)
