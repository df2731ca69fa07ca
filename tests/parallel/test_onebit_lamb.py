"""1-bit LAMB (parallel.zero.onebit_lamb) at 4 gloo ranks, ZeRO 0 and 1: 30 steps, a warm-up of 10, each rank on
its own two microbatches, equal Li et al. 2021's Algorithm 1 simulated for 4 workers in this process from the
local gradients each rank recorded.

The reference, per flat bucket padded to 8 x 4 elements, a layer being a parameter: the warm-up is LAMB (Adam's
bias-corrected direction plus decoupled decay on the matrices, times ||w|| / ||u|| per layer) over the summed
gradient as the ranks summed it, each layer's ratio averaged with coeff_beta (a ratio of exactly 1 left out), the
variance copied at step 10 as the fresh one. Then each worker folds n * g_rank into the momentum, scales each
layer by 1 / its momentum RMS at the end of the warm-up, and the momenta are averaged by 1-bit Adam's two-phase
compression (elements with sqrt(v_hat) <= eps left out) and scaled back; the gradient rebuilt as (m_t - beta1
m_{t-1}) / (1 - beta1) goes into the fresh variance; each layer's factor is its largest (sqrt(v_hat) + eps) /
(sqrt(v_fresh_hat) + eps), blended towards 1 by min(1, ||m_hat/d|| / ||m_hat/d + wd w||), clipped to [0.5, 2] and
to within 5% of the last (tighter than the defaults, 4 and 10%, so that both bounds act in 20 steps); the step is lr * frozen ratio * factor times LAMB's direction with the frozen
variance. Clipped at 1.0 by the norms the ranks report (checked against the reference's own to 1e-5).

Tolerance, per element, 1e-6 of the largest weight plus 4e-6 of its travel, as the 1-bit Adam test (same
argument). The factors move (the fresh variance falls below the frozen one, so the largest ratio exceeds 1) and
the threshold and the upper bound clip them: the reference checks that all three happen. Without the momentum's per-layer scaling, without the
fresh variance's update or with the factor left at 1 the weights miss by far more (checked by mutation when the
test was written).

Communication, same spawn: past the warm-up a step at stage 0 sends at most 1/16 of a warm-up (LAMB) step's
bytes."""
from __future__ import annotations

import math

import torch

from tests.parallel.compressed_ranks import flat_bucket, train_stage, two_phase

WORLD, STEPS, FREEZE, LR, WD, CLIP = 4, 30, 10, 1e-2, 0.1, 1.0
BETAS, EPS, COEFF_BETA, FMIN, FMAX, THRESHOLD = (0.9, 0.95), 1e-8, 0.9, 0.5, 2.0, 0.05


def rank_side(rank: int, world: int) -> list:
    from megazero.config.schema import OptimConfig
    from megazero.parallel.zero.registry import OnebitLambSection

    section = OnebitLambSection(beta1=BETAS[0], beta2=BETAS[1], eps=EPS, freeze_step=FREEZE, coeff_beta=COEFF_BETA,
                                factor_min=FMIN, factor_max=FMAX, factor_threshold=THRESHOLD)
    optim = OptimConfig(name="onebit_lamb", onebit_lamb=section)
    out = []
    for stage in (0, 1):
        seen: list = []

        def keep_reduced(zero):  # LAMB writes its direction over the reduced gradient: keep it first
            part = zero.parts[0].optim
            update = part.update

            def update_keeping(grads, *args):
                seen[:] = [g.detach().clone() for g in grads]
                update(grads, *args)

            part.update = update_keeping

        r = train_stage(rank, world, stage, optim, STEPS, LR, WD, CLIP, prepare=keep_reduced,
                        keep=lambda step, zero, grid: _summed(zero, seen, grid.dp) if step < FREEZE else None)
        r["reduced"] = [r["kept"][t] for t in range(FREEZE)]
        out.append(r)
    return out


def _summed(zero, grads: list, world: int) -> dict:
    """The warm-up step's gradient as the reducer summed it (gloo's order), by name: stage 1's slices gathered."""
    import torch.distributed as dist

    out = {}
    for b, mine in zip(zero.parts[0].buckets, grads):
        whole = mine
        if mine.numel() != b.numel:
            whole = torch.empty(mine.numel() * world, dtype=mine.dtype)
            dist.all_gather_into_tensor(whole, mine)
        for (n, p), off in zip(b.params, b.offsets):
            out[n] = whole[off:off + p.numel()].view(p.shape).clone()
    return out


def _reference(start: dict, grads: list[list[dict]], layout: list, reduced: list, norms_seen: list[float]):
    """Algorithm 1 of Li et al. 2021 for WORLD workers (see the module's docstring): the weights, the norms,
    each weight's travel, and every step's factors past the warm-up."""
    b1, b2 = BETAS
    shapes = {n: t.shape for n, t in start.items()}
    names = [n for _, ns in layout for n, _ in ns]

    def flat(tensors: dict, numel: int, names: list) -> torch.Tensor:
        return flat_bucket(tensors, numel, names, WORLD)

    def spans(i: int):  # (name, start, end) of each layer in bucket i
        return [(n, off, off + math.prod(shapes[n])) for n, off in layout[i][1]]

    nb = len(layout)
    w = [flat(start, numel, ns) for numel, ns in layout]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    fresh = None
    workers = [[torch.zeros_like(x) for x in w] for _ in range(WORLD)]
    servers = [[torch.zeros(x.numel() // WORLD) for x in w] for _ in range(WORLD)]
    travel = [torch.zeros_like(x) for x in w]
    frozen = dict.fromkeys(names, 0.0)
    last = dict.fromkeys(names, 1.0)
    scale, live, factors, norms = {}, None, [], []
    bc2_f = math.sqrt(1.0 - b2 ** FREEZE)
    for t in range(1, STEPS + 1):
        g = [[flat(grads[r][t - 1], numel, ns) for numel, ns in layout] for r in range(WORLD)]
        if t <= FREEZE:
            total = [flat(reduced[t - 1], numel, ns) for numel, ns in layout]
            norm = math.sqrt(sum(x.double().square().sum().item() for x in total))
        else:
            norm = math.sqrt(WORLD * sum(x.double().square().sum().item() for gr in g for x in gr))
        norms.append(norm)
        coef = min(1.0, CLIP / (norms_seen[t - 1] + 1e-6))
        bc1, bc2 = 1.0 - b1 ** t, math.sqrt(1.0 - b2 ** t)
        if t > FREEZE and live is None:
            live = [x.sqrt() / bc2_f > EPS for x in v]
            m = [x * k for x, k in zip(m, live)]
            for i in range(nb):
                for n, a, z in spans(i):
                    rms = m[i][a:z].double().square().mean().sqrt().item()
                    scale[n] = 1.0 / rms if rms > 0 else 1.0
        step_factors = {}
        for i in range(nb):
            before = w[i].clone()
            if t <= FREEZE:
                gi = total[i] * coef
                m[i] = torch.lerp(m[i], gi, 1.0 - b1)
                v[i] = (v[i] * b2).addcmul_(gi, gi, value=1.0 - b2)  # the ranks' ops, to the ulp
                u = m[i] / bc1 / (v[i].sqrt() / bc2 + EPS)
                for n, a, z in spans(i):
                    if len(shapes[n]) >= 2:
                        u[a:z] += WD * w[i][a:z]
                    wn, un = w[i][a:z].double().norm().item(), u[a:z].double().norm().item()
                    trust = wn / un if wn > 0 and un > 0 else 1.0
                    if trust != 1.0:
                        frozen[n] = COEFF_BETA * frozen[n] + (1.0 - COEFF_BETA) * trust
                    w[i][a:z] -= LR * trust * u[a:z]
                if t == FREEZE:
                    fresh = fresh or [None] * nb
                    fresh[i] = v[i].clone()
            else:
                mine = []
                for r in range(WORLD):
                    mr = (m[i] * b1).add_(g[r][i], alpha=(1.0 - b1) * WORLD * coef)
                    for n, a, z in spans(i):
                        mr[a:z] *= scale[n]
                    mine.append(mr)
                avg = two_phase(mine, [x[i] for x in workers], [x[i] for x in servers], live[i])
                for n, a, z in spans(i):
                    avg[a:z] *= 1.0 / scale[n]
                rebuilt = (avg - m[i] * b1) / (1.0 - b1)
                m[i] = avg
                fresh[i] = (fresh[i] * b2).addcmul_(rebuilt, rebuilt, value=1.0 - b2)
                denom = v[i].sqrt() / bc2_f + EPS
                ratio = denom / (fresh[i].sqrt() / bc2 + EPS)
                plain = m[i] / denom / bc1
                u = plain.clone()
                for n, a, z in spans(i):
                    if len(shapes[n]) >= 2:
                        u[a:z] += WD * w[i][a:z]
                    f = ratio[a:z].max().item()
                    pn, un = plain[a:z].double().norm().item(), u[a:z].double().norm().item()
                    share = min(1.0, pn / un) if un > 0 else 1.0
                    f = min(max(f * share + (1.0 - share), FMIN), FMAX)
                    held = min(max(f, last[n] * (1.0 - THRESHOLD)), last[n] * (1.0 + THRESHOLD))
                    step_factors[n] = (held, held != f)  # the factor, and whether the threshold held it
                    last[n] = f = held
                    w[i][a:z] -= LR * frozen[n] * f * u[a:z]
            travel[i] = travel[i] + (w[i] - before).abs()
        if step_factors:
            factors.append(step_factors)
    weights, moved = {}, {}
    for x, tr, (_, ns) in zip(w, travel, layout):
        for n, off in ns:
            weights[n] = x[off:off + math.prod(shapes[n])].view(shapes[n])
            moved[n] = tr[off:off + math.prod(shapes[n])].view(shapes[n])
    return weights, norms, moved, factors


def check_four_ranks(results: list) -> None:
    """Each rank's weights and norms against the reference, and the factors' adaptation (``results``:
    ``rank_side``'s, per rank, spawned by tests/parallel/test_compressed_references.py)."""
    for stage in (0, 1):
        per_rank = [r[stage] for r in results]
        first = per_rank[0]
        for r in per_rank[1:]:  # the compressed average leaves the same momentum, so the same weights, everywhere
            for n, t in r["params"].items():
                assert (t == first["params"][n]).all(), (stage, n)
        start = {n: torch.from_numpy(t) for n, t in first["start"].items()}
        want, norms, travel, factors = _reference(start, [r["grads"] for r in per_rank], first["layout"],
                                                  first["reduced"], first["norms"])
        scale = max(t.abs().max().item() for t in want.values())
        over = {n: ((torch.from_numpy(first["params"][n]) - want[n]).abs() - 1e-6 * scale - 4e-6 * travel[n]).max()
                for n in want}
        assert max(over.values()).item() <= 0, (stage, max(over.items(), key=lambda kv: kv[1]))
        moved = max((want[n] - start[n]).abs().max().item() for n in want)
        assert moved > 0.1, moved
        for got, ref in zip(first["norms"], norms):
            assert abs(got - ref) <= 1e-5 * ref, (stage, got, ref)
        values = [f for step in factors for f, _ in step.values()]
        held = sum(h for step in factors for _, h in step.values())
        # the factors adapt, the threshold holds some back, the upper bound stops some
        assert held > 0 and max(values) == FMAX, (max(values), held)
        if stage == 0:
            warm = sorted(first["sent"][1:FREEZE])[FREEZE // 2 - 1]
            assert max(first["sent"][FREEZE + 1:]) <= warm / 16, (first["sent"], warm)
        assert min(r["optim/compressed_bytes"] for r in first["records"][FREEZE:]) > 0


def test_the_metrics_take_the_extreme_trust_ratios_over_the_partitions():
    """With experts over ep > 1 a rank updates two partitions (dense and experts), each with its own layers'
    ratios: the step's smallest and largest ratio are over both, and the bytes are both's sum."""
    from types import SimpleNamespace

    from megazero.parallel.zero.onebit_lamb import ShardedOnebitLamb
    from megazero.parallel.zero.update import over_partitions

    dense = ShardedOnebitLamb.record(SimpleNamespace(coeff=torch.tensor([0.5, 2.0], dtype=torch.float64), sent=100.0))
    experts = ShardedOnebitLamb.record(SimpleNamespace(coeff=torch.tensor([0.1, 3.0], dtype=torch.float64), sent=40.0))
    both = over_partitions([dense, experts], torch.device("cpu"))
    got = dense.finish(both.tolist())
    assert got == {"optim/compressed_bytes": 140.0, "optim/trust_min": 0.1, "optim/trust_max": 3.0}, got
