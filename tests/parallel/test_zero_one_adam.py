"""0/1 Adam (parallel.zero.zero_one_adam) at 4 gloo ranks, ZeRO 0 and 1: 30 steps, each rank on its own two
microbatches, equal Lu et al. 2022's Algorithm 1 simulated for 4 workers in this process from the local gradients
each rank recorded. The policies (var_freeze_step 10, kappa 2, local_step_scaler 4, H 4) make T_v = {1, 2, 4, 6,
8}: the variance updated again after it first stood still (3, 5, 7); steps 3, 5, 7, 9, 10 average the momentum
compressed; past the freeze the ranks synchronise at 11-14, 16, 18, 20, 24 and 28 (intervals 1, 2 and 4) and
take local steps between, so after step 30 (two local steps past the last synchronisation, no last step
declared) every rank's weights are its own: each is compared with its own worker in the reference.

The reference, per flat bucket padded to 8 x 4 elements: a T_v step takes the summed gradient as the ranks summed
it (gloo's order) into both moments and Adam's bias-corrected step (v's correction by its updates so far); any
other step folds n * g_rank into worker r's momentum (elements whose sqrt(v_hat) <= eps left out); up to the
freeze the momenta are averaged by the two-phase compression with worker and server errors (1-bit Adam's,
tests/parallel/test_onebit_adam.py, a scale group per parameter), past it each worker accumulates
u_r += r_t m_r (r_t = lr / (1 - beta1^t)), the errors scaled once, at the freeze, by r into u's units, and a synchronisation averages
the u_r compressed, sets every momentum to u_bar / sum(r) and the anchor to anchor * prod(1 - lr wd) - u_bar /
(sqrt(v_hat) + eps); a worker's weights between are its anchor decayed less its u_r / (sqrt(v_hat) + eps).
Clipped at 1.0 by the norms the ranks report (checked against the reference's own to 1e-5). The reference
repeats the ranks' fp32 operations (add_ with alpha, addcmul_, addcdiv_, each group's norm over its row).

Tolerance, per element, 1e-6 of the largest weight plus 4e-6 of its travel, as the 1-bit Adam test (same
argument: the ranks' fp32 sums in other orders, ulps of m and v reaching a weight through 1/sqrt(v)). Without the
freeze's scaling of the errors, without the local steps (a synchronisation every step), without the decay of
the anchor or with one scale group for all the parameters the weights miss by far more (checked by mutation
when the test was written).

Communication, same spawn: a local step's update sends nothing (the step's only bytes are the norm's and the
overflow flags' scalars); a synchronisation sends what a 1-bit Adam step sends."""
from __future__ import annotations

import math

import torch

from tests.parallel.compressed_ranks import flat_bucket, train_stage, two_phase
from tests.parallel.test_onebit_adam import _reduced_gradients

WORLD, STEPS, FREEZE, KAPPA, SCALER, CLIP_H, LR, WD, CLIP = 4, 30, 10, 2, 4, 4, 1e-2, 0.1, 1.0
BETAS, EPS = (0.9, 0.95), 1e-8
# stage 1 runs the learning-rate-based T_u on a decaying rate: intervals 1 to step 16, 2 to 22, then 4
DECAYING = [LR] * 16 + [0.45 * LR] * 6 + [0.2 * LR] * 8
POLICY = {0: "steps", 1: "lr"}


def _rates(stage: int) -> list[float]:
    return DECAYING if POLICY[stage] == "lr" else [LR] * STEPS


def _policies(stage: int):
    """T_v (the steps schedule's closed form) and T_u: past the freeze, the step schedule's interval (1 doubled
    every SCALER steps, at most H) or the learning rate's (the largest power of two <= LR / lr, at most H); a
    step synchronises when it is a multiple of its interval."""
    from megazero.parallel.zero.zero_one_policy import local_interval, updates_variance

    exact = [updates_variance(t, FREEZE, KAPPA) for t in range(1, STEPS + 1)]
    if POLICY[stage] == "steps":
        sync = [t % local_interval(t, FREEZE, SCALER, CLIP_H) == 0 for t in range(1, STEPS + 1)]
    else:
        sync = [t % min(CLIP_H, 2 ** int(math.log2(LR / lr))) == 0 for t, lr in enumerate(DECAYING, 1)]
    return exact, sync


def rank_side(rank: int, world: int) -> list:
    from megazero.config.schema import OptimConfig
    from megazero.parallel.zero.registry import ZeroOneAdamSection

    exact, _ = _policies(0)
    out = []
    for stage in (0, 1):
        section = ZeroOneAdamSection(beta1=BETAS[0], beta2=BETAS[1], eps=EPS, var_freeze_step=FREEZE,
                                     var_update_scaler=KAPPA, local_step_scaler=SCALER, local_step_clipper=CLIP_H,
                                     local_step_policy=POLICY[stage])
        optim = OptimConfig(name="zero_one_adam", zero_one_adam=section)
        r = train_stage(rank, world, stage, optim, STEPS, _rates(stage), WD, CLIP,
                        keep=lambda step, zero, grid: _reduced_gradients(zero, grid, stage) if exact[step] else None)
        r["reduced"] = r["kept"]
        out.append(r)
    return out


def _reference(start: dict, grads: list[list[dict]], layout: list, reduced: dict, norms_seen: list[float],
               stage: int):
    """Algorithm 1 of Lu et al. 2022 for WORLD workers (see the module's docstring) at ``stage``'s rates and
    policies; returns each worker's weights, the norms, and each weight's travel."""
    b1, b2 = BETAS
    exact, sync = _policies(stage)
    rates = _rates(stage)
    shapes = {n: t.shape for n, t in start.items()}

    def flat(tensors: dict, numel: int, names: list) -> torch.Tensor:
        return flat_bucket(tensors, numel, names, WORLD)

    nb = len(layout)
    anchor = [flat(start, numel, names) for numel, names in layout]
    params = [flat({n: torch.full(shapes[n], float(1 + j % 255)) for j, (n, _) in enumerate(names)}, numel,
                   names).long() for numel, names in layout]
    decay = [flat({n: torch.full(shapes[n], float(len(shapes[n]) >= 2)) for n in shapes}, numel, names).bool()
             for numel, names in layout]
    m = [[torch.zeros_like(x) for x in anchor] for _ in range(WORLD)]
    v = [torch.zeros_like(x) for x in anchor]
    u = [[torch.zeros_like(x) for x in anchor] for _ in range(WORLD)]
    workers = [[torch.zeros_like(x) for x in anchor] for _ in range(WORLD)]
    servers = [[torch.zeros(x.numel() // WORLD) for x in anchor] for _ in range(WORLD)]
    local = [[x.clone() for x in anchor] for _ in range(WORLD)]
    travel = [torch.zeros_like(x) for x in anchor]
    lr_sum, kept, updates = 0.0, 1.0, 0
    norms = []
    for t in range(1, STEPS + 1):
        g = [[flat(grads[r][t - 1], numel, names) for numel, names in layout] for r in range(WORLD)]
        if exact[t - 1]:
            total = [flat(reduced[t - 1], numel, names) for numel, names in layout]
            norm = math.sqrt(sum(x.double().square().sum().item() for x in total))
        else:
            norm = math.sqrt(WORLD * sum(x.double().square().sum().item() for gr in g for x in gr))
        norms.append(norm)
        coef = min(1.0, CLIP / (norms_seen[t - 1] + 1e-6))
        LR = rates[t - 1]  # noqa: N806 (the step's rate)
        if t == FREEZE + 1:  # the errors into u's units
            for r in range(WORLD):
                for i in range(nb):
                    workers[r][i].mul_(LR / (1.0 - b1 ** t))
                    servers[r][i].mul_(LR / (1.0 - b1 ** t))
        rate = LR / (1.0 - b1 ** t)  # Adam's bias correction of the momentum
        updates += exact[t - 1]
        bc2 = math.sqrt(1.0 - b2 ** max(updates, 1))  # the variance's, by its updates so far
        if t > FREEZE:
            lr_sum, kept = lr_sum + rate, kept * (1.0 - LR * WD)
        for i in range(nb):
            before = local[0][i].clone()
            live = v[i].sqrt() / bc2 > EPS
            groups = torch.where(live, params[i], 0)  # each parameter its own scale group
            denom = v[i].sqrt().div_(bc2).add_(EPS)
            if exact[t - 1]:
                gi = total[i] * coef
                for r in range(WORLD):
                    m[r][i] = (m[r][i] * b1).add_(gi, alpha=1.0 - b1)
                v[i] = (v[i] * b2).addcmul_(gi, gi, value=1.0 - b2)  # the ranks' ops, to the ulp
                anchor[i] = torch.where(decay[i], anchor[i] * (1.0 - LR * WD), anchor[i])
                anchor[i] = anchor[i].addcdiv_(m[0][i], v[i].sqrt().div_(bc2).add_(EPS), value=-rate)
                for r in range(WORLD):
                    local[r][i] = anchor[i].clone()
            else:
                for r in range(WORLD):
                    m[r][i] = torch.where(live, (m[r][i] * b1).add_(g[r][i], alpha=(1.0 - b1) * WORLD * coef), 0.0)
                if t <= FREEZE:
                    avg = two_phase([m[r][i] for r in range(WORLD)], [w[i] for w in workers],
                                     [s[i] for s in servers], groups)
                    for r in range(WORLD):
                        m[r][i] = avg.clone()
                    anchor[i] = torch.where(decay[i], anchor[i] * (1.0 - LR * WD), anchor[i]).addcdiv_(avg, denom,
                                                                                                 value=-rate)
                    for r in range(WORLD):
                        local[r][i] = anchor[i].clone()
                else:
                    for r in range(WORLD):
                        u[r][i] = u[r][i].add(m[r][i], alpha=rate)
                    if sync[t - 1]:
                        avg = two_phase([u[r][i] for r in range(WORLD)], [w[i] for w in workers],
                                         [s[i] for s in servers], groups)
                        anchor[i] = torch.where(decay[i], anchor[i] * kept, anchor[i]) - avg / denom
                        for r in range(WORLD):
                            m[r][i] = avg / lr_sum
                            u[r][i] = torch.zeros_like(avg)
                            local[r][i] = anchor[i].clone()
                    else:
                        for r in range(WORLD):
                            local[r][i] = torch.where(decay[i], anchor[i] * kept, anchor[i]) - u[r][i] / denom
            travel[i] = travel[i] + (local[0][i] - before).abs()
        if t > FREEZE and sync[t - 1]:
            lr_sum, kept = 0.0, 1.0
    out = []
    for r in range(WORLD):
        weights, moved = {}, {}
        for x, tr, (numel, names) in zip(local[r], travel, layout):
            for n, off in names:
                weights[n] = x[off:off + math.prod(shapes[n])].view(shapes[n])
                moved[n] = tr[off:off + math.prod(shapes[n])].view(shapes[n])
        out.append((weights, moved))
    return out, norms


def check_four_ranks(results: list) -> None:
    """Each rank's weights, norms, bytes and policy figures against the reference (``results``:
    ``rank_side``'s, per rank, spawned by tests/parallel/test_compressed_references.py)."""
    assert _policies(0)[1] != _policies(1)[1]  # the rate's rule, not the steps', decides stage 1's synchronisations
    for stage in (0, 1):
        exact, sync = _policies(stage)
        assert not sync[STEPS - 1] and not sync[STEPS - 2] and any(not s for s in sync[FREEZE:])  # local steps
        per_rank = [r[stage] for r in results]
        first = per_rank[0]
        start = {n: torch.from_numpy(t) for n, t in first["start"].items()}
        want, norms = _reference(start, [r["grads"] for r in per_rank], first["layout"], first["reduced"],
                                 first["norms"], stage)
        scale = max(t.abs().max().item() for t in want[0][0].values())
        for r, (got, (ref, travel)) in enumerate(zip(per_rank, want)):
            over = {n: ((torch.from_numpy(got["params"][n]) - ref[n]).abs() - 1e-6 * scale - 4e-6 * travel[n]).max()
                    for n in ref}
            assert max(over.values()).item() <= 0, (stage, r, max(over.items(), key=lambda kv: kv[1]))
        apart = max(abs(per_rank[1]["params"][n] - first["params"][n]).max() for n in first["params"])
        assert apart > 1e-4, apart  # the local steps left each rank its own weights
        for got, ref in zip(first["norms"], norms):
            assert abs(got - ref) <= 1e-5 * ref, (stage, got, ref)
        silent = [s for t, s in enumerate(first["sent"]) if t >= FREEZE and not sync[t]]
        synced = [s for t, s in enumerate(first["sent"]) if t >= FREEZE and sync[t]]
        assert max(silent) < 100 < min(synced) / 10, (silent, synced)  # scalars only, against the signs
        last = first["records"][-1]
        assert last["optim/sync_interval"] == 4 and last["optim/var_interval"] == 0, last
        assert last["optim/silent_share"] == sum(not s for s in sync[FREEZE:]) / STEPS, last
        assert all(r["optim/compressed_bytes"] == 0 for t, r in enumerate(first["records"]) if exact[t])


def test_the_policies_closed_forms_equal_the_step_by_step_counters():
    """T_v and T_u's step schedule are closed forms of the step (a resume needs no counters): against the
    counters stepped one step at a time as the authors' implementation keeps them (an interval doubled after
    kappa updates; the interval doubled every scaler steps, at most H). The learning rate's interval: the largest
    power of two <= peak / lr, at most H, written as a loop."""
    from megazero.parallel.zero.zero_one_policy import LocalSteps, local_interval, updates_variance

    for freeze, kappa in ((10, 2), (1000, 16), (50, 3), (7, 1)):
        interval, counter, got = 1, 0, []
        for t in range(1, 1200):
            if t <= freeze and t % interval == 0:
                got.append(t)
                counter += 1
                if counter == kappa:
                    interval, counter = interval * 2, 0
        assert got == [t for t in range(1, 1200) if updates_variance(t, freeze, kappa)], (freeze, kappa)
    for freeze, scaler, clipper in ((6, 4, 4), (100, 7, 16), (3, 1, 1), (5, 3, 64)):
        interval, counter = 1, 0
        for t in range(freeze + 1, 3000):
            assert interval == local_interval(t, freeze, scaler, clipper), (t, interval)
            counter += 1
            if counter == scaler:
                interval, counter = min(clipper, interval * 2), 0
    for clipper in (1, 3, 16):
        policy = LocalSteps(freeze=5, scaler=2, clipper=clipper, by_lr=True, peak_lr=3e-4)
        for lr in (3e-4, 2.9e-4, 1.5e-4, 1.49e-4, 7.4e-5, 3e-5, 1e-7, 0.0, 6e-4):
            power = 1
            while power < clipper and lr * power * 2 <= 3e-4:
                power *= 2
            assert policy.interval(6, lr) == min(clipper, power), (clipper, lr)
            assert policy.interval(5, lr) == 1  # up to the freeze every step synchronises
